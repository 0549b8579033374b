"""AR-Topk (Tyagi & Swany, arXiv 2312.02493): every rank sends its accumulator at one shared index set.

Why it is correct: every rank gathers its own accumulator at the *same* k indices, so the k-value
vectors line up and Horovod's allreduce sums them exactly as it would sum dense gradients. The set is
picked by a leader (``hvd_topk.transports.leaders``) and shared by ``IndexPipeline`` (one step stale by default).
A finite flag rides as element k: its sum tells every rank whether some rank was non-finite.

Used by the optimizer (``start``) and, through ``pack``/``unpack``, by ``TopKEF``, whose allreduce is
Horovod's own.
"""
import torch

from .collectives import finite_flag, flag_raised
from ..core.sparsify import scatter_dense, sq_norm_finite
from .base import Outcome, Started

__all__ = ["ARTopk"]


class ARTopk:
    """AR-Topk over one ``IndexPipeline`` and one leader policy.

    Args:
        index_sets: the ``IndexPipeline`` that shares the sets.
        leaders: ``StarLeaders`` or ``VarLeaders``.
        collectives: the ``Collectives`` that start the allreduce (optimizer only).
        reduction: ``Reduction`` (optimizer only).
        value_dtype: dtype of the values on the wire; None keeps the accumulator's.
    """

    def __init__(self, index_sets, leaders, collectives=None, reduction=None, value_dtype=None):
        self.index_sets, self.leaders = index_sets, leaders
        self.collectives, self.reduction, self.value_dtype = collectives, reduction, value_dtype

    def forget(self):
        """The next step's index sets in flight and the leaders' scores were shared with the old ranks."""
        self.index_sets.forget()
        self.leaders.forget()

    def pack(self, key, acc, k, finite, grad, step, k_next):
        """(buffer, indices, values): ``[values at the shared set..., flag]`` in the wire dtype, the set
        (None when k covers everything) and the values in acc's dtype. Picks the next step's set
        (k_next entries) on its leader, predicted from acc and this step's ``grad``."""
        if k == acc.numel():
            indices, values = None, acc
        else:
            indices, values = self.index_sets.select(key, acc, grad, k, self.leaders.leader(key, step),
                                                     k_next, self.leaders.leader(key, step + 1))
        vdtype = self.value_dtype or acc.dtype
        return torch.cat([values.to(vdtype), finite_flag(finite, acc).to(vdtype)]), indices, values

    @staticmethod
    def unpack(reduced, indices, numel, dtype):
        """The dense flat aggregate from a reduced buffer, or None if the flag says non-finite."""
        if flag_raised(reduced[-1]):
            return None
        values = reduced[:-1].to(dtype)
        return values if indices is None else scatter_dense(values, indices, numel)

    def start(self, key, acc, k, finite, grad, step, k_next):
        """Pack and start the allreduce, named per key so Horovod's response cache hits every step."""
        buf, indices, values = self.pack(key, acc, k, finite, grad, step, k_next)
        r = self.reduction
        wait = self.collectives.allreduce(key, buf, f"hvd_topk.values.{key}", r.op, r.prescale, r.postscale,
                                          inplace=True)
        n, dtype = acc.numel(), acc.dtype
        return Started(buf.numel() * buf.element_size(), sq_norm_finite(values)[0],
                       lambda: Outcome(self.unpack(wait(), indices, n, dtype), indices))
