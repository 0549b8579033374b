"""Dense: a plain allreduce of the whole tensor, as cheap as stock Horovod; and dense in fp16 with
error feedback.

For tensors never compressed (1-D, small, integer) and for sparse ones at density 1 (dense steps, ratio
1.0, auto's dense plan). ``acc`` may be the gradient itself: it is only read, so nothing is copied before
sending, and no flag is appended: a non-finite rank shows in the sum, read after (identical on all
ranks). Everything is sent, so the residual is flushed (``sent`` None).

``DenseFP16`` (auto's ``'dense_fp16'``) sends every entry in fp16, half of dense's bytes, and keeps what
fp16 did not carry in the residual (``Outcome.residual``, ``acc - sent``), as split_reduce does with
its 16-bit values: the rounding, the entries below fp16's range, and the excess of any entry clamped to
the largest power of two under 65504 / ranks, so that no sum of the ranks' values can overflow to inf
(a power of two: fp16 holds it exactly, where a rounded limit could round up). The float16 values are
summed by exchange in float32 (``lowrank_wire.sum_by_exchange``, as low rank's P and Q: Horovod adds
float16 in software, 3x the time of float32, and rounds every partial sum), the same bits on every
rank; Horovod's op and scale factors are applied to the sum. A non-finite rank sends NaN in that
tensor, so every rank skips the step.

On more than 2 ranks its tensors travel in buckets (``hvd_topk.transports.fused``), laid end to end:
one exchange per bucket, which leaves during the backward pass once its keys have come, not one
alltoall and one allgather per tensor, each tensor's second phase waiting for its first at
``synchronize()`` (across 2 emulated hosts the char LM's step took 514 ms that way against dense's 393).
On 2 ranks each tensor goes alone, as soon as its gradient is ready: its exchange is one allgather, which
a bucket only holds back (the wide CNN on an unlimited loopback stepped 1.54x dense's in buckets,
1.08x alone; the char LM at 100 Mbit/s 191.9 against 176.6-180.9 ms).

Across hosts (``hosts``: the hosts' process sets, where ``communication='hierarchical'`` found them; auto's
dense_fp16 stays flat, as its model prices it) a bucket goes through them, as ``Hierarchical`` sends Top-K:

1. Host: the ranks' float32 accumulators, laid end to end, are reduce-scattered inside the host
   (``collectives.reduce_scatter_async``): the rank at position j gets the host's exact sum of shard j.
2. Across hosts: that sum goes in fp16 (``encode_fp16``) to the ranks at position j on the other hosts,
   summed by exchange in float32. Only this step crosses the slow link: each host sends the model once
   in fp16, where the flat exchange of its ranks sends it about twice (an alltoall and an allgather
   over every rank) and a ring allreduce 1.5 times (docs/design.md has the bytes and steps measured).
3. Host: the shards' float32 sums are allgathered inside the host: every rank has the same bits.

Error feedback per shard, as ``Hierarchical``'s: the owner of shard j keeps what fp16 did not carry of
the host's sum there; a rank's residual is zero elsewhere (its accumulator went whole into the host's
exact sum). A non-finite accumulator makes its shard's sum non-finite (marked NaN by ``encode_fp16``),
which reaches every rank in step 3: each rank skips the step for the bucket's keys.
"""
import math

import torch
from horovod.torch import mpi_ops

from ..core.sparsify import sq_norm_finite
from .base import Outcome, Started
from .collectives import reduce_scatter_async, reduce_scatter_sum
from .fused import Buckets, as_phase
from .lowrank_wire import sum_by_exchange

__all__ = ["Dense", "DenseFP16", "encode_fp16", "decode_sum"]


