"""What every transport shares on top of Horovod's public collectives.

- ``Collectives`` starts the optimizer's allreduces and allgathers, one by one or, with Horovod's
  ``groups``, a group's tensors together as one grouped collective per kind and dtype.
- ``Reduction``: Horovod's op and its pre/post scale factors, as the user gave them.
- The finite flag: one element that rides with a rank's values and tells every rank, from the sum,
  whether some rank's accumulator was non-finite.
- ``agree``: numbers every rank holds bit for bit, for decisions that must be identical everywhere.
- ``wait``: Horovod's ``synchronize`` without its busy wait; ``Waits``: a generator of collectives run
  to its end, at once or polled until a deadline.
- ``reduce_scatter_async`` / ``reduce_scatter_wait``: a sum's reduce-scatter as an alltoall and adds.
"""
import os
import time
from typing import NamedTuple

import torch
from horovod.torch import mpi_ops

__all__ = ["Collectives", "Reduction", "finite_flag", "flag_raised", "agree", "wait", "nap", "ranks_share_cores",
           "Waits", "reduce_scatter_async", "Scatter", "reduce_scatter_wait", "reduce_scatter_sum", "add_rows"]

# wait()'s sleeps between polls: an eighth of the time waited so far, from 20 us to at most 1 ms, so that
# a short wait ends soon after its collective and a long one wakes 1,000 times a second. Not at most
# 100 us: 10,000 wake-ups a second per waiting rank took the cores from Open MPI's
# spinning progress, and 4 ranks on 2 cores under mpirun took 14-318 s for a 16-step job that takes
# 13-24 s with the 1 ms cap (docs/studies/2026-11-wait-poll-vs-spin.md). HVD_TOPK_SPIN_WAIT=1 waits
# as Horovod does (spinning): the least latency where every rank has cores of its own.
_FIRST_SLEEP_S, _LONGEST_SLEEP_S = 2e-5, 1e-3
_SPIN = os.environ.get("HVD_TOPK_SPIN_WAIT") == "1"


def wait(handle):
    """The output of Horovod's asynchronous collective ``handle``: ``mpi_ops.synchronize(handle)``,
    reached through ``mpi_ops.poll`` and short sleeps.

    Why: ``synchronize`` spins (Horovod 0.28.1 waits in a yield loop) until the background thread
    is done, so every waiting rank burns a whole core. Where ranks share cores (oversubscribed CPU jobs,
    several ranks per host) the spinning takes the CPU from the ranks and Horovod threads that do the
    work. A wait ends at most an eighth of its length (and 1 ms) after its collective did.
    Errors are ``synchronize``'s own (a finished ``poll`` leaves them to it)."""
    start = time.monotonic()
    while not _SPIN and not mpi_ops.poll(handle):
        nap(start)
    return mpi_ops.synchronize(handle)


class Waits:
    """Runs ``steps``, a generator of collectives: each ``yield handle`` of a Horovod asynchronous
    collective gets back that collective's output (``synchronize``'s); what the generator returns is
    ``result`` once ``done``.

    ``finish()`` waits for each collective in turn (``wait``). ``advance(until)`` starts what it can and
    polls, asleep between polls, until the generator is done or ``time.monotonic()`` reaches ``until``;
    it never blocks on a collective, so a caller may run it where some rank could be late (a stock
    door's drain after the backward pass), leaving the rest to ``finish()``."""

    def __init__(self, steps):
        self.steps, self.handle, self.done, self.result = steps, None, False, None
        self._send(None)                  # runs to the first collective it waits for

    def _send(self, output):
        try:
            self.handle = self.steps.send(output)
        except StopIteration as end:
            self.handle, self.done, self.result = None, True, end.value

    def advance(self, until):
        start = time.monotonic()
        while not self.done:
            if mpi_ops.poll(self.handle):
                self._send(mpi_ops.synchronize(self.handle))
            elif time.monotonic() >= until:
                return
            else:
                nap(start)

    def finish(self):
        while not self.done:
            self._send(wait(self.handle))
        return self.result


def shared_cores_setting(text):
    """HVD_TOPK_SHARED_CORES as given: True for '1', False for '0', None (the rule decides) unset or empty."""
    if text in (None, ""):
        return None
    if text not in ("0", "1"):
        raise ValueError(f"HVD_TOPK_SHARED_CORES must be '0' or '1' (unset: ranks per host against its cores), "
                         f"got {text!r}")
    return text == "1"


_SHARED_CORES = shared_cores_setting(os.environ.get("HVD_TOPK_SHARED_CORES"))


