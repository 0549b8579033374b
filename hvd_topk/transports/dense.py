"""Dense: a plain allreduce of the whole tensor, as cheap as stock Horovod; and dense in fp16 with
error feedback.

For tensors never compressed (1-D, small, integer) and for sparse ones at density 1 (dense steps, ratio
1.0, auto's dense plan). ``acc`` may be the gradient itself: it is only read, so nothing is copied before
sending, and no flag is appended: a non-finite rank shows in the sum, read after (identical on all
ranks). Everything is sent, so the residual is flushed (``sent`` None).

``DenseFP16`` (auto's ``'dense_fp16'``) sends every entry in fp16, half of dense's bytes, and keeps what
fp16 did not carry in the residual (``Outcome.residual``, ``acc - sent``), as split_reduce does with
its 16-bit values: the rounding, the entries below fp16's range, and the excess of any entry clamped to
the largest power of two under 65504 / (ranks x prescale), so that no sum of the ranks' values can
overflow to inf (a power of two: fp16 holds it exactly, where a rounded limit could round up). (Horovod's CPU
allreduce takes float16, not bfloat16.) A non-finite rank sends NaN, so every rank skips the step.
"""
import math

import torch

from ..core.sparsify import sq_norm_finite
from .base import Outcome, Started

__all__ = ["Dense", "DenseFP16"]


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
        return self._send(key, acc, buf, None)

    def _send(self, key, acc, buf, residual):
        r = self.reduction
        wait = self.collectives.allreduce(key, buf, f"hvd_topk.{self.name}.{key}", r.op, r.prescale, r.postscale)

        def finish():
            out = wait()
            return Outcome(out.to(acc.dtype), None, residual=residual) if sq_norm_finite(out)[1] else \
                Outcome(None, None)
        return Started(buf.numel() * buf.element_size(), 0.0, finish)


class DenseFP16(Dense):
    """Allreduce everything in fp16; what fp16 does not carry stays in the residual (module docstring)."""

    def __init__(self, collectives, reduction, name="values16"):
        super().__init__(collectives, reduction, torch.float16, name)
        ranks = collectives.process_set.size()
        # the largest value a rank sends: N of them, prescaled, still sum to at most fp16's largest
        most = torch.finfo(torch.float16).max / (ranks * max(1.0, abs(reduction.prescale)))
        self.limit = 2.0 ** math.floor(math.log2(most))

    def start(self, key, acc, k=None, finite=None, grad=None, step=None, k_next=None):
        buf = acc.clamp(-self.limit, self.limit).to(torch.float16)
        if not bool(torch.isfinite(acc).all()):     # clamp would turn inf into a finite value
            buf[0] = float("nan")
        return self._send(key, acc, buf, acc - buf.to(acc.dtype))