class Dense:
    """Allreduce everything.

    Args:
        collectives: the ``Collectives`` that start the allreduce.
        reduction: ``Reduction``.
        value_dtype: dtype on the wire; None keeps the tensor's.
        name: middle part of the collective's name (``hvd_topk.<name>.<key>``).
    """

    def __init__(self, collectives, reduction, value_dtype=None, name="values"):
        self.collectives, self.reduction, self.value_dtype, self.name = collectives, reduction, value_dtype, name

    def forget(self):
        """Nothing outlives a step."""

    def start(self, key, acc, k=None, finite=None, grad=None, step=None, k_next=None):
        vdtype = self.value_dtype or acc.dtype
        buf = acc if acc.dtype == vdtype else acc.to(vdtype)
        r = self.reduction
        wait = self.collectives.allreduce(key, buf, f"hvd_topk.{self.name}.{key}", r.op, r.prescale, r.postscale)

        def finish():
            out = wait()
            return Outcome(out.to(acc.dtype) if sq_norm_finite(out)[1] else None, None)
        return Started(buf.numel() * buf.element_size(), 0.0, finish)


class DenseFP16:
    """Every entry in fp16, summed by exchange, one exchange per bucket; what fp16 does not carry stays
    in the residual (module docstring). Its collectives are its own (``sum_by_exchange``), not
    ``collectives``' groups, whose pending groups start before it waits.

    Args:
        collectives: the ``Collectives`` whose process set the values are summed over.
        reduction: ``Reduction``: Horovod's op and scale factors, applied to the sum.
        name: prefix of the buckets' collective names (``<name>.bucket<i>``).
        stats: ``StepStats`` that records the phases, or None.
        hosts: ``host_sets.HostSets`` to send through (module docstring), or None: flat over ``collectives``.
    """

    # every entry travels: a bucket is long on the wire, so the first (the last layers', ready first)
    # leaves early in the backward pass, as DDP's first bucket of 1 MiB does (module docstring)
    first_bucket_mb = 1.0

    def __init__(self, collectives, reduction, name="hvd_topk.values16", stats=None, hosts=None):
        self.collectives, self.reduction, self.hosts = collectives, reduction, hosts
        self.buckets = Buckets(name, self._phases, stats)

    def forget(self):
        """Nothing outlives a step but the bucket plan."""
        self.buckets.forget()

    def drain(self, until):
        """Advance the buckets in flight until done or ``until`` (``Buckets.drain``); never blocks."""
        self.buckets.drain(until)

    def start(self, key, acc, k=None, finite=None, grad=None, step=None, k_next=None):
        if self._live_hosts() is not None:      # acc is read when its bucket leaves; its bytes are the host's
            # reduce-scatter's, as Hierarchical's (only 2 bytes an entry of one shard cross hosts)
            self.buckets.add(key, dict(acc=acc.reshape(-1), shape=acc.shape, dtype=acc.dtype))
            return Started(acc.numel() * 4, 0.0, lambda: self.buckets.finish(key, self.collectives.start_pending))
        ranks = self.collectives.process_set.size()
        buf, residual = encode_fp16(acc, ranks)
        # on 2 ranks a tensor's exchange is one allgather, started as its gradient is ready: a bucket
        # would only hold it back (module docstring)
        self.buckets.add(key, dict(buf=buf, residual=residual, shape=acc.shape, dtype=acc.dtype), alone=ranks <= 2)
        return Started(buf.numel() * buf.element_size(), 0.0,
                       lambda: self.buckets.finish(key, self.collectives.start_pending))

    def _live_hosts(self):
        """``hosts`` while Horovod has their sets, else None: flat (a tuner may remove them where no plan
        of its holds hierarchical, ``hvd_topk.auto.decide``; every rank at the same step)."""
        return self.hosts if self.hosts is not None and self.hosts.host.process_set_id is not None else None

    def _phases(self, name, items):
        """The bucket's phases (``fused.Buckets``): through the hosts where ``start`` kept its accumulators."""
        through_hosts = "acc" in next(iter(items.values()))
        return (self._phases_across_hosts if through_hosts else self._phases_flat)(name, items)

    def _scale(self):
        """The factor of Horovod's op and scale factors on the ranks' sum; the ranks are read each step
        (elastic resizes; hierarchical's hosts hold every rank of the global set)."""
        r, ranks = self.reduction, self.collectives.process_set.size()
        return r.prescale * r.postscale / (ranks if r.op == mpi_ops.Average else 1)

    def _phases_flat(self, name, items):
        """The bucket's one phase, its float16 values laid end to end and summed by exchange."""
        ps, keys, scale = self.collectives.process_set, list(items), self._scale()
        flat = _end_to_end([items[key]["buf"] for key in keys])
        total = yield from as_phase("exchange", sum_by_exchange(flat, ps, name, []))
        outcomes = {}
        for key, part in zip(keys, total.split([items[key]["buf"].numel() for key in keys])):
            item = items[key]
            summed = decode_sum(part, scale, item["dtype"])
            outcomes[key] = Outcome(None, None) if summed is None else \
                Outcome(summed.reshape(item["shape"]), None, residual=item["residual"])
        return outcomes

    def _phases_across_hosts(self, name, items):
        """The bucket's three phases through the hosts (module docstring, steps 1-3)."""
        hosts, keys, scale = self.hosts, list(items), self._scale()
        accs = [items[key]["acc"].to(torch.float32) for key in keys]      # no copy of a float32 one
        flat = _end_to_end(accs)
        scattered = reduce_scatter_async(flat, f"{name}.scatter", hosts.host)
        shard = reduce_scatter_sum(scattered, (yield "scatter", scattered.handle))
        buf, shard_residual = encode_fp16(shard, hosts.hosts)
        crossed = yield from as_phase("cross", sum_by_exchange(buf, hosts.cross, f"{name}.cross", []))
        gathered = yield "gather", mpi_ops.allgather_async(crossed, name=f"{name}.gather", process_set=hosts.host)
        total = decode_sum(gathered[:flat.numel()], scale, torch.float32)   # one NaN skips the bucket
        first = hosts.position * shard.numel()                # this rank's shard: flat[first:first + len]
        outcomes, offset = {}, 0
        for key, acc in zip(keys, accs):
            item, end = items[key], offset + acc.numel()
            if total is None:
                outcomes[key] = Outcome(None, None)
            else:
                # zero but for the shard; a float64 accumulator also keeps its tail below float32
                residual = torch.zeros_like(acc) if acc is item["acc"] else item["acc"] - acc.to(item["dtype"])
                low, high = max(offset, first), min(end, first + shard.numel())
                if low < high:
                    residual[low - offset:high - offset] += shard_residual[low - first:high - first].to(item["dtype"])
                outcomes[key] = Outcome(total[offset:end].to(item["dtype"]).reshape(item["shape"]), None,
                                        residual=residual)
            offset = end
        return outcomes


