"""Per-rank error-feedback state: residuals (and later momentum) keyed by parameter slot.

Error-feedback invariant (Stich 2018; Karimireddy 2019), per slot and per rank, over steps t = 1..T:

    sum_t sent_t + residual_T = sum_t grad_t + residual_0

where ``sent_t`` is this rank's contribution before the collective. Residuals are per rank: they are
never averaged, broadcast or dropped; a skipped (non-finite) step leaves them untouched.
"""
from .sparsify import sq_norm_finite

__all__ = ["SlotSequence", "ResidualMemory"]


class SlotSequence:
    """Gives each ``compress()`` call of a step its slot, by position, and checks the sequence.

    Horovod's ``Compressor.compress(tensor)`` receives only the gradient, not its parameter. Within a
    step Horovod compresses every gradient (in backward-hook order) before it decompresses any, so the
    i-th compress of a step belongs to the i-th parameter of the first step. The first step records
    each slot's (shape, dtype, device); later steps must match it exactly, or we raise instead of
    applying a residual to the wrong tensor.
    """

    def __init__(self):
        self.signatures = []      # (shape, dtype, device) per slot; complete after the first step
        self.complete = False     # True once the first step has reached decompress
        self.position = 0         # slots handed out in the current step
        self.pending = 0          # compressed but not yet decompressed in the current step
        self.decompressing = False

    def next_slot(self, tensor):
        """Slot of the next gradient of this step; raises ValueError if the sequence changed."""
        if self.decompressing:
            if self.pending:
                raise RuntimeError(
                    f"TopKEF: a new step started with {self.pending} gradient(s) of the previous "
                    "step never decompressed; use one TopKEF instance per optimizer and let "
                    "Horovod's synchronize() finish every step")
            self.decompressing = False
            self.position = 0
        signature = (tuple(tensor.shape), tensor.dtype, tensor.device)
        slot = self.position
        if not self.complete:
            self.signatures.append(signature)
        elif slot >= len(self.signatures):
            raise ValueError(
                f"TopKEF: this step compresses more gradients than the first step "
                f"({len(self.signatures)}); the model or its trainable parameters changed. "
                "Create a new TopKEF (and optimizer) for a new model; residuals are kept per slot")
        elif self.signatures[slot] != signature:
            raise ValueError(
                f"TopKEF: gradient #{slot} of this step has shape/dtype/device {signature}, but "
                f"slot #{slot} holds a residual for {self.signatures[slot]}; the sequence of "
                "gradients changed (different model, or a parameter frozen mid-run). Refusing to "
                "apply a residual to the wrong tensor")
        self.position += 1
        self.pending += 1
        return slot

    def finish_one(self):
        """Record one decompress; on the first of a step, check the step had every slot."""
        if not self.decompressing:
            self.decompressing = True
            if not self.complete:
                self.complete = True
            elif self.position != len(self.signatures):
                raise ValueError(
                    f"TopKEF: this step compressed {self.position} gradients, the first step "
                    f"{len(self.signatures)}; the model or its trainable parameters changed")
        self.pending -= 1


class ResidualMemory:
    """This rank's residual per key; ``None`` stands for an all-zero residual (nothing held back)."""

    def __init__(self):
        self.residuals = {}       # key -> flat tensor, or None when everything was sent

    def compensate(self, key, grad, copy=True):
        """Flat acc = grad + residual[key] (the residual itself is left as it is): a new tensor, or with
        copy=False and no residual, ``grad`` itself (flattened) for a caller that only reads it."""
        residual = self.residuals.get(key)
        flat = grad.reshape(-1)
        if residual is None:
            return flat.clone() if copy else flat
        return flat + residual

    def update(self, key, residual):
        """Commit ``residual`` (acc with the sent entries zeroed, or None) as the new residual."""
        self.residuals[key] = residual

    def norm(self):
        """L2 norm of all residuals together (float)."""
        return sum(sq_norm_finite(r)[0] for r in self.residuals.values() if r is not None) ** 0.5

    def state_dict(self):
        return {key: (None if r is None else r.detach().clone()) for key, r in self.residuals.items()}

    def load_state_dict(self, state):
        self.residuals = {key: (None if r is None else r.clone()) for key, r in state.items()}
