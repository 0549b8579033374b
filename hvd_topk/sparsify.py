"""Pure tensor functions for Top-K sparsification. No Horovod import here (DESIGN.md rule 2)."""
import math

import torch

__all__ = ["k_for", "topk_indices", "spread_indices", "scatter_dense", "sq_norm_finite"]


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


def topk_indices(x, k):
    """Indices (int64) of the k entries of the 1-D tensor ``x`` with the largest magnitude.

    NaN is treated as larger than any number (as ``torch.topk`` does).

    Args:
        x: 1-D floating tensor (CPU or CUDA).
        k: 1 <= k <= x.numel().

    Returns:
        1-D int64 tensor of k distinct indices, in no particular order.

    Example:
        >>> topk_indices(torch.tensor([0.1, -3.0, 2.0]), 2).sort().values.tolist()
        [1, 2]
    """
    if k >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    return torch.topk(x.abs(), k, sorted=False).indices


def spread_indices(numel, k, device=None):
    """k evenly spaced indices of a tensor of ``numel`` elements; identical on every rank."""
    return torch.arange(k, device=device, dtype=torch.int64) * numel // k


def scatter_dense(values, indices, numel):
    """Dense 1-D tensor of ``numel`` zeros with ``values`` placed at ``indices``."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out.index_copy_(0, indices, values)
    return out


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
