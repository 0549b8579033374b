"""DGC momentum correction and factor masking (Lin et al., ICLR 2018), per rank, keyed by parameter name.

With SGD momentum m, weight decay λ and dampening d, every rank keeps its own velocity u per parameter::

    g' = g + λ·p;   u = m·u + (1 - d)·g' (u = g' at the first step);   send  u  (or g' + m·u with Nesterov)

into error feedback, and the wrapped optimizer applies the aggregate with momentum and weight decay
switched off (both already live in u). Factor masking: once entries of a tensor are sent, u is zeroed
there too, so the momentum of a sent entry does not push it again from the residual. Velocities are
committed only when the step is finite on every rank.
"""
import math
from typing import NamedTuple

import torch
from horovod.torch import mpi_ops

__all__ = ["MomentumSettings", "MomentumCorrection", "clip_local"]


def clip_local(g, clip_grad_norm):
    """DGC's local gradient clipping: ``g`` scaled to norm clip_grad_norm * size**-0.5 if it is longer
    (the sum of P such gradients then has norm at most clip_grad_norm); None: unchanged."""
    if clip_grad_norm is not None:
        limit = clip_grad_norm / math.sqrt(mpi_ops.size())
        norm = float(g.norm())
        if norm > limit:
            g = g * (limit / norm)
    return g


class MomentumSettings(NamedTuple):
    """SGD settings of one parameter, moved out of the wrapped optimizer by momentum correction."""
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float

    @classmethod
    def of(cls, group):
        return cls(group.get("momentum", 0.0), group.get("dampening", 0.0), bool(group.get("nesterov", False)),
                   group.get("weight_decay", 0.0))


class MomentumCorrection:
    """Velocities per parameter name; ``settings`` maps the corrected names to their ``MomentumSettings``."""

    def __init__(self):
        self.settings = {}                    # name -> MomentumSettings
        self.velocities = {}                  # name -> flat u, this rank's

    def take_over(self, param_groups, names):
        """Move momentum, dampening, Nesterov and weight decay of every group into this unit; the
        wrapped optimizer keeps applying the learning rate only."""
        for group in param_groups:
            settings = MomentumSettings.of(group)
            for q in group["params"]:
                self.settings[names[q]] = settings
            group.update(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)

    def correct(self, name, g, p):
        """(what goes into error feedback, the new velocity or None): one fused pass per term
        (torch.add with alpha), not a temporary per product. ``g`` is flat; ``p`` the parameter."""
        s = self.settings.get(name)
        if s is None:
            return g, None
        if s.weight_decay:
            g = torch.add(g, p.detach().reshape(-1), alpha=s.weight_decay)
        u = self.velocities.get(name)
        if u is None:
            u_new = g.clone()
        elif s.dampening == 0:
            u_new = torch.add(g, u, alpha=s.momentum)
        else:
            u_new = u.mul(s.momentum).add_(g, alpha=1.0 - s.dampening)
        return (torch.add(g, u_new, alpha=s.momentum) if s.nesterov else u_new), u_new

    def commit(self, name, u_new, sent):
        """Keep the new velocity, zeroed where values were sent (factor masking; ``sent`` None: all
        entries went in a plain allreduce, which masks nothing, as dense Horovod keeps its momentum)."""
        if u_new is None:
            return
        if sent is not None:
            u_new.index_fill_(0, sent, 0)
        self.velocities[name] = u_new

    def state_dict(self):
        return {k: v.clone() for k, v in self.velocities.items()}

    def load_state_dict(self, velocities):
        self.velocities = {k: v.clone() for k, v in velocities.items()}
