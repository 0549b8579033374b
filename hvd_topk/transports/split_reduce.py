"""Split-and-reduce: Ok-Topk's sparse allreduce (Li & Hoefler, PPoPP'22) on Horovod's alltoall and allgather.

Every rank takes the top-k of its accumulator. The tensors of a bucket (``hvd_topk.transports.fused``)
travel together, one collective per phase; each tensor's entries for one destination are one frame
(``hvd_topk.core.buckets``: its signature and flag) and one codec message (``hvd_topk.core.codec``:
about 4 bytes per entry with 16-bit values).

From 3 ranks on, three phases per bucket:

1. One alltoall: each entry goes to the owner of its index's region (``hvd_topk.transports.regions``).
   Every owner gets a frame of every tensor from every rank, so it learns every rank's flag (its largest
   |value|, or inf if its accumulator was not finite): every rank takes the same skip decision and the
   same histogram scale.
2. Each owner sums what it received per index (the candidates of its region), and one allreduce of
   the tensors' histograms of the candidates' magnitudes (log scale, below the largest possible sum)
   gives every rank the global counts. Each owner keeps its candidates of the bins above the one where
   the count reaches k, and from that bin a share proportional to its own count there: at most k kept
   in all, and exactly the global top-k of the candidates unless two lie within one bin (2**(1/4)) of
   the k-th. The rows of the histograms also carry each owner's count of frames it could not match
   (another key, size or region): then every rank raises.
3. One allgather of the owners' kept sums, coded again: every rank copies each index from its single
   owner, so the aggregate is identical bit for bit everywhere.

With 1 or 2 ranks one phase serves: an allgather of every rank's frames, after which every rank sums
the candidates and keeps the largest ``budget * k`` exactly, on the same numbers in the same order. It
sends what the three phases would at 2 ranks (k entries per rank) in one round trip instead of three.

Error feedback: ``sent`` is this rank's entries that were kept. With 16-bit values the residual keeps
``acc - decoded`` at those entries, and each owner also keeps the rounding of its coded sums
(``sum - decoded sum``) at the indices it kept: over the ranks Σ sent + Σ residuals = Σ grads, up to
float32's rounding of the sums (``hvd_topk.transports.base``, invariant 2). Lossless values ('fp32',
float64 accumulators) zero the sent entries and round nothing but the sums, as 8-byte rows did.
"""
import torch

from ..core.buckets import flag_of, wire_dtype, wire_kind
from ..core.sparsify import ascending, sq_norm_finite, topk_indices
from ..core.wire import CODEC_ENTRY_BYTES, FLAG_BYTES, budget_at
from .base import Outcome, Started
from .fused import Buckets
from .split_phases import HIST_BINS, gathered, histogram_row, magnitude_bins, owned, owners_share, sum_candidates

__all__ = ["SplitReduce", "HIST_BINS", "magnitude_bins", "owners_share", "histogram_row", "sum_candidates"]


class SplitReduce:
    """Split-and-reduce of each key's top-k, one collective per bucket and phase (module docstring).

    Args:
        collectives: the ``Collectives`` (its process set; its pending groups start before a wait).
        average: divide the sum by the number of ranks (Horovod's Average).
        regions: ``Regions``: the owner of every index.
        name: prefix of the collectives' names (distinct per optimizer, identical on all ranks).
        values: 'bf16', 'fp16' or 'fp32': how float32 values go on the wire (``core.buckets.wire_kind``).
        stats: ``StepStats`` that records phases, rows kept and the regions' imbalance, or None.
        mismatch_hint: what the error says to do when the ranks sent other tensors under one key
            (``TopKEF`` without names: the ranks' orders differ).
        budget: how many of the summed candidates are kept, as a multiple of k (>= 1), or None: one k
            per 4 ranks, between 1 and 4 (``hvd_topk.core.wire.budget_at``).
    """

    def __init__(self, collectives, average, regions, name, values="bf16", stats=None, mismatch_hint="", budget=None):
        self.collectives, self.average, self.regions = collectives, average, regions
        self.name, self.values, self.stats = name, values, stats
        self.mismatch_hint, self.budget = mismatch_hint, budget
        self.buckets = Buckets(name, self._phases, stats)

    def most(self, k):
        """How many of a key's summed candidates are kept, for its ``k`` among today's ranks."""
        return max(k, int(budget_at(self.budget, self.collectives.process_set.size()) * k))

    def drain(self, until):
        """Advance the buckets in flight until done or ``until`` (``Buckets.drain``); never blocks."""
        self.buckets.drain(until)

    def forget(self):
        """Drop what was shared with the old set of ranks: buckets in flight, the regions."""
        self.buckets.forget()
        self.regions.forget()

    def start(self, key, acc, k, finite, grad=None, step=None, k_next=None):
        n, ranks = acc.numel(), self.collectives.process_set.size()
        sel = ascending(topk_indices(acc, k))            # sorted: each owner's entries are one slice
        values = acc.index_select(0, sel)
        kind = wire_kind(acc.dtype, self.values)
        bounds = torch.tensor([0, n]) if ranks <= 2 else self.regions.of(key, n, ranks)
        wire_values = values.to(wire_dtype(kind))
        self.buckets.add(key, dict(acc=acc, sel=sel, wire_values=wire_values, kind=kind, k=k, bounds=bounds.tolist(),
                                   cuts=torch.searchsorted(sel, bounds.to(sel.device)).tolist(),
                                   flag=flag_of(wire_values, finite)))
        destinations = 1 if ranks <= 2 else ranks
        return Started(k * CODEC_ENTRY_BYTES[kind] + FLAG_BYTES * destinations, sq_norm_finite(values)[0],
                       lambda: self.buckets.finish(key, self.collectives.start_pending))

    def _phases(self, name, items):
        """The bucket's phases (module docstring): one allgather with 1 or 2 ranks, else three."""
        if self.collectives.process_set.size() <= 2:
            return (yield from gathered(self, name, items))
        return (yield from owned(self, name, items))

    def _outcome(self, item, aggregate, kept_indices, decoded, owned=None):
        """The Outcome: the ``aggregate`` (already averaged if asked), this rank's kept entries (``sent``),
        its nominated ones, and with 16-bit values its residual: ``acc - decoded`` at the kept entries it
        sent, and as owner (``owned``: the indices it kept and the rounding of their coded sums) that rounding."""
        acc, sel = item["acc"], item["sel"]
        kept = torch.zeros(acc.numel(), dtype=torch.bool, device=acc.device)
        kept[kept_indices.to(acc.device)] = True
        mine = kept[sel]
        if decoded is None:                               # lossless: the caller zeroes what was sent
            return Outcome(aggregate, sel[mine], sel)
        residual = acc.index_put_((sel[mine],), acc[sel[mine]] - decoded[mine].to(acc.dtype))
        if owned is not None:
            residual.index_put_((owned[0].to(acc.device),), owned[1].to(device=acc.device, dtype=acc.dtype),
                                accumulate=True)
        return Outcome(aggregate, sel[mine], sel, residual)
