"""Pure tensor functions for Top-K sparsification. No Horovod import here: the math is testable alone."""
import math

import numpy as np
import torch

from .validate import check_int

__all__ = ["k_for", "topk_indices", "ascending", "spread_indices", "scatter_dense", "sq_norm_finite", "sq_norm64"]


def k_for(numel, ratio):
    """Number of elements kept: k = max(1, ceil(ratio * numel)), clamped to numel.

    Args:
        numel: number of elements of the tensor (>= 1).
        ratio: fraction kept, in (0, 1].

    Returns:
        int k with 1 <= k <= numel.

    Example:
        >>> k_for(1000, 0.01)
        10
    """
    return min(int(numel), max(1, math.ceil(ratio * numel)))


# Fast exact selection (docs/design.md, "Fast exact top-k selection"). The magnitude of an IEEE float
# orders exactly like its bit pattern with the sign bit cleared, read as a signed integer of the same
# width; NaN patterns lie above inf there, so NaN counts as the largest magnitude, as in torch.topk.
# Working on these integers keeps the selection exact (no rounding of a threshold) and needs neither an
# abs() copy nor a NaN pass.
_MAGNITUDE_BITS = {
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
    torch.float32: (torch.int32, 0x7FFF_FFFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
}
# Below this size, or above this fraction kept, one torch.topk beats a sample plus a pass.
_MIN_FAST_NUMEL = 1 << 16
_MAX_FAST_RATIO = 0.25
# On CUDA, torch.topk's radix select beats the sampled pass (whose threshold and counts each wait for
# the GPU) up to tens of millions of elements; on an H100 the pass won only 4-byte inputs of 100M
# (bench/results/select_cuda). Below this size, and for 2-byte dtypes, CUDA takes torch.topk.
_MIN_FAST_NUMEL_CUDA = 1 << 26
_FAST_CUDA_DTYPES = (torch.float32, torch.float64)
# Random sample for the threshold estimate: one position per 64 elements, within these bounds, costs
# a few percent of the pass yet puts the threshold within ~10% of the k-th magnitude's rank for the
# usual ratios. A fixed seed makes every call on the same input identical.
_SAMPLE_PER = 64
_MIN_SAMPLE_SIZE = 1 << 12
_MAX_SAMPLE_SIZE = 1 << 16
_SAMPLE_SEED = 0x7A5C
# Safety margins, in binomial standard deviations of the sampled rank, for the threshold below the
# k-th magnitude; a larger one is tried only if the previous pass found fewer than k candidates.
_MARGINS = (3.0, 12.0)
# Elements per pass step. CPU: the step's buffers (2.5 MiB) stay in a core's L2 cache, and the few
# small ops per step cost little next to the work (2^16 to 2^21 took the same time within 10%, one
# thread, 2.18M and 6.3M float32). CUDA: few launches, and the buffers still stay small next to large
# inputs.
_CPU_CHUNK = 1 << 19
_CUDA_CHUNK = 1 << 24


def topk_indices(x, k):
    """Indices (int64) of the k entries of the 1-D tensor ``x`` with the largest magnitude.

    Exact: the same index set as ``torch.topk(x.abs(), k).indices`` whenever the k-th largest magnitude
    is not tied. For large inputs it estimates a threshold a little below the k-th magnitude from a
    fixed-seed random sample, collects the entries at or above it in one cache-blocked pass, and runs
    ``torch.topk`` on those few candidates only; if the pass finds fewer than k it retries with a lower
    threshold, and after that falls back to ``torch.topk``. Extra memory is a few cache-sized buffers
    plus the candidates, not a copy of ``x`` (except in that rare fallback, and for small inputs or
    k > n/4, which go straight to ``torch.topk``; on CUDA, so do inputs under 2**26 elements and
    2-byte dtypes, where ``torch.topk`` is faster).

    NaN is treated as larger than any number (as ``torch.topk`` does), so a non-finite input selects
    its NaN entries first; callers that must not send NaN check finiteness themselves. -0.0 and 0.0 are
    equal. Ties at the k-th magnitude are broken deterministically: the same input always gives the
    same indices.

    Args:
        x: 1-D non-empty tensor of dtype float32, float16, bfloat16 or float64 (CPU or CUDA).
        k: integer, 1 <= k <= x.numel().

    Returns:
        1-D int64 tensor of k distinct indices on ``x.device``, in no particular order.

    Example:
        >>> topk_indices(torch.tensor([0.1, -3.0, 2.0]), 2).sort().values.tolist()
        [1, 2]
    """
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"x must be a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _MAGNITUDE_BITS:
        raise ValueError(f"x must have dtype float32, float16, bfloat16 or float64, got {x.dtype}")
    n = x.numel()
    k = check_int("k", k, low=1, high=n)
    x = x.detach()
    if k == n:
        return torch.arange(n, device=x.device)
    if n < _MIN_FAST_NUMEL or k > _MAX_FAST_RATIO * n:
        return _topk_exact(x, k)
    if x.is_cuda and (n < _MIN_FAST_NUMEL_CUDA or x.dtype not in _FAST_CUDA_DTYPES):
        return _topk_exact(x, k)
    return _topk_by_threshold(x, k)


def _topk_exact(x, k):
    """Reference selection: torch.topk over a full magnitude copy."""
    return torch.topk(x.abs(), k, sorted=False).indices


def _topk_by_threshold(x, k, sample_size=None, chunk=None):
    """Exact top-k magnitudes of 1-D ``x`` via a sampled threshold, a candidate pass and a small topk."""
    bits_dtype, mask = _MAGNITUDE_BITS[x.dtype]
    bits = x.view(bits_dtype)
    n = x.numel()
    sample_size = sample_size or min(_MAX_SAMPLE_SIZE, max(_MIN_SAMPLE_SIZE, n // _SAMPLE_PER))
    chunk = chunk or (_CUDA_CHUNK if x.is_cuda else _CPU_CHUNK)
    gen = torch.Generator().manual_seed(_SAMPLE_SEED)
    where = torch.randint(n, (sample_size,), generator=gen).to(x.device)
    sample = _magnitudes(bits, mask, where)
    # Expected rank of the k-th magnitude in the sample, and its binomial spread.
    rank = k * sample_size / n
    spread = math.sqrt(rank * (1.0 - k / n)) + 1.0
    # More entries above the threshold than this means the sample misled us: give up on it.
    cap = 2 * k + sample_size
    for margin in _MARGINS:
        r = math.ceil(rank + margin * spread)
        threshold = int(torch.topk(sample, r).values[-1]) if r <= sample_size else 0
        try:
            picked = _pick_above(bits, mask, threshold, k, cap, chunk)
        except _TooManyCandidates:
            break
        if picked is not None:
            return picked
    return _topk_exact(x, k)


class _TooManyCandidates(Exception):
    """More than ``cap`` magnitudes exceed the threshold: it lies far below the k-th one."""


def _pick_above(bits, mask, threshold, k, cap, chunk):
    """Top-k indices if at least k magnitudes reach ``threshold``, else None; one pass over ``bits``."""
    n = bits.numel()
    mags = torch.empty(min(chunk, n), dtype=bits.dtype, device=bits.device)
    hits = torch.empty(min(chunk, n), dtype=torch.bool, device=bits.device)
    found, n_found = [], 0
    tied = None
    bound = threshold
    for start in range(0, n, chunk):
        length = min(chunk, n - start)
        found.append(_at_or_above(bits[start:start + length], mask, bound, mags[:length], hits[:length], start))
        n_found += found[-1].numel()
        if n_found > cap and tied is None:
            # Many entries equal to the threshold (zeros of a sparse gradient, say): the first k of
            # them in index order are all that can be needed, so keep those and from here on collect
            # strictly larger magnitudes only.
            found = torch.cat(found)
            is_above = _magnitudes(bits, mask, found) > threshold
            tied = found.index_select(0, _nonzero(~is_above)[:k])
            found = [found.index_select(0, _nonzero(is_above))]
            n_found = found[0].numel()
            if threshold == mask:
                break
            bound = threshold + 1
        if n_found > cap:
            raise _TooManyCandidates
    found = torch.cat(found)
    if n_found < k:
        # Too few reach the threshold, unless the tied ones kept above make up the difference.
        return None if tied is None else torch.cat([found, tied[:k - n_found]])
    if n_found == k:
        return found
    return found.index_select(0, torch.topk(_magnitudes(bits, mask, found), k, sorted=False).indices)


def _at_or_above(bits, mask, bound, mags, hits, offset):
    """Ascending positions, plus ``offset``, of the entries of ``bits`` whose magnitude bits reach
    ``bound`` (``mags`` and ``hits``: scratch of ``bits``' length). On a CPU with one torch thread, in
    numpy: one thread per rank is how Horovod runs CPU workers, and there numpy's vectorised and,
    compare and nonzero took 1.7 ms against torch's 3.0 ms for 2.18M float32 at 1% (5.0 against 8.7 ms
    for 6.3M); with two threads torch's parallel kernels matched numpy and were 1.12x faster at 25M
    (docs/studies/2026-11-selection-speed.md)."""
    if bits.device.type != "cpu" or torch.get_num_threads() > 1:
        torch.bitwise_and(bits, mask, out=mags)
        torch.ge(mags, bound, out=hits)
        return _nonzero(hits, offset=offset)
    above = np.greater_equal(np.bitwise_and(bits.numpy(), mask, out=mags.numpy()), bound, out=hits.numpy())
    return torch.from_numpy(np.flatnonzero(above)).add_(offset)


def _magnitudes(bits, mask, idx):
    """Magnitude bits of the entries at ``idx``."""
    return torch.bitwise_and(bits.index_select(0, idx), mask)


def _nonzero(hits, offset=0):
    """Ascending positions, plus ``offset``, of the True entries of a 1-D bool mask."""
    if hits.is_cuda:
        return hits.nonzero().view(-1).add_(offset)
    # CPU nonzero is slow per element scanned (and worse when parallel): scan the mask as 8-byte
    # words first, then only the bytes of the words that hold a hit.
    body = hits.numel() // 8 * 8
    words = hits[:body].view(torch.int64).nonzero().view(-1)
    row_col = hits[:body].view(torch.int64).index_select(0, words).view(torch.bool).view(-1, 8).nonzero()
    found = words.index_select(0, row_col[:, 0]).mul_(8).add_(row_col[:, 1])
    if body < hits.numel():
        found = torch.cat([found, hits[body:].nonzero().view(-1).add_(body)])
    return found.add_(offset)


def ascending(idx):
    """The 1-D integer tensor ``idx`` sorted ascending: on the CPU by numpy's vectorised sort, 10x torch's
    for 21,800 int64 indices and 2.6-4.6x for 63,000-250,000, at one thread or two
    (bench/results/sort_one_thread); on CUDA by torch's. (numpy's unique was no faster than torch's and,
    at two threads, up to 2.1x slower: split_reduce's candidates keep ``torch.unique``.)

    Example:
        >>> ascending(torch.tensor([3, 1, 2])).tolist()
        [1, 2, 3]
    """
    if idx.device.type != "cpu":
        return idx.sort().values
    return torch.from_numpy(np.sort(idx.numpy()))


def spread_indices(numel, k, device=None):
    """k evenly spaced indices of a tensor of ``numel`` elements; identical on every rank."""
    return torch.arange(k, device=device, dtype=torch.int64) * numel // k


def scatter_dense(values, indices, numel):
    """Dense 1-D tensor of ``numel`` zeros with ``values`` placed at ``indices``."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out.index_copy_(0, indices, values)
    return out


def topk_energies(x, ks):
    """Squared norm of the top-k of |x| for every k in ``ks`` (sorted ascending or not), as floats.

    One selection at the largest k, then a cumulative sum of the sorted squares: the compression gain
    ``topk_energies(acc, ks)[i] / ||acc||^2`` of every candidate k from one pass.

    Example:
        >>> topk_energies(torch.tensor([3.0, -4.0, 1.0]), [1, 2])
        [16.0, 25.0]
    """
    ks = [int(k) for k in ks]
    if not ks or min(ks) < 0 or max(ks) > x.numel():
        raise ValueError(f"ks must be ints in [0, {x.numel()}], got {ks!r}")
    kmax = max(ks)
    if kmax == 0:
        return [0.0 for _ in ks]
    values = x.index_select(0, topk_indices(x, kmax)).double()
    sq = values.mul_(values).sort(descending=True).values.cumsum(0)
    return [float(sq[k - 1]) if k else 0.0 for k in ks]


def sq_norm_finite(x):
    """(||x||^2 as a float, whether every entry of x is finite), in one fast pass.

    The float32 dot product overflows to inf only for enormous finite values; only then is the exact
    ``isfinite`` check run, so a finite tensor is never reported non-finite.
    """
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    sq = float(torch.dot(xf, xf))
    if math.isfinite(sq):
        return sq, True
    return sq, bool(torch.isfinite(x).all())


def sq_norm64(x):
    """||x||^2 as a float, summed in float64 without a float64 copy of x (``vector_norm``'s ``dtype``
    casts as it reads): the quality figures' energies, where a float64 copy and a dot of 2M entries took
    11-20 ms against 1.4 ms.

    Example:
        >>> sq_norm64(torch.tensor([3.0, -4.0]))
        25.0
    """
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2
