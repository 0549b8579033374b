"""Sparse allgather: every rank sends its own top-k as (values, int32 indices); every rank scatter-adds.

Why it is correct: each rank receives every rank's (values, indices) pairs and adds them into the same
zero vector in the same order, so the aggregate is exact and identical everywhere. Each rank's flag
rides as one extra entry at index n (one past the end): the sum there is the flags' sum. Bytes per rank
grow with the number of ranks: it receives (P - 1) * k pairs.
"""
import torch

from .collectives import finite_flag, flag_raised
from ..core.sparsify import sq_norm_finite, topk_indices
from ..core.wire import INDEX_BYTES
from .base import Outcome, Started

__all__ = ["SparseAllgather"]



class SparseAllgather:
    """Every rank's own top-k, gathered by all.

    Args:
        collectives: the ``Collectives`` that start the allgathers.
        average: divide the sum by the number of ranks (Horovod's Average).
        value_dtype: dtype of the values on the wire; None keeps the accumulator's.
        name: prefix of the collectives' names (distinct per optimizer or TopKEF, identical on all ranks).
    """

    def __init__(self, collectives, average, value_dtype=None, name="hvd_topk.allgather"):
        self.collectives, self.average, self.value_dtype, self.name = collectives, average, value_dtype, name

    def forget(self):
        """Nothing outlives a step."""

    def start(self, key, acc, k, finite, grad=None, step=None, k_next=None):
        n = acc.numel()
        indices = torch.arange(n, device=acc.device) if k == n else topk_indices(acc, k)
        values = acc.index_select(0, indices)
        vdtype = self.value_dtype or acc.dtype
        vbuf = torch.cat([values.to(vdtype), finite_flag(finite, acc).to(vdtype)])
        ibuf = torch.cat([indices, indices.new_full((1,), n)]).to(torch.int32)
        waits = self.collectives.allgather(key, [vbuf.reshape(-1, 1), ibuf.reshape(-1, 1)],
                                           f"{self.name}.{key}")
        sent = None if k == n else indices

        def finish():
            gathered_values, gathered_indices = waits[0]().reshape(-1), waits[1]().reshape(-1).long()
            dense = torch.zeros(n + 1, dtype=acc.dtype, device=gathered_values.device)
            dense.index_add_(0, gathered_indices, gathered_values.to(acc.dtype))
            if flag_raised(dense[-1]):
                return Outcome(None, sent)
            dense = dense[:-1]
            if self.average:
                dense.mul_(1.0 / self.collectives.process_set.size())
            return Outcome(dense, sent)
        return Started(vbuf.numel() * vbuf.element_size() + INDEX_BYTES * k, sq_norm_finite(values)[0], finish)
