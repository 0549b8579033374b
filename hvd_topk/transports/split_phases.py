"""The phases of one split_reduce bucket (``hvd_topk.transports.split_reduce`` says what each does), as
generators that ``hvd_topk.transports.fused.Buckets`` drives, and the owners' pure arithmetic: the
magnitude histogram, the sums of the candidates and each owner's share of the global top-k."""
import math
import time

import torch
from horovod.torch import mpi_ops

from ..core.buckets import offsets, read_frame, signature, wire_dtype
from ..core.codec import message_nbytes, pack, sent_values, unpack
from ..core.sparsify import topk_indices
from ..core.wire import CODEC_ENTRY_BYTES, FLAG_BYTES, HIST_BINS
from .allgather import LOSSLESS, bucket_buffer, kinds_of, mismatch_error, read_ranks
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


def _layout(items, *tagged):
    """(the keys, where each starts in the bucket's index space, its total, the signature of the keys,
    their sizes and ``tagged``)."""
    keys = list(items)
    numels = tuple(items[key]["acc"].numel() for key in keys)
    starts, total = offsets(numels)
    return keys, starts, total, signature("split_reduce", tuple(keys), numels, *tagged)


def _key_slice(candidates, start, n):
    """The positions of the sorted bucket indices ``candidates`` that fall in [start, start + n)."""
    lo, hi = torch.searchsorted(candidates, torch.tensor([start, start + n])).tolist()
    return slice(lo, hi)


def _entries_bytes(items):
    return sum(item["sel"].numel() * CODEC_ENTRY_BYTES[item["kind"]] + FLAG_BYTES for item in items.values())


def gathered(sr, name, items):
    """1 or 2 ranks: every rank's bucket buffer to every rank; each sums and keeps the same entries."""
    ps, t0 = sr.collectives.process_set, time.perf_counter()
    keys, starts, total, sig = _layout(items)
    buf, decoded = bucket_buffer(sig, items, starts, total, lambda key: (items[key]["sel"], items[key]["wire_values"]))
    _add(sr, "pack", t0, buf.numel() - _entries_bytes(items))
    received = yield "gather", mpi_ops.allgather_async(buf, name=f"{name}.gather", process_set=ps)
    t0, kinds = time.perf_counter(), kinds_of(items)
    per_rank = read_ranks(received, len(kinds), total, ps.size())
    if per_rank is None or any(sig_ != sig or flags.numel() != len(keys) for sig_, flags, _ in per_rank):
        raise mismatch_error(keys, sr.mismatch_hint)
    summed = {kind: sum_candidates([unpack(messages[j], 0, total) for _, _, messages in per_rank], wire_dtype(kind))
              for j, kind in enumerate(kinds)}
    outcomes = {}
    for i, key in enumerate(keys):
        item = items[key]
        acc, n = item["acc"], item["acc"].numel()
        if any(not float(flags[i]) < math.inf for _, flags, _ in per_rank):
            outcomes[key] = Outcome(None, None)
            continue
        candidates, sums = summed[item["kind"]]
        part = _key_slice(candidates, starts[i], n)
        candidates, sums = candidates[part] - starts[i], sums[part].to(acc.dtype)
        most = sr.most(item["k"])
        if candidates.numel() > most:
            chosen = topk_indices(sums, most)
            candidates, sums = candidates[chosen], sums[chosen]
        aggregate = _aggregate(sr, n, candidates, sums, acc)
        if sr.stats is not None:
            sr.stats.add_split(candidates.numel(), candidates.numel() / ps.size(), ps.size(), 0)
        outcomes[key] = sr._outcome(item, aggregate, candidates, decoded[key])
    _add(sr, "unpack", t0)
    return outcomes


def owned(sr, name, items):
    """3 ranks or more: the alltoall to the owners, the histograms' allreduce, the kept sums' allgather."""
    ps, t0 = sr.collectives.process_set, time.perf_counter()
    me, ranks = ps.rank(), ps.size()
    keys, starts, total, _ = _layout(items)
    sends, parts = [], {key: [] for key in keys}
    for o in range(ranks):                                  # owner o's buffer: its regions of every key
        def part(key, o=o):
            a, b = items[key]["cuts"][o:o + 2]
            return items[key]["sel"][a:b], items[key]["wire_values"][a:b]
        buf, decoded = bucket_buffer(_layout(items, _regions(items, o))[3], items, starts, total, part)
        sends.append(buf)
        for key in keys:
            parts[key].append(decoded[key])
    decoded = {key: None if parts[key][0] is None else torch.cat(parts[key]) for key in keys}
    _add(sr, "pack", t0, sum(b.numel() for b in sends) - _entries_bytes(items))
    output, received = yield "split", mpi_ops.alltoall_async(
        torch.cat(sends), splits=torch.tensor([b.numel() for b in sends], dtype=torch.int32),
        name=f"{name}.split", process_set=ps)
    t0, kinds, sig = time.perf_counter(), kinds_of(items), _layout(items, _regions(items, me))[3]
    senders, mismatched, unreadable, at = [], 0, 0, 0
    for size in received.tolist():
        try:
            sig_, flags, messages, used = read_frame(output[at:at + size], len(kinds), total)
            unreadable += used != size
            if sig_ != sig or flags.numel() != len(keys):
                mismatched += 1
            senders.append((flags, messages))
        except ValueError:
            unreadable += 1
        at += size
    reduced, rows = {}, []
    if not (mismatched or unreadable):
        summed = {kind: sum_candidates([unpack(messages[j], 0, total) for _, messages in senders], wire_dtype(kind))
                  for j, kind in enumerate(kinds)}
    for i, key in enumerate(keys):
        counts = torch.zeros(HIST_BINS, dtype=torch.long)
        largest = torch.stack([flags[i] for flags, _ in senders]) if senders else torch.zeros(0)
        if not (mismatched or unreadable) and bool(torch.isfinite(largest).all()):
            candidates, sums = summed[items[key]["kind"]]
            part = _key_slice(candidates, starts[i], items[key]["acc"].numel())
            sums = sums[part].to(items[key]["acc"].dtype)
            bins = magnitude_bins(sums, largest)
            counts = torch.bincount(bins, minlength=HIST_BINS)
            reduced[key] = (candidates[part] - starts[i], sums, bins, counts)
        rows.append(histogram_row(counts, mismatched, unreadable))
    _add(sr, "unpack", t0)
    hist = yield "hist", mpi_ops.allreduce_async(torch.stack(rows), op=mpi_ops.Sum, name=f"{name}.hist",
                                                 process_set=ps)
    messages, kept = _keep(sr, keys, items, starts, total, hist.long(), reduced)
    gathered_buf = yield "gather", mpi_ops.allgather_async(torch.cat(messages), name=f"{name}.gather", process_set=ps)
    return _assemble(sr, keys, items, starts, total, gathered_buf, kept, decoded, hist.shape[1])


