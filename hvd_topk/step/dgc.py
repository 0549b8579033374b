"""DGC momentum correction and factor masking (Lin et al., ICLR 2018), per rank, keyed by parameter name.

With SGD momentum m, weight decay λ and dampening d, every rank keeps its own velocity u per parameter::

    g' = g + λ·p;   u = m·u + (1 - d)·g' (u = g' at the first step);   send  u  (or g' + m·u with Nesterov)

into error feedback, and the wrapped optimizer applies the aggregate with momentum and weight decay
switched off (both already live in u). Factor masking: once entries of a tensor are sent, u is zeroed
there too, so the momentum of a sent entry does not push it again from the residual. Velocities are
committed only when the step is finite on every rank.

The user's settings stay where the user (and a scheduler such as ``OneCycleLR(cycle_momentum=True)``)
reads and writes them: ``param_groups``. They are read at every step, and switched off only for the
duration of the wrapped optimizer's own step (``hidden``).
"""
import contextlib
import math
from typing import NamedTuple

import torch

__all__ = ["MomentumSettings", "MomentumCorrection", "clip_local"]


def clip_local(g, clip_grad_norm, size):
    """DGC's local gradient clipping: ``g`` scaled to norm clip_grad_norm * size**-0.5 if it is longer
    (the sum of ``size`` such gradients then has norm at most clip_grad_norm); None: unchanged."""
    if clip_grad_norm is not None:
        limit = clip_grad_norm / math.sqrt(size)
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


_OFF = {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}


class MomentumCorrection:
    """Velocities per parameter name, for the parameters whose groups it corrects (``take_over``)."""

    def __init__(self):
        self.optimizer = None                 # the wrapped optimizer: the user's settings live in its groups
        self.group_index = {}                 # name -> index of its param group
        self.velocities = {}                  # name -> flat u, this rank's

    def take_over(self, optimizer, names):
        """Correct every parameter of ``optimizer``: from now on its own step applies the learning rate
        only (see ``hidden``). A velocity not yet started begins from the optimizer's own
        ``momentum_buffer`` if it has one (the same quantity: Horovod's ``broadcast_optimizer_state``
        creates it, a plain checkpoint may hold it). Groups are found by index at every use:
        ``load_state_dict`` replaces the group dicts (keeping their order)."""
        self.optimizer = optimizer
        for i, group in enumerate(optimizer.param_groups):
            for q in group["params"]:
                self.group_index[names[q]] = i

    @property
    def groups(self):
        """name -> its param group now."""
        return {name: self.optimizer.param_groups[i] for name, i in self.group_index.items()}

    @property
    def settings(self):
        """name -> ``MomentumSettings`` now in force, read from the param groups."""
        return {name: MomentumSettings.of(group) for name, group in self.groups.items()}

    @contextlib.contextmanager
    def hidden(self):
        """Momentum, dampening, Nesterov and weight decay switched off in the corrected groups for the
        wrapped optimizer's step (they already live in the velocities), the user's values put back after."""
        groups = [self.optimizer.param_groups[i] for i in sorted(set(self.group_index.values()))]
        saved = [{key: group[key] for key in _OFF if key in group} for group in groups]
        for group in groups:
            group.update((key, value) for key, value in _OFF.items() if key in group)
        try:
            yield
        finally:
            for group, values in zip(groups, saved):
                group.update(values)

    def correct(self, name, g, p):
        """(what goes into error feedback, the new velocity or None): one fused pass per term
        (torch.add with alpha), not a temporary per product. ``g`` is flat; ``p`` the parameter."""
        i = self.group_index.get(name)
        if i is None:
            return g, None
        s = MomentumSettings.of(self.optimizer.param_groups[i])
        if s.weight_decay:
            g = torch.add(g, p.detach().reshape(-1), alpha=s.weight_decay)
        u = self.velocities.get(name)
        if u is None and p in self.optimizer.state:
            buf = self.optimizer.state[p].get("momentum_buffer")
            u = None if buf is None else buf.reshape(-1)
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
