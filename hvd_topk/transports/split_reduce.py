"""Split-and-reduce: Ok-Topk's sparse allreduce (Li & Hoefler, PPoPP'22) on Horovod's alltoall and allgather.

1. Every rank takes the top-k of its accumulator and sends each entry as a row (value, int32 index) to
   the owner of the index's region (``hvd_topk.transports.regions``), all in one alltoall, started at once. With
   them goes one row per owner holding the rank's largest |value|, or inf if its accumulator is not
   finite: every owner learns every rank's, so every rank takes the same skip decision and the same
   histogram scale.
2. Each owner sums the rows it received per index: the candidates of its region.
3. One allreduce of a histogram of the candidates' magnitudes (log scale, below the largest possible
   sum) gives every rank the global counts. Each owner keeps its candidates of the bins above the one
   where the count reaches k, and from that bin a share proportional to its own count there: at most
   k kept in all (at least k - P + 1 when there are k candidates), and exactly the global top-k of the
   candidates unless two of them lie within one bin's width (2**(1/4)) around the k-th.
4. One allgather of the kept rows gives every rank the same aggregate. Each index comes from a single
   owner, so it is copied, not summed: the aggregate is identical bit for bit on every rank.

Steps 2-4 run for all of an optimizer's split_reduce tensors together, in key order, at the first
``finish`` of the step: each adds collectives, and ranks that added them in different orders would
wait for each other forever (Horovod's ``synchronize`` finishes tensors in hook order, which differs
between ranks).

Error feedback stays exact per rank: ``sent`` is this rank's top-k entries that their owner kept; an
entry it sent that was not kept stays in its residual, so Σ sent + residual = Σ grad holds.
Bytes per rank: about 2k(P-1)/P rows and a 520-byte histogram, flat in P (allgather: (P-1)k rows).
"""
import math

import torch
from horovod.torch import mpi_ops

from .collectives import wait
from .regions import Regions
from ..core.sparsify import sq_norm_finite, topk_indices
from ..core.wire import HIST_BINS, HIST_BYTES, INDEX_BYTES
from .base import Outcome, Started

__all__ = ["SplitReduce", "HIST_BINS", "magnitude_bins", "owners_share", "histogram_row", "senders_rows",
           "rows_for_owners"]

BINS_PER_OCTAVE = 4                    # magnitude resolution of the histogram: bins 2**(1/4) wide


def to_rows(values, indices):
    """uint8 rows of (value bytes, int32 index bytes): one tensor, so one collective per phase."""
    v = values.contiguous().view(torch.uint8).reshape(values.numel(), -1)
    i = indices.to(torch.int32).contiguous().view(torch.uint8).reshape(-1, INDEX_BYTES)
    return torch.cat([v, i], dim=1)


def from_rows(rows, dtype):
    """(values in ``dtype``, int64 indices) of ``to_rows``' rows."""
    width = rows.shape[1] - INDEX_BYTES
    values = rows[:, :width].contiguous().view(dtype).reshape(-1)
    return values, rows[:, width:].contiguous().view(torch.int32).reshape(-1).long()


def magnitude_bins(sums, largest):
    """The histogram bin of each summed candidate. Bin 0 holds magnitudes just below the largest
    possible sum (P x the largest |value| any rank sent, ``largest`` holding each rank's)."""
    top = math.log2(float(largest.max()) * largest.numel()) if float(largest.max()) > 0 else 0.0
    bins = ((top - torch.log2(sums.abs().to(torch.float64))) * BINS_PER_OCTAVE).floor()
    return bins.nan_to_num(HIST_BINS - 1).clamp(0, HIST_BINS - 1).long()


def rows_for_owners(values, sel, largest, bounds, n):
    """Step 1's alltoall input: (rows, int32 rows per owner). Every owner gets this sender's flag row
    (``largest`` at index n) first, then its entries, in owner order."""
    ranks = bounds.numel() - 1
    owners = torch.cat([torch.arange(ranks, device=sel.device), Regions.owners(sel, bounds.to(sel.device))])
    order = torch.argsort(owners, stable=True)
    rows = to_rows(torch.cat([largest.reshape(1).expand(ranks), values])[order],
                   torch.cat([sel.new_full((ranks,), n), sel])[order])
    return rows, torch.bincount(owners, minlength=ranks).to(torch.int32).cpu()


