"""Per-step figures of both front doors (``opt.stats()``, ``TopKEF.stats()``, ``PowerSGD.stats()``), and a
TensorBoard writer.

The figures of a step (``StepStats.last()``):

bytes_sent: payload this rank hands to the collectives (values, flags, indices, frames and message headers;
the collective's own fan-out excluded: the link counters of the benchmarks, ``testbed/wire.py``, measure those).
compression_gain: ||sent||^2 / ||acc||^2 over the compressed tensors (GraVAC's gain).
density: the fraction of each compressed tensor the step sent: top-k's (the caller's, from its schedule), or,
when every compressed tensor went low rank, theirs (``lowrank_density``), and then ``ratio`` None: no top-k ratio
applied. lowrank_density (low rank only): the values of P and Q sent over the elements of those tensors.
split_kept, split_imbalance (split_reduce only): rows the owners kept, over all its tensors, and how many
rows the busiest owner of each tensor kept, summed, over the mean per owner (1.0: balanced regions; P: one
owner kept everything).

Where the step's time went (seconds, docs/optimizer.md "Where a step's time goes"): ``time_step_s`` from the end
of the last step's synchronization to the end of this one's, split into ``time_select_s`` (accumulate + select),
``time_pack_s`` (coding the messages), ``time_sync_s`` (synchronize: waiting for and unpacking the aggregates;
TopKEF: from its step's first decompress, or the last compress where its global bucket left, to its last
decompress, less the selecting and packing done there),
``time_optimizer_s`` (the wrapped optimizer's step, inside this window: the last step's; TopKEF cannot see it)
and ``time_compute_s``, the rest: forward and backward not overlapped with our work. Of ``time_sync_s``:
``time_wait_s`` blocked on the fused transports' collectives (also per phase, ``time_wait_<phase>_s``, with
``collectives_<phase>`` started) and ``time_unpack_s``. ``comm_hidden``: the share of the fused buckets' time in
flight not spent blocked on them, i.e. hidden behind compute (a bucket counts as in flight until its outcome is
read, at a poll or a wait).
"""
import contextlib
import time

__all__ = ["StepStats", "write_tensorboard", "hidden_share"]

TIME_PARTS = ("select", "pack", "unpack")       # our own work, timed where it runs (time.perf_counter)