def ranks_share_cores():
    """Whether this host runs more of the job's ranks than it has cores: then a rank that spins while it
    waits takes the CPU from the ranks still working, and one that sleeps gives it back
    (docs/studies/2026-11-wait-poll-vs-spin.md). Each rank's own affinity is not counted: ranks bound
    to a core each share none. HVD_TOPK_SHARED_CORES=1 (or 0) says so (or not) where Horovod's hosts
    are not machines: hosts that share one machine's cores (containers on one node, the benchmarks'
    emulated hosts) each count only their own ranks."""
    if _SHARED_CORES is not None:
        return _SHARED_CORES
    return mpi_ops.local_size() > (os.cpu_count() or 1)


def nap(since):
    """One of ``wait``'s sleeps between polls, for a wait that began at ``since`` (``time.monotonic()``);
    none with HVD_TOPK_SPIN_WAIT=1."""
    if not _SPIN:
        time.sleep(min(max(_FIRST_SLEEP_S, (time.monotonic() - since) / 8), _LONGEST_SLEEP_S))


class Scatter(NamedTuple):
    """A reduce-scatter in flight (``reduce_scatter_async``)."""
    handle: int             # the alltoall's
    ranks: int              # the set's size: rows of the alltoall's output
    numel: int              # elements sent, the buffer padded to a multiple of ``ranks``


