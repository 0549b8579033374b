"""``second_moment='frozen'`` (with ``compress='update'``): Adam's second moment is taken from the averaged
gradients of the dense steps and then held, as 1-bit Adam (Tang et al., ICML'21) freezes it after its
warm-up.

Why: with ``compress='update'`` every rank steps Adam on its own gradient, so each rank's second moment
estimates the squared gradient of its own share of the batch, whose noise does not shrink with the
rank count as dense Adam's does. Averaging those ranks' updates uncompressed ended 8.3% above dense's
loss on the LM at 4 ranks (docs/optimizer.md). The dense steps step Adam on the averaged gradient
(``hvd_topk.step.update``), so at their end every rank holds dense Adam's moments; held from then on, the
second moment stays dense Adam's and the same on every rank, and a rank's update is linear in its
gradient (with the momentum kept, the mean of the ranks' updates is Adam's with that moment). Measured
on the LM (docs/optimizer.md): with β1 = 0 (``local_momentum=False``) the recipe then ends at or under
dense's loss; the freeze alone, nothing compressed and β1 kept, ends above it.

How, without writing Adam again: torch's Adam and AdamW divide by sqrt(v / (1 − β2^t)), v updated from
the step's gradient first. Before each compressed step v is scaled so that v / (1 − β2^t) is the frozen
v̂ at the new t, and after the step that v is put back. The step itself divides by
sqrt(β2·v̂ + (1 − β2)·g² / (1 − β2^t)), mostly v̂ (β2 = 0.99 on the LM); the state keeps v̂ exactly, in
the optimizer's own ``exp_avg_sq``, so its ``state_dict()`` (the per-rank checkpoint) carries it.
"""
import contextlib

import torch

__all__ = ["frozen"]


@contextlib.contextmanager
def frozen(optimizer):
    """Around one compressed step of ``optimizer``: every second moment at t >= 1 steps with v̂ as held,
    and is put back after (module docstring). A parameter with no moment yet (no gradient in the dense
    steps) takes a local one at its first step and is held from its second."""
    held = []
    for group in optimizer.param_groups:
        beta2 = group["betas"][1]
        for q in group["params"]:
            state = optimizer.state.get(q, {})
            t = float(state["step"]) if "step" in state else 0.0
            if "exp_avg_sq" not in state or t < 1:
                continue
            v = state["exp_avg_sq"]
            v.mul_((1.0 - beta2 ** (t + 1)) / (1.0 - beta2 ** t))
            held.append((v, v.clone()))
    try:
        yield
    finally:
        for v, value in held:
            v.copy_(value)
