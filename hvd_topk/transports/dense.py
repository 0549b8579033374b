"""Dense: a plain allreduce of the whole tensor, as cheap as stock Horovod.

For tensors never compressed (1-D, small, integer) and for sparse ones at density 1 (dense steps, ratio
1.0, auto's dense plan). ``acc`` may be the gradient itself: it is only read, so nothing is copied before
sending, and no flag is appended: a non-finite rank shows in the sum, read after (identical on all
ranks). Everything is sent, so the residual is flushed (``sent`` None).
"""
from ..core.sparsify import sq_norm_finite
from .base import Outcome, Started

__all__ = ["Dense"]


class Dense:
    """Allreduce everything.

    Args:
        collectives: the ``Collectives`` that start the allreduce.
        reduction: ``Reduction``.
        value_dtype: dtype on the wire; None keeps the tensor's.
        name: middle part of the collective's name (``hvd_topk.<name>.<key>``).
    """

    def __init__(self, collectives, reduction, value_dtype=None, name="values"):
        self.collectives, self.reduction, self.value_dtype, self.name = collectives, reduction, value_dtype, name

    def forget(self):
        """Nothing outlives a step."""

    def start(self, key, acc, k=None, finite=None, grad=None, step=None, k_next=None):
        vdtype = self.value_dtype or acc.dtype
        buf = acc if acc.dtype == vdtype else acc.to(vdtype)
        r = self.reduction
        wait = self.collectives.allreduce(key, buf, f"hvd_topk.{self.name}.{key}", r.op, r.prescale, r.postscale)

        def finish():
            out = wait()
            return Outcome(out.to(acc.dtype) if sq_norm_finite(out)[1] else None, None)
        return Started(buf.numel() * buf.element_size(), 0.0, finish)
