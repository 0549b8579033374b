"""Hierarchical: dense inside a host, sparse only across hosts (BytePS, Horovod's hierarchical allreduce).

Inside a host ranks share memory; between hosts the link is slow. With L ranks on each of H hosts:

1. Host: an exact dense reduce-scatter (sum) of every rank's flat accumulator over its host set
   (``host_sets``), padded to a multiple of L: the rank at position j of its host receives the host's
   sum of shard j (1/L of the tensor). It is an alltoall of the shards whose owner adds them
   (``collectives.reduce_scatter_async``: Horovod's reducescatter took 1.5-3x as long on Gloo).
2. Across hosts: that sum is the shard's accumulator. Its top-k (k scaled to the shard) goes through
   an existing sparse transport (``SplitReduce`` by default) over the cross set: the ranks at position
   j on every host, one per host. Only this step crosses the slow link: each host sends k entries in
   all, not k per rank.
3. Host: an allgather over the host set of every shard's kept entries (value, index rows: about k/L
   per shard, not the shard), a finite flag and the entries the host nominated gives every rank the
   same dense aggregate, bit for bit.

Error feedback per shard. A rank's residual is zero outside its shard, so the reduce-scatter of the
ranks' accumulators (gradient + residual) adds exactly the owner's residual to the host's sum of the
shard's gradients. After the step ``acc`` is rewritten to that shard accumulator, zero elsewhere, and
``sent`` names its entries the cross-host transport took: the caller's usual ``residual = acc with sent
zeroed`` then holds, per shard, Σ sent + residual = Σ (host's gradients). Where the cross-host transport
computes the shard's residual itself (16-bit values keep their rounding in it), that residual is the
shard's part of this rank's. The residual is stored as a full-length tensor (as every transport's), of
which only the shard is non-zero.

Non-finite: a NaN/Inf in any rank's accumulator is in its shard's sum; the cross-host transport tells
every rank of that cross set, and the flags of the host allgather tell every rank of the host, so
every rank of the job returns None for the key (the step is skipped everywhere).

Like split_reduce, every phase after the reduce-scatter runs at the first ``finish`` of a step, for
every key in sorted order: ranks may have started their reduce-scatters in different orders.

``hvd_topk.transports.build`` makes it over the hosts' process sets (``host_sets``), or hands out the
flat ``SplitReduce`` instead where the job's hosts call for the fallback.
"""
import math

import torch
from horovod.torch import mpi_ops

from .collectives import reduce_scatter_async, reduce_scatter_wait, wait
from ..core.sparsify import sq_norm_finite
from ..core.wire import INDEX_BYTES
from .base import Outcome, Started

__all__ = ["Hierarchical", "shard_of", "to_rows", "from_rows"]


def to_rows(values, indices):
    """uint8 rows of (value bytes, int32 index bytes): one tensor, so one collective for both."""
    v = values.contiguous().view(torch.uint8).reshape(values.numel(), -1)
    i = indices.to(torch.int32).contiguous().view(torch.uint8).reshape(-1, INDEX_BYTES)
    return torch.cat([v, i], dim=1)


def from_rows(rows, dtype):
    """(values in ``dtype``, int64 indices) of ``to_rows``' rows."""
    width = rows.shape[1] - INDEX_BYTES
    values = rows[:, :width].contiguous().view(dtype).reshape(-1)
    return values, rows[:, width:].contiguous().view(torch.int32).reshape(-1).long()