def _regions(items, owner):
    """Every key's region of ``owner``, part of its buffer's signature."""
    return tuple(tuple(item["bounds"][owner:owner + 2]) for item in items.values())


def _keep(sr, keys, items, starts, total, hist, reduced):
    """Phase 2's end: this owner's kept sums of the bucket, one message per kind over its index space,
    and per key (its kept indices, the rounding of their coded sums) or None where it was not finite.
    A mismatch anywhere raises on every rank (the histograms are the same)."""
    for i, key in enumerate(keys):
        if int(hist[i, -2]) or int(hist[i, -1]):
            raise mismatch_error(keys, sr.mismatch_hint)
    t0, kept, by_kind = time.perf_counter(), {}, {kind: [] for kind in kinds_of(items)}
    for i, key in enumerate(keys):
        item = items[key]
        if key not in reduced:                              # not finite on some rank: every rank knows
            kept[key] = None
            continue
        candidates, sums, bins, counts = reduced[key]
        keep = owners_share(hist[i, :-2], counts, bins, sums, sr.most(item["k"]))
        kept[key] = [candidates[keep], sums[keep]]
        by_kind[item["kind"]].append((key, candidates[keep] + starts[i], sums[keep].to(wire_dtype(item["kind"]))))
    messages = []
    for kind, entries in by_kind.items():
        values = torch.cat([v for _, _, v in entries]) if entries else torch.zeros(0, dtype=wire_dtype(kind))
        indices = torch.cat([i for _, i, _ in entries]) if entries else torch.zeros(0, dtype=torch.long)
        messages.append(pack(values, indices, 0, total, kind))
        coded = None if kind in LOSSLESS else sent_values(values, kind).split([v.numel() for _, _, v in entries])
        for j, (key, _, _) in enumerate(entries):            # the owner keeps the rounding of what it coded
            sums = kept[key][1]
            kept[key][1] = None if coded is None else sums - coded[j].to(sums.dtype)
    _add(sr, "pack", t0)
    return messages, kept


def _assemble(sr, keys, items, starts, total, gathered_buf, kept, decoded, row_ints):
    """Phase 3's end: each key's aggregate from its entries in the owners' messages (each index from its
    single owner), built in the key's own dtype; no buffer, copy or sort of the bucket's size."""
    t0, ranks, kinds = time.perf_counter(), sr.collectives.process_set.size(), kinds_of(items)
    messages, at = {kind: [] for kind in kinds}, 0
    for _ in range(ranks):
        for kind in kinds:
            size = message_nbytes(gathered_buf[at:], total)
            messages[kind].append(unpack(gathered_buf[at:at + size], 0, total))
            at += size
    outcomes = {}
    for i, key in enumerate(keys):
        item = items[key]
        acc, n = item["acc"], item["acc"].numel()
        if kept[key] is None:
            outcomes[key] = Outcome(None, None)
            continue
        parts = [(values[part], where[part]) for values, where in messages[item["kind"]]
                 for part in [_key_slice(where, starts[i], n)]]
        mine = torch.cat([where for _, where in parts]) - starts[i]
        aggregate = _aggregate(sr, n, mine, torch.cat([values for values, _ in parts]), acc)
        if sr.stats is not None:
            sr.stats.add_split(mine.numel(), sr.regions.largest_share(key, mine), ranks,
                               4 * row_ints + kept[key][0].numel() * CODEC_ENTRY_BYTES[item["kind"]])
        sr.regions.observe(key, mine)
        owned_rounding = None if kept[key][1] is None else kept[key]
        outcomes[key] = sr._outcome(item, aggregate, mine, decoded[key], owned_rounding)
    _add(sr, "unpack", t0)
    return outcomes


def _aggregate(sr, n, indices, sums, like):
    """The n-element aggregate of ``like``'s dtype and device holding ``sums`` at ``indices``, averaged
    over the ranks if asked: the kept sums are scaled, not the n elements (the same products)."""
    sums = sums.to(device=like.device, dtype=like.dtype)
    if sr.average:
        sums = sums * (1.0 / sr.collectives.process_set.size())
    aggregate = torch.zeros(n, dtype=like.dtype, device=like.device)
    aggregate[indices.to(like.device)] = sums
    return aggregate


def _add(sr, part, t0, nbytes=0):
    """Report ``part``'s seconds since ``t0`` (and the bucket's frame and header bytes) to the stats."""
    if sr.stats is not None:
        sr.stats.add_time(part, time.perf_counter() - t0)
        if nbytes:
            sr.stats.add_bytes(nbytes)