class StepStats:
    """Counts one step as it happens; ``last()`` gives the finished step's figures (module docstring)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._reset()
        self._last, self._mark = {}, None     # the last step's figures; clock() at its end

    def _reset(self):
        self.bytes_sent = 0
        self.sent_sq = 0.0
        self.acc_sq = 0.0
        self.dense_tensors = 0
        self.sparse_tensors = 0
        self.lowrank = [0, 0, 0]          # values sent, elements and count of the tensors that went low rank
        self.skipped = False
        self.split = None                 # [rows kept, busiest owners' rows, ranks] once split_reduce ran
        self.times = dict.fromkeys(TIME_PARTS + ("optimizer", "wait"), 0.0)
        self.waits, self.collectives, self.flights = {}, {}, []
        self.sync_start = None            # clock() where TopKEF's step began to decompress
        self.in_sync = 0.0                # select + pack seconds inside TopKEF's sync window: not sync too

    def add_sent(self, nbytes, sent_sq, acc_sq, select_s=0.0, dense=False, lowrank=None):
        """Record one tensor's contribution to this step (``lowrank``: (values sent, elements) of one that
        went low rank)."""
        if lowrank is not None:
            self.lowrank = [self.lowrank[0] + lowrank[0], self.lowrank[1] + lowrank[1], self.lowrank[2] + 1]
        self.bytes_sent += nbytes
        self.sent_sq += sent_sq
        self.acc_sq += acc_sq
        self.times["select"] += select_s
        if dense:
            self.dense_tensors += 1
        else:
            self.sparse_tensors += 1

    def add_split(self, kept, busiest, ranks, nbytes):
        """Record one split_reduce tensor: rows kept, the busiest owner's rows, the ranks and the payload
        of its later phases."""
        self.bytes_sent += nbytes
        last = self.split or [0, 0, ranks]
        self.split = [last[0] + kept, last[1] + busiest, ranks]

    @contextlib.contextmanager
    def selecting(self):
        """Times the block as accumulate + select: its seconds less those it spent packing."""
        t0, packed = time.perf_counter(), self.times["pack"]
        yield
        self.add_time("select", time.perf_counter() - t0 - (self.times["pack"] - packed))

    def syncing(self):
        """TopKEF: its step begins to wait for and read aggregates (the first call of a step counts)."""
        if self.sync_start is None:
            self.sync_start = self.clock()

    def add_bytes(self, nbytes):          # a fused bucket's frames and message headers, beside its entries
        self.bytes_sent += nbytes

    def add_time(self, part, seconds):
        """Seconds of our own work: 'select', 'pack', 'unpack' or 'optimizer'."""
        self.times[part] += seconds
        self.in_sync += seconds if part in ("select", "pack") and self.sync_start is not None else 0.0

    def add_collective(self, phase):
        """A fused transport started one collective of ``phase``."""
        self.collectives[phase] = self.collectives.get(phase, 0) + 1

    def add_wait(self, phase, seconds):
        """Seconds blocked on a fused transport's collective of ``phase``."""
        self.waits[phase] = self.waits.get(phase, 0.0) + seconds
        self.times["wait"] += seconds

    def add_flight(self, start, end):
        """A fused bucket was in flight from ``start`` to ``end`` (``time.perf_counter``)."""
        self.flights.append((start, end))

    def end_step(self, density, comm_s=None):
        """Close the step (``comm_s``: the seconds of its synchronization; None: since ``syncing()``)."""
        now = self.clock()
        comm_s = (0.0 if self.sync_start is None else now - self.sync_start) if comm_s is None else comm_s
        t = self.times
        step_s = 0.0 if self._mark is None else now - self._mark
        sync_s = comm_s - self.in_sync            # the parts below are disjoint, so they add up to the step
        ours = t["select"] + t["pack"] + sync_s + t["optimizer"]
        self._mark = now
        self._last = {"bytes_sent": self.bytes_sent, "density": density,
                      "compression_gain": self.sent_sq / self.acc_sq if self.acc_sq > 0 else 1.0,
                      "select_s": t["select"], "comm_s": comm_s,
                      "dense_tensors": self.dense_tensors, "sparse_tensors": self.sparse_tensors,
                      "skipped": self.skipped, "time_step_s": step_s,
                      "time_compute_s": max(0.0, step_s - ours),
                      "time_sync_s": sync_s, "time_wait_s": t["wait"],
                      **{f"time_{part}_s": t[part] for part in TIME_PARTS + ("optimizer",)},
                      **{f"time_wait_{phase}_s": s for phase, s in sorted(self.waits.items())},
                      **{f"collectives_{phase}": n for phase, n in sorted(self.collectives.items())}}
        values, elements, tensors = self.lowrank
        if elements:
            self._last["lowrank_density"] = values / elements
            if tensors == self.sparse_tensors:      # no tensor went top-k: its density and ratio said nothing
                self._last.update(density=values / elements, ratio=None)
        if self.flights:
            self._last["comm_hidden"] = hidden_share(self.flights, t["wait"])
        if self.split is not None:
            kept, busiest, ranks = self.split
            self._last.update(split_kept=kept, split_imbalance=busiest * ranks / kept if kept else 1.0)
        self._reset()

    def last(self):
        """Dict of the last finished step's figures."""
        return dict(self._last)


def hidden_share(flights, blocked):
    """The share of the time any of ``flights`` ((start, end) pairs) was in flight that was not spent
    ``blocked`` waiting for them: the communication hidden behind other work, in [0, 1].

    Example:
        >>> hidden_share([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], blocked=1.0)
        0.75
    """
    span, reach = 0.0, None
    for start, end in sorted(flights):
        if reach is None or start > reach:
            span += end - start
            reach = end
        elif end > reach:
            span += end - reach
            reach = end
    return max(0.0, span - blocked) / span if span > 0 else 0.0


def write_tensorboard(writer, stats, step):
    """Write a ``stats()`` dict to a ``torch.utils.tensorboard.SummaryWriter`` under hvd_topk/."""
    for key, value in stats.items():
        if value is not None:           # the ratio of a low-rank step
            writer.add_scalar(f"hvd_topk/{key}", float(value), step)
