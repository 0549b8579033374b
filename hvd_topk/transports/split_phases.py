"""The phases of one split_reduce bucket (``hvd_topk.transports.split_reduce`` says what each does), as
generators that ``hvd_topk.transports.fused.Buckets`` drives, and the owners' pure arithmetic: the
magnitude histogram, the sums of the candidates and each owner's share of the global top-k."""
import math
import time

import torch
from horovod.torch import mpi_ops

from ..core.buckets import read_frames, signature, wire_dtype
from ..core.codec import message_nbytes, pack, sent_values, unpack
from ..core.sparsify import topk_indices
from ..core.wire import HIST_BINS
from .allgather import LOSSLESS, mismatch_error, read_ranks
from .base import Outcome

__all__ = ["HIST_BINS", "magnitude_bins", "owners_share", "histogram_row", "sum_candidates", "gathered", "owned"]

BINS_PER_OCTAVE = 4                    # magnitude resolution of the histogram: bins 2**(1/4) wide


def magnitude_bins(sums, largest):
    """The histogram bin of each summed candidate. Bin 0 holds magnitudes just below the largest
    possible sum (P x the largest |value| any rank sent, ``largest`` holding each rank's)."""
    top = math.log2(float(largest.max()) * largest.numel()) if float(largest.max()) > 0 else 0.0
    bins = ((top - torch.log2(sums.abs().to(torch.float64))) * BINS_PER_OCTAVE).floor()
    return bins.nan_to_num(HIST_BINS - 1).clamp(0, HIST_BINS - 1).long()


def histogram_row(counts, mismatched, unreadable):
    """Phase 2's allreduced int32 row of one tensor: its bins' counts, then this owner's count of frames
    whose signature differs from its own and of buffers it could not read (``HIST_BYTES``)."""
    return torch.cat([counts.cpu(), torch.tensor([mismatched, unreadable])]).to(torch.int32)


def sum_candidates(parts, dtype):
    """(sorted distinct indices, their sums in ``dtype``) of the (values, indices) ``parts``, added in order."""
    values = torch.cat([v for v, _ in parts]).to(dtype)
    candidates, slot = torch.unique(torch.cat([i for _, i in parts]), return_inverse=True)
    return candidates, torch.zeros(candidates.numel(), dtype=dtype).index_add_(0, slot, values)


def owners_share(hist, counts, bins, sums, k):
    """Which of this owner's candidates it keeps (phase 2): those of the bins above the one where the
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


def gathered(sr, name, items):
    """1 or 2 ranks: every rank's frames to every rank; each sums and keeps the same entries."""
    ps, keys = sr.collectives.process_set, list(items)
    gathered = yield "gather", mpi_ops.allgather_async(torch.cat([items[key]["chunks"][0] for key in keys]),
                                                       name=f"{name}.gather", process_set=ps)
    t0 = time.perf_counter()
    per_rank = read_ranks(gathered, [items[key]["acc"].numel() for key in keys], ps.size())
    outcomes = {}
    for i, key in enumerate(keys):
        item = items[key]
        acc, n = item["acc"], item["acc"].numel()
        if per_rank is None or any(frames[i][0] != signature(key, n, 0, n) for frames in per_rank):
            raise mismatch_error(key, n, sr.mismatch_hint)
        if any(not frames[i][1] < math.inf for frames in per_rank):
            outcomes[key] = Outcome(None, None)
            continue
        candidates, sums = sum_candidates([unpack(frames[i][2], 0, n) for frames in per_rank], acc.dtype)
        most = max(item["k"], int(sr.budget * item["k"]))
        if candidates.numel() > most:
            chosen = topk_indices(sums, most)
            candidates, sums = candidates[chosen], sums[chosen]
        aggregate = torch.zeros(n, dtype=acc.dtype, device=acc.device)
        aggregate[candidates.to(acc.device)] = sums.to(acc.device)
        if sr.stats is not None:
            sr.stats.add_split(candidates.numel(), candidates.numel() / ps.size(), ps.size(), 0)
        outcomes[key] = sr._outcome(item, aggregate, candidates, None)
    if sr.stats is not None:
        sr.stats.add_time("unpack", time.perf_counter() - t0)
    return outcomes

