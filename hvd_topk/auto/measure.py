"""What the tuner measures of this machine, and its one contact with the other ranks.

``time_compression`` times this rank's top-k selection and one pass over an accumulator (σ and π of
``hvd_topk.auto.plans``); ``HorovodWorld`` has the ranks agree on numbers. A test may hand the tuner
another world with the same three methods.
"""
import statistics

import torch
from horovod.torch import mpi_ops

from ..core.sparsify import k_for, topk_indices
from ..transports.collectives import agree

__all__ = ["HorovodWorld", "time_compression"]

# The compression timing: a tensor as large as the largest compressed one (this size when none is),
# capped so that it stays a fraction of a second on a slow host; the median of a few repeats, so that
# one slow call on a busy host does not count.
_TIMING_NUMEL_NO_TENSOR = 1 << 16
_TIMING_MAX_NUMEL = 1 << 22              # 4M elements: per-element costs are flat well before that
_TIMING_REPEATS = 3
_TIMING_SEED = 0                         # the same tensor on every rank and every probe


class HorovodWorld:
    """The tuner's only contact with the other ranks; a test may give a tuner another object with the
    same three methods (``tuner.world = ...``)."""

    @staticmethod
    def agree(values, name):
        """``values`` averaged over the ranks, bit-identical everywhere (collective)."""
        return agree(values, name)

    @staticmethod
    def size():
        return mpi_ops.size()

    @staticmethod
    def rank():
        return mpi_ops.rank()


def time_compression(numels, ratio, clock):
    """This rank's [s per element of a top-k selection, s per element of one pass], from a tensor as
    large as the largest of ``numels`` (dict name -> elements), capped at ``_TIMING_MAX_NUMEL``."""
    n = min(max(numels.values(), default=_TIMING_NUMEL_NO_TENSOR), _TIMING_MAX_NUMEL)
    x = torch.randn(n, generator=torch.Generator().manual_seed(_TIMING_SEED))
    k = k_for(n, ratio)
    sel, sweep = [], []
    for _ in range(_TIMING_REPEATS):
        t0 = clock()
        topk_indices(x, k)
        t1 = clock()
        x.add_(x, alpha=0.0)
        sweep.append(clock() - t1)
        sel.append(t1 - t0)
    return [statistics.median(sel) / n, statistics.median(sweep) / n]
