"""Global selection: one top-k over all compressed tensors of a step, fused into one bucket.

Layer-wise selection gives every tensor its own k; global selection lets a layer whose accumulator is
large take more of the budget. The bucket is the concatenation of the step's compressed tensors in key
order (identical on every rank, whatever order Horovod's hooks fired in), so the ranks' buckets line up
entry for entry and any transport applies to it as to one tensor. Both doors use it: the optimizer keeps
the pooled tensors' residual whole (``GLOBAL_KEY``); ``TopKEF`` hands each key its slice of it.

Row-sparse tensors (embedding tables: most rows of a step's gradient are zero) keep their own k
instead, each sent alone beside the pooled rest. Pooled, a table lost to the small dense layers, which
took far more than their share of the budget, and the embedding model took 1.13x dense's steps against
layer-wise selection's 0.88x (docs/optimizer.md, ``selection``). Which tensors are row-sparse is measured
once, at the first step (or the first after an elastic reset): each rank's share of all-zero rows,
averaged over the ranks by one allreduce and a broadcast, so every rank splits the bucket alike.
"""
from typing import NamedTuple, Optional

import torch

__all__ = ["GLOBAL_KEY", "ROW_SPARSE_SHARE", "GlobalBucket", "Part", "regroup", "zero_row_share"]

GLOBAL_KEY = "__global__"        # the pooled tensors' key in the transports (and the optimizer's residual)
ROW_SPARSE_SHARE = 0.5           # a tensor whose rows are all zero in more than this share (the ranks'
                                 # mean) is row-sparse: selected alone


class Part(NamedTuple):
    """One tensor's share of the bucket's outcome."""
    aggregate: Optional[torch.Tensor]     # its slice of the aggregate; None: some rank was non-finite
    sent: Optional[torch.Tensor]          # its indices among those ``send`` named; None where it named none
    residual: Optional[torch.Tensor]      # its slice of the new residual ``send`` gave, or None


def zero_row_share(grad):
    """The share of the rows (along dim 0) of ``grad`` that are all zero; 0.0 below two dimensions."""
    if grad.dim() < 2:
        return 0.0
    return float((grad.reshape(grad.shape[0], -1) == 0).all(dim=1).double().mean())


class GlobalBucket:
    """Collects the step's compressed tensors, flat, by key; the first ``output`` of a step sends them all.

    Args:
        agree: callable(list of this rank's zero-row shares, in sorted key order) -> the ranks' mean of
            it, the same bits on every rank (a collective: ``transports.collectives.agree``); run at the
            first step, to find the row-sparse tensors.
    """

    def __init__(self, agree):
        self.agree = agree
        self.entries, self.shares = {}, {}    # key -> flat tensor of this step; its zero-row share
        self.outputs = {}                     # key -> Part, not yet handed out
        self.pending = None                   # (groups, their flats, finish) of a step sent, not finished
        self.alone = None                     # the row-sparse keys, each selected alone; None: not yet measured

    def add(self, key, flat, grad):
        """Keep ``flat`` (what the transport sends: the accumulator, or the gradient the optimizer
        compensates) for the step; ``grad`` is the fresh gradient, which the row-sparse test measures
        (an accumulator's residual fills rows that no sample of the step touched)."""
        self.entries[key] = flat
        if self.alone is None:
            self.shares[key] = zero_row_share(grad)

    def groups(self, keys):
        """[(transport key, [keys])]: the pooled keys under ``GLOBAL_KEY``, then each row-sparse key alone."""
        pooled = [k for k in keys if k not in self.alone]
        return ([(GLOBAL_KEY, pooled)] if pooled else []) + [(k, [k]) for k in keys if k in self.alone]

    def start(self, start):
        """Send the step's tensors now: ``start([(transport key, flat), ...])`` starts the transport over
        each group (``groups``) and returns ``finish()`` -> per group (aggregate or None, indices or None,
        new residual or None)."""
        keys = sorted(self.entries)
        if self.alone is None:
            shares = self.agree([self.shares[k] for k in keys])
            self.alone = {k for k, s in zip(keys, shares) if s > ROW_SPARSE_SHARE}
        groups = self.groups(keys)
        flats = [[self.entries[k] for k in members] for _, members in groups]
        self.entries, self.shares = {}, {}
        # a tensor alone is sent as it is (an embedding table is most of the model: no copy)
        finish = start([(group, parts[0] if len(parts) == 1 else torch.cat(parts))
                        for (group, _), parts in zip(groups, flats)])
        self.pending = (groups, flats, finish)

    def output(self, key, start):
        """``key``'s ``Part``: at the first call of a step the tensors are sent (``start``) unless they
        were, and the transports finish; every entry gets its slice of its group's outcome."""
        if self.entries:
            self.start(start)
        if self.pending is not None:
            groups, flats, finish = self.pending
            self.pending = None
            for (_, members), parts, outcome in zip(groups, flats, finish()):
                self._slice(members, parts, *outcome)
        return self.outputs.pop(key)

    def _slice(self, keys, flats, aggregate, sent, residual):
        offset = 0
        for k, flat in zip(keys, flats):
            end = offset + flat.numel()
            self.outputs[k] = Part(None if aggregate is None else aggregate[offset:end],
                                   None if sent is None else sent[(sent >= offset) & (sent < end)] - offset,
                                   None if residual is None else residual[offset:end])
            offset = end

    def forget(self):
        """An abandoned step or an elastic reset (on every rank alike): its tensors go, and the row-sparse
        ones are measured anew at the next step (a new rank has not measured them)."""
        self.entries, self.shares, self.outputs, self.alone, self.pending = {}, {}, {}, None, None


def regroup(residuals, numels, alone):
    """Lay the optimizer's bucket residuals (``ResidualMemory.residuals``: the pooled keys' under
    ``GLOBAL_KEY`` in sorted key order, each alone key's under its own) out for the row-sparse keys
    ``alone``, in place: after an elastic reset, or from a checkpoint written before row-sparse tensors
    went alone, they may have been split otherwise. ``numels``: key -> numel of every bucket key."""
    whole = residuals.pop(GLOBAL_KEY, None)
    was_pooled = sorted(k for k in numels if k not in residuals)
    parts = {k: residuals.pop(k) for k in numels if k in residuals}
    if whole is not None:
        if whole.numel() != sum(numels[k] for k in was_pooled):
            raise ValueError(f"the bucket's residual has {whole.numel()} entries, its tensors "
                             f"{sum(numels[k] for k in was_pooled)}: it belongs to another model")
        for k, part in zip(was_pooled, whole.split([numels[k] for k in was_pooled])):
            parts[k] = part
    pooled = sorted(k for k in numels if k not in alone)
    like = next((p for p in parts.values() if p is not None), None)
    if like is None:
        return
    piece = {k: torch.zeros(numels[k], dtype=like.dtype, device=like.device) if parts.get(k) is None
             else parts[k] for k in numels}
    if pooled:
        residuals[GLOBAL_KEY] = torch.cat([piece[k] for k in pooled])
    residuals.update({k: piece[k] for k in numels if k in alone})