def owned(sr, name, items):
    """3 ranks or more: the alltoall to the owners, the histograms' allreduce, the kept sums' allgather."""
    ps, keys = sr.collectives.process_set, list(items)
    me, ranks = ps.rank(), ps.size()
    sends = [torch.cat([items[key]["chunks"][o] for key in keys]) for o in range(ranks)]
    output, received = yield "split", mpi_ops.alltoall_async(
        torch.cat(sends), splits=torch.tensor([s.numel() for s in sends], dtype=torch.int32),
        name=f"{name}.split", process_set=ps)
    t0 = time.perf_counter()
    regions = {key: items[key]["bounds"][me:me + 2] for key in keys}
    senders, unreadable, at = [], 0, 0
    for size in received.tolist():
        try:
            frames, used = read_frames(output[at:at + size], [hi - lo for lo, hi in regions.values()])
            unreadable += used != size
            senders.append(frames)
        except ValueError:
            unreadable += 1
        at += size
    reduced, rows = {}, []
    for i, key in enumerate(keys):
        (lo, hi), n = regions[key], items[key]["acc"].numel()
        sig = signature(key, n, lo, hi)
        mismatched = sum(frames[i][0] != sig for frames in senders)
        flags = torch.tensor([frames[i][1] for frames in senders], dtype=torch.float64)
        counts = torch.zeros(HIST_BINS, dtype=torch.long)
        if not (unreadable or mismatched) and bool(torch.isfinite(flags).all()):
            candidates, sums = sum_candidates([unpack(frames[i][2], lo, hi) for frames in senders],
                                              items[key]["acc"].dtype)
            bins = magnitude_bins(sums, flags)
            counts = torch.bincount(bins, minlength=HIST_BINS)
            reduced[key] = (candidates, sums, bins, counts)
        rows.append(histogram_row(counts, mismatched, unreadable))
    _add_time(sr, "unpack", t0)
    hist = yield "hist", mpi_ops.allreduce_async(torch.stack(rows), op=mpi_ops.Sum, name=f"{name}.hist",
                                                 process_set=ps)
    kept = _keep(sr, keys, items, regions, hist.long(), reduced)
    gathered = yield "gather", mpi_ops.allgather_async(torch.cat([kept[key][0] for key in keys]),
                                                       name=f"{name}.gather", process_set=ps)
    return _assemble(sr, keys, items, gathered, kept, hist)

def _keep(sr, keys, items, regions, hist, reduced):
    """Phase 2's end: per key, (this owner's kept sums coded as one message, its indices, the rounding
    of its coded sums); a mismatch anywhere raises on every rank (the histograms are the same)."""
    for i, key in enumerate(keys):
        if int(hist[i, -2]) or int(hist[i, -1]):
            raise mismatch_error(key, items[key]["acc"].numel(), sr.mismatch_hint)
    t0, kept = time.perf_counter(), {}
    for i, key in enumerate(keys):
        item, (lo, hi) = items[key], regions[key]
        wire = wire_dtype(item["kind"])
        if key not in reduced:                                  # not finite on some rank: every rank knows
            kept[key] = (pack(torch.zeros(0, dtype=wire), torch.zeros(0, dtype=torch.long), lo, hi, item["kind"]),
                         None, None)
            continue
        candidates, sums, bins, counts = reduced[key]
        keep = owners_share(hist[i, :-2], counts, bins, sums, max(item["k"], int(sr.budget * item["k"])))
        values = sums[keep].to(wire)
        rounding = None if item["kind"] in LOSSLESS else \
            sums[keep] - sent_values(values, item["kind"]).to(sums.dtype)
        kept[key] = (pack(values, candidates[keep], lo, hi, item["kind"]), candidates[keep], rounding)
    _add_time(sr, "pack", t0)
    return kept

def _assemble(sr, keys, items, gathered, kept, hist):
    """Phase 3's end: every key's aggregate from its owners' messages, in owner order."""
    t0, ranks, outcomes, at = time.perf_counter(), sr.collectives.process_set.size(), {}, 0
    spans = {key: items[key]["bounds"] for key in keys}
    messages = {key: [] for key in keys}
    for owner in range(ranks):
        for key in keys:
            lo, hi = spans[key][owner], spans[key][owner + 1]
            size = message_nbytes(gathered[at:], hi - lo)
            messages[key].append((gathered[at:at + size], lo, hi))
            at += size
    for i, key in enumerate(keys):
        item = items[key]
        acc, n = item["acc"], item["acc"].numel()
        if kept[key][1] is None:
            outcomes[key] = Outcome(None, None)
            continue
        aggregate = torch.zeros(n, dtype=acc.dtype, device=acc.device)
        indices = []
        for message, lo, hi in messages[key]:
            values, at_ = unpack(message, lo, hi)
            aggregate[at_.to(acc.device)] = values.to(device=acc.device, dtype=acc.dtype)
            indices.append(at_)
        indices = torch.cat(indices)
        if sr.stats is not None:
            sr.stats.add_split(indices.numel(), sr.regions.largest_share(key, indices), ranks,
                                 4 * hist.shape[1] + kept[key][0].numel())
        sr.regions.observe(key, indices)
        outcomes[key] = sr._outcome(item, aggregate, indices, kept[key][1:])
    _add_time(sr, "unpack", t0)
    return outcomes


def _add_time(sr, part, t0):
    if sr.stats is not None:
        sr.stats.add_time(part, time.perf_counter() - t0)