def senders_rows(rows, received, numel, dtype):
    """What an owner received in step 1: (values, indices) of the entries, every sender's flag value (its
    largest |value|, or inf) as float64, and how many senders' tensor sizes differ from ``numel``.
    ``received``: rows per sender; every sender's block starts with its flag row, indexed by its numel."""
    values, indices = from_rows(rows, dtype)
    flags = torch.zeros(indices.numel(), dtype=torch.bool, device=indices.device)
    flags[(torch.cumsum(received.long(), 0) - received.long()).to(indices.device)] = True
    other_sizes = int((indices[flags] != numel).sum())
    return values[~flags], indices[~flags], values[flags].to(torch.float64), other_sizes


def histogram_row(counts, outside, other_sizes):
    """Step 3's allreduced int32 row: the bins' counts, then this owner's count of rows outside its
    region and of senders whose size differs from its own (``HIST_BYTES``, which the cost model prices)."""
    return torch.cat([counts.cpu(), torch.tensor([outside, other_sizes])]).to(torch.int32)


def owners_share(hist, counts, bins, sums, k):
    """Which of this owner's candidates it keeps (step 3): those of the bins above the one where the
    global count reaches k, and from that bin a share proportional to this owner's count there.

    Args:
        hist: the global count per bin (identical on every rank); counts: this owner's; bins: the bin
            of each of its candidates; sums: their summed values; k: how many to keep in all.
    """
    cumulative = torch.cumsum(hist, 0)
    if int(cumulative[-1]) <= k:
        return torch.ones_like(bins, dtype=torch.bool)
    cut = int(torch.searchsorted(cumulative, k))            # first bin where the count reaches k
    above = int(cumulative[cut - 1]) if cut > 0 else 0
    share = (k - above) * int(counts[cut]) // int(hist[cut])
    keep = bins < cut
    in_cut = (bins == cut).nonzero().reshape(-1)
    if share > 0:
        keep[in_cut[torch.topk(sums[in_cut].abs(), share).indices]] = True
    return keep