def shard_of(n, per_host, position, k):
    """(padded shard length m, start of this shard, its real length, k of the shard) of an n-element
    tensor cut into ``per_host`` shards: k scaled to the shard (at least 1 where it has entries).

    Example:
        >>> shard_of(10, 4, 3, 5)          # shards of 3: the last holds one real entry
        (3, 9, 1, 1)
    """
    m = -(-n // per_host)
    start = min(position * m, n)
    real = min(m, n - start)
    return m, start, real, min(real, max(1, math.ceil(k * real / n))) if real else 0


class Hierarchical:
    """Dense within hosts, ``inner`` across them (module docstring).

    Args:
        sets: ``host_sets.HostSets`` of this rank.
        inner: the sparse transport across hosts, built over ``sets.cross`` with average=False (sums).
        average: divide the aggregate by the number of ranks (Horovod's Average).
        name: prefix of the collectives' names (distinct per optimizer or TopKEF, identical on all ranks).
        before_finish: called before the first phase waited for (the optimizer's pending groups start).
    """

    def __init__(self, sets, inner, average, name, before_finish=None):
        self.sets, self.inner, self.average, self.name = sets, inner, average, name
        self.before_finish = before_finish or (lambda: None)
        self.inflight = {}              # key -> (the started reduce-scatter, acc, k)
        self.outcomes = {}              # key -> Outcome, finished but not yet handed out
        self.settle_all = None          # settles the door's transports in one order (``step.fused_plan``)

    def start(self, key, acc, k, finite=None, grad=None, step=None, k_next=None):
        """Start the host's reduce-scatter of ``acc``; the rest runs at the first ``finish``. ``finite``
        is not needed: a non-finite entry shows in the shard's sum."""
        started = reduce_scatter_async(acc, f"{self.name}.{key}.scatter", self.sets.host)
        self.inflight[key] = (started, acc, k)

        def finish():
            if key not in self.outcomes:
                (self.settle_all or self.settle)()
            return self.outcomes.pop(key)
        # the squared norm of what leaves is known only after the host's sum: not counted (0.0)
        return Started(started.numel * acc.element_size(), 0.0, finish)

    def drain(self, until):
        """Nothing to advance before ``finish``: its later steps start there (``_run_all``)."""

    def settle(self):
        """Steps 2-3 of every key in flight, blocking (``_run_all``)."""
        if self.inflight:
            self._run_all()

    def forget(self):
        """Drop what was shared with the old set of ranks."""
        self.inflight, self.outcomes = {}, {}
        self.inner.forget()

    def _run_all(self):
        """Steps 1-3 for every key in flight, in key order, each phase started for all keys before any
        is waited for."""
        self.before_finish()
        keys = sorted(self.inflight)
        shards = {key: self._start_inner(key, *self.inflight.pop(key)) for key in keys}
        gathers = {key: self._start_gather(key, *shards[key]) for key in keys}
        for key in keys:
            self.outcomes[key] = self._assemble(*gathers[key])

    def _start_inner(self, key, scattered, acc, k):
        """Step 2: the host's sum of this rank's shard, its top-k started across hosts."""
        n = acc.numel()
        m, start, real, k_shard = shard_of(n, self.sets.per_host, self.sets.position, k)
        own = reduce_scatter_wait(scattered)[:real].to(acc.dtype)
        started = self.inner.start(key, own, k_shard, sq_norm_finite(own)[1]) if real else None
        return acc, own, start, started

    def _start_gather(self, key, acc, own, start, started):
        """Step 3's start: every rank of the host gets this shard's kept entries as rows (value, global
        index), with one flag row (index n, value 1 if some rank was non-finite), and the entries the
        host nominated (global int32 indices, one pad n). Sparse: the shard's aggregate has about
        k/L non-zeros, so the host exchanges those, not the shard."""
        n = acc.numel()
        out = started.finish() if started is not None else Outcome(own.new_zeros(0), own.new_zeros(0, dtype=torch.long))
        if out.aggregate is None:
            kept, values, flag = own.new_zeros(0, dtype=torch.long), own.new_zeros(0), 1.0
        else:
            kept = out.aggregate.nonzero().reshape(-1)
            values, flag = out.aggregate.index_select(0, kept), 0.0
        rows = to_rows(torch.cat([values, values.new_full((1,), flag)]).cpu(),
                       torch.cat([kept.cpu() + start, torch.tensor([n])]))
        chosen = out.sent if out.selected is None else out.selected
        chosen = torch.arange(own.numel()) if chosen is None else chosen.cpu()
        nominated = torch.cat([chosen + start, torch.tensor([n])]).to(torch.int32)
        ps = self.sets.host
        handles = (mpi_ops.allgather_async(rows, name=f"{self.name}.{key}.gather", process_set=ps),
                   mpi_ops.allgather_async(nominated, name=f"{self.name}.{key}.nominated", process_set=ps))
        return handles, acc, own, start, out.sent, out.residual

    def _assemble(self, handles, acc, own, start, sent, shard_residual):
        """Step 3's end: the aggregate (None if some rank was non-finite), what left from this rank's
        shard, and the host's nominated entries (where momentum correction masks). Every index comes
        from one shard's owner: copied, not summed, so the aggregate is the same bit for bit."""
        n = acc.numel()
        values, indices = from_rows(wait(handles[0]), acc.dtype)
        nominated = wait(handles[1]).long()
        flags = values[indices == n]
        if not bool(torch.isfinite(flags).all()) or bool((flags != 0).any()):
            return Outcome(None, None)
        if self.average:                # the kept values, not the n elements: the same products
            values = values * (1.0 / (self.sets.per_host * self.sets.hosts))
        aggregate = torch.zeros(n + 1, dtype=acc.dtype, device=acc.device)
        aggregate[indices.to(acc.device)] = values.to(acc.device)          # the flag rows land at n
        aggregate = aggregate[:n]
        # acc becomes the shard's accumulator, zero elsewhere: the caller zeroes ``sent`` in it
        acc.zero_()
        acc[start:start + own.numel()] = own if shard_residual is None else shard_residual.to(acc.device)
        sent = None if sent is None else sent.to(acc.device) + start
        return Outcome(aggregate, sent, nominated[nominated != n].to(acc.device),
                       None if shard_residual is None else acc)
