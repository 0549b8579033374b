"""Per-rank error-feedback state: the residual of every tensor, keyed by parameter name (or, for a
``TopKEF`` given no names, by its position in the step).

Error-feedback invariant (Stich 2018; Karimireddy 2019), per key and per rank, over steps t = 1..T:

    sum_t sent_t + residual_T = sum_t grad_t + residual_0

where ``sent_t`` is this rank's contribution before the collective. Residuals are per rank: they are
never averaged, broadcast or dropped; a skipped (non-finite) step leaves them untouched.
"""
from .sparsify import sq_norm_finite

__all__ = ["ResidualMemory", "StepCommits"]


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


class StepCommits:
    """One step's state updates (new residuals, velocities), applied at its end only if every gradient
    of the step was finite on every rank: a non-finite step commits nothing, on every rank."""

    def __init__(self):
        self.updates = []                     # callables, applied in order at end()
        self.nonfinite = False                # some gradient of this step was non-finite somewhere

    def add(self, update):
        self.updates.append(update)

    def end(self):
        """Apply the updates unless the step was non-finite; start afresh. Returns whether it was."""
        nonfinite = self.nonfinite
        if not nonfinite:
            for update in self.updates:
                update()
        self.__init__()
        return nonfinite