class SplitReduce:
    """Split-and-reduce of each key's top-k (module docstring).

    Args:
        collectives: the optimizer's ``Collectives`` (its process set; its pending groups are started
            before this transport adds collectives).
        average: divide the sum by the number of ranks (Horovod's Average).
        regions: ``Regions``: the owner of every index.
        name: prefix of the collectives' names (distinct per optimizer, identical on all ranks).
        value_dtype: dtype of the values on the wire; None keeps the accumulator's.
        stats: ``StepStats`` that records rows kept and the regions' imbalance, or None.
        mismatch_hint: what the error says to do when the ranks sent tensors of different sizes under
            one key (``TopKEF`` without names: the ranks' orders differ).
        budget: how many of the summed candidates are kept, as a multiple of k (>= 1).
    """

    def __init__(self, collectives, average, regions, name, value_dtype=None, stats=None, mismatch_hint="",
                 budget=1.0):
        self.collectives, self.average, self.regions = collectives, average, regions
        self.name, self.value_dtype, self.stats = name, value_dtype, stats
        self.mismatch_hint, self.budget = mismatch_hint, budget
        self.inflight = {}              # key -> phase 1 in flight (step 1)
        self.outcomes = {}              # key -> Outcome, finished but not yet handed out

    def start(self, key, acc, k, finite, grad=None, step=None, k_next=None):
        ps = self.collectives.process_set
        n, ranks = acc.numel(), ps.size()
        bounds = self.regions.of(key, n, ranks)
        sel = topk_indices(acc, k)
        selected = acc.index_select(0, sel)
        values = selected.to(self.value_dtype or acc.dtype)
        largest = values.abs().max() if finite else values.new_full((), math.inf)
        rows, splits = rows_for_owners(values, sel, largest, bounds, n)
        handle = mpi_ops.alltoall_async(rows, splits, name=f"{self.name}.{key}.split", process_set=ps)
        self.inflight[key] = (handle, acc, sel, k, bounds)

        def finish():
            if key not in self.outcomes:
                self._reduce_all()
            return self.outcomes.pop(key)
        return Started(rows.numel(), sq_norm_finite(selected)[0], finish)

    def _reduce_all(self):
        """Steps 2-4 for every key in flight, in key order, each phase started for all keys before any
        is waited for (two round trips in all, not two per tensor)."""
        self.collectives.start_pending()
        keys = sorted(self.inflight)
        phase = {key: self._sum_candidates(key, *self.inflight.pop(key)) for key in keys}
        for key in keys:
            if phase[key] is not None:
                phase[key] = self._keep(key, *phase[key])
        for key in keys:
            self.outcomes[key] = self._gather(key, phase[key])

    def forget(self):
        """Drop what was shared with the old set of ranks: phases in flight, outcomes, the regions."""
        self.inflight, self.outcomes = {}, {}
        self.regions.forget()

    def _sum_candidates(self, key, handle, acc, sel, k, bounds):
        """Step 2 and the start of step 3: this owner's summed candidates and its histogram allreduce;
        None when some rank was non-finite (every owner received every rank's flag row)."""
        values, indices, largest, other_sizes = senders_rows(*wait(handle), acc.numel(),
                                                             self.value_dtype or acc.dtype)
        if not bool(torch.isfinite(largest).all()):
            return None
        me = self.collectives.process_set.rank()
        values = values.to(acc.dtype)
        outside = int(((indices < bounds[me]) | (indices >= bounds[me + 1])).sum())
        candidates, slot = torch.unique(indices, return_inverse=True)
        sums = torch.zeros(candidates.numel(), dtype=acc.dtype, device=acc.device).index_add_(0, slot, values)
        bins = magnitude_bins(sums, largest)
        counts = torch.bincount(bins, minlength=HIST_BINS)
        hist = histogram_row(counts, outside, other_sizes)
        handle = mpi_ops.allreduce_async(hist, op=mpi_ops.Sum, name=f"{self.name}.{key}.hist",
                                         process_set=self.collectives.process_set)
        return handle, acc, sel, k, candidates, sums, bins, counts

    def _keep(self, key, handle, acc, sel, k, candidates, sums, bins, counts):
        """Step 3: this owner's share of the global top-k, then the start of step 4's allgather."""
        hist = wait(handle).long().to(bins.device)
        if int(hist[-1]):
            raise ValueError(f"hvd_topk split_reduce: the ranks sent tensors of different sizes under {key!r} "
                             f"({acc.numel()} elements on this rank); "
                             f"{self.mismatch_hint or 'every rank must step the same model'}")
        hist = hist[:-1]
        if int(hist[-1]):
            raise RuntimeError(f"hvd_topk split_reduce: {int(hist[-1])} rows of {key!r} reached a rank that "
                               "does not own their index: the ranks disagree on the index regions (their "
                               "optimizer state differs; load the same checkpoint on every rank)")
        keep = owners_share(hist[:-1], counts, bins, sums, max(k, int(self.budget * k)))
        kept_values = sums[keep].to(self.value_dtype or acc.dtype)
        pad = candidates.new_full((1,), acc.numel())                # one row even when nothing is kept
        rows = to_rows(torch.cat([kept_values, kept_values.new_zeros(1)]), torch.cat([candidates[keep], pad]))
        handle = mpi_ops.allgather_async(rows, name=f"{self.name}.{key}.gather",
                                         process_set=self.collectives.process_set)
        return handle, acc, sel, rows.numel() + HIST_BYTES

    def _gather(self, key, phase):
        """Step 4: the aggregate, identical on every rank, and what left this rank (its kept entries)."""
        if phase is None:
            return Outcome(None, None)
        handle, acc, sel, nbytes = phase
        values, indices = from_rows(wait(handle), self.value_dtype or acc.dtype)
        n, at = acc.numel(), indices.to(acc.device)
        aggregate = torch.zeros(n + 1, dtype=acc.dtype, device=acc.device)
        aggregate[at] = values.to(device=acc.device, dtype=acc.dtype)              # pad rows: 0 at n
        kept = torch.zeros(n + 1, dtype=torch.bool, device=acc.device)
        kept[at] = True
        aggregate, kept_indices = aggregate[:n], indices[indices != n]
        if self.average:
            aggregate.mul_(1.0 / self.collectives.process_set.size())
        if self.stats is not None:
            self.stats.add_split(kept_indices.numel(), self.regions.largest_share(key, kept_indices),
                                 self.collectives.process_set.size(), nbytes)
        self.regions.observe(key, kept_indices)
        return Outcome(aggregate, sel[kept[sel]], sel)      # this rank's entries that were kept; its nominated