def reduce_scatter_async(flat, name, process_set):
    """Start the ranks' sum of the 1-D ``flat``, padded with zeros to a multiple of ``process_set``'s size
    and scattered in equal shards, shard j to the set's j-th rank; ``reduce_scatter_wait`` ends it.

    Why not Horovod's ``reducescatter``: on Gloo it took 1.5-3x the time of an alltoall of the shards
    and the adds (2 ranks of a 2-core machine, 4M float32: 54-59 ms against 20-22 ms), and it adds
    float16 in software. The alltoall sends what a ring reduce-scatter sends."""
    ranks = process_set.size()
    shard = -(-flat.numel() // ranks)
    pad = shard * ranks - flat.numel()
    padded = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    splits = torch.full((ranks,), shard, dtype=torch.int32)
    return Scatter(mpi_ops.alltoall_async(padded, splits=splits, name=name, process_set=process_set), ranks,
                   padded.numel())


def reduce_scatter_wait(started):
    """This rank's shard of the sum ``reduce_scatter_async`` started (``add_rows`` of the ranks' pieces)."""
    return reduce_scatter_sum(started, wait(started.handle))


def reduce_scatter_sum(started, output):
    """``reduce_scatter_wait`` from the alltoall's ``output`` (``synchronize``'s), already waited for."""
    received, _ = output
    return add_rows(received.view(started.ranks, -1))


def add_rows(rows):
    """The sum of ``rows`` (one rank's piece each, in rank order), added one row after the other, 16-bit
    ones in float32: the ranks that add the same rows get the same bits."""
    wide = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype
    total = rows[0].to(wide, copy=True)
    for row in rows[1:]:
        total.add_(row)             # widened as it is read: no float32 copy of the row
    return total


class Reduction(NamedTuple):
    """How values are combined across ranks: Horovod's ``op`` (Average or Sum) and, for Average, the
    scale factors of ``gradient_predivide_factor`` (prescale 1/f before the sum, postscale f after)."""
    op: object
    prescale: float = 1.0
    postscale: float = 1.0

    @classmethod
    def of(cls, op, gradient_predivide_factor=1.0):
        if op == mpi_ops.Average:
            return cls(op, 1.0 / gradient_predivide_factor, gradient_predivide_factor)
        return cls(op)


def agree(values, name, average=True, process_set=mpi_ops.global_process_set):
    """``values`` averaged over the ranks of ``process_set`` (or its first rank's with ``average=False``),
    as that rank holds them.

    The broadcast makes the bits identical everywhere (an allreduce alone may round differently per
    rank), so decisions taken from the result are the same on every rank. Collective.
    """
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    size = process_set.size()
    if size == 1:
        return t.tolist()
    if average:
        t = wait(mpi_ops.allreduce_async(t, op=mpi_ops.Sum, name=f"{name}.sum", process_set=process_set)) / size
    return wait(mpi_ops.broadcast_async(t, root_rank=process_set.ranks[0], name=name,
                                        process_set=process_set)).tolist()


def finite_flag(finite, like):
    """One element that rides with the values: 0 if this rank's accumulator is finite, else 1."""
    return torch.tensor([0.0 if finite else 1.0], dtype=like.dtype, device=like.device)


def flag_raised(flag):
    """True when an aggregated flag says some rank was non-finite (its sum > 0, or itself NaN/Inf)."""
    return not bool(torch.isfinite(flag)) or bool(flag != 0)


class Collectives:
    """The allreduces and allgathers of the optimizer's tensors, grouped as Horovod's ``groups`` are.

    A key (tensor) in no group starts its collective at once. The keys of a group wait until each of
    them has been submitted once, then start together: one grouped allreduce and one grouped
    allgather per dtype, tensors in key order, which Horovod negotiates as one and fuses into one
    buffer, so the step sends fewer and larger messages (at small ratios the per-message cost
    dominates: docs/studies/2026-11-fewer-messages-groups.md). The first ``wait`` of a step starts
    every group still pending as it is: the same on every rank when every rank submitted the same
    keys, as Horovod's collectives require anyway.

    Args:
        name: prefix of the grouped collectives' names (identical on all ranks).
        groups: lists of keys; a key in no list is in no group.
    """

    def __init__(self, name, groups=(), process_set=mpi_ops.global_process_set):
        self.name = name
        self.process_set = process_set        # every collective runs within it
        self.set_groups(groups)
        self.pending = {}          # group id -> {key: [(kind, tensor, options, slot)]}
        self.launched = {}         # group id -> launches this step (names stay the same step to step,
                                   # so Horovod's response cache hits)

    def set_groups(self, groups):
        """Lists of keys; a key in no list is in no group. Before the first step only."""
        self.group_of = {key: gid for gid, keys in enumerate(groups) for key in keys}
        self.sizes = [len(keys) for keys in groups]

    def allreduce(self, key, tensor, name, op, prescale_factor=1.0, postscale_factor=1.0, inplace=False):
        """Start (or queue in ``key``'s group) an allreduce; returns ``wait() -> output``. ``inplace``
        reduces ``tensor`` itself when it starts at once."""
        options = dict(op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        if key not in self.group_of:
            start = mpi_ops.allreduce_async_ if inplace else mpi_ops.allreduce_async
            handle = start(tensor, name=name, process_set=self.process_set, **options)
            return lambda: wait(handle)
        return self._queue(key, [("allreduce", tensor, options)])[0]

    def allgather(self, key, tensors, name):
        """Start (or queue in ``key``'s group) an allgather of each of ``tensors`` (named
        ``{name}.{i}``); returns one ``wait() -> output`` per tensor."""
        if key not in self.group_of:
            handles = [mpi_ops.allgather_async(t, name=f"{name}.{i}", process_set=self.process_set)
                       for i, t in enumerate(tensors)]
            return [lambda h=h: wait(h) for h in handles]
        return self._queue(key, [("allgather", t, {}) for t in tensors])

    def _queue(self, key, items):
        gid = self.group_of[key]
        group = self.pending.setdefault(gid, {})
        if key in group:
            raise RuntimeError(f"hvd_topk: tensor {key!r} submitted twice in one step")
        slots = [{} for _ in items]
        group[key] = [item + (slot,) for item, slot in zip(items, slots)]
        if len(group) == self.sizes[gid]:
            self._launch(gid)
        return [lambda slot=slot: self._wait(slot) for slot in slots]

    def _launch(self, gid):
        """Start the group's collectives: one per (kind, dtype, options), tensors in key order."""
        group = self.pending.pop(gid)
        batches = {}
        for key in sorted(group):
            for kind, tensor, options, slot in group[key]:
                batch_key = (kind, str(tensor.dtype), tuple(sorted(options.items())))
                batches.setdefault(batch_key, []).append((tensor, slot))
        again = self.launched.get(gid, 0)
        self.launched[gid] = again + 1
        for i, ((kind, _, options), batch) in enumerate(sorted(batches.items(), key=lambda b: repr(b[0]))):
            name = f"{self.name}.{gid}.{i}.{kind}" + (f".{again}" if again else "")
            tensors = [t for t, _ in batch]
            handle = (mpi_ops.grouped_allreduce_async(tensors, name=name, process_set=self.process_set,
                                                      **dict(options)) if kind == "allreduce"
                      else mpi_ops.grouped_allgather_async(tensors, name=name, process_set=self.process_set))
            shared = {"handle": handle}
            for j, (_, slot) in enumerate(batch):
                slot.update(shared=shared, index=j)

    def end_step(self):
        """Call on every rank after the step's last ``wait``."""
        if self.pending:
            raise RuntimeError(f"hvd_topk: groups {sorted(self.pending)} were submitted but never waited for")
        self.launched = {}

    def start_pending(self):
        """Start every group still pending, as it is: before a wait, and before a transport adds
        collectives at ``finish`` (a rank waiting on them must not hold back a group another waits on)."""
        for gid in sorted(self.pending):
            self._launch(gid)

    def _wait(self, slot):
        """The output of one queued tensor (its group's grouped collective waited for once)."""
        if "shared" not in slot:               # the group is incomplete: start every pending group
            self.start_pending()
        shared = slot["shared"]
        if "outputs" not in shared:
            shared["outputs"] = wait(shared.pop("handle"))
        return shared["outputs"][slot["index"]]