def _end_to_end(tensors):
    """``tensors`` laid end to end, flat; a tensor alone (2 ranks) is not copied."""
    return tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])


def encode_fp16(acc, ranks):
    """(``acc`` in fp16, clamped so that ``ranks`` values sum to at most fp16's largest, NaN first where
    ``acc`` is not finite; what fp16 did not carry, ``acc - buf``). Also timed by
    ``hvd_topk.auto.measure.time_compression``: the model prices dense_fp16 at this work."""
    # the largest value a rank sends: N of them still sum to at most fp16's largest (a shard's sum
    # goes back to float16 on more than 2 ranks)
    limit = 2.0 ** math.floor(math.log2(torch.finfo(torch.float16).max / ranks))
    # one pass that allocates nothing tells both whether acc is finite (NaN and inf show in its extremes)
    # and whether any entry needs the clamp: a gradient almost never does, and each full-size temporary
    # costs its page faults on a busy host (the wide CNN's encode took 59 ms a step with four of them)
    low, high = (float(x) for x in torch.aminmax(acc)) if acc.numel() else (0.0, 0.0)
    buf = acc.to(torch.float16) if -limit <= low and high <= limit else acc.clamp(-limit, limit).to(torch.float16)
    if not (math.isfinite(low) and math.isfinite(high)):    # clamp would turn inf into a finite value
        buf.view(-1)[0] = float("nan")
    return buf, torch.sub(acc, buf)     # float32 minus float16 in float32: no float32 copy of buf


def decode_sum(total, scale, dtype):
    """The ranks' float32 sum ``total`` scaled to Horovod's op, in ``dtype``, scaled in place (``total`` is
    the caller's own); None where it is not finite (a rank sent NaN). Also timed by
    ``hvd_topk.auto.measure.time_compression``."""
    if not sq_norm_finite(total)[1]:
        return None
    if scale != 1:
        total.mul_(scale)
    return total.to(dtype)
