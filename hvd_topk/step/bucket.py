"""Global selection: one top-k over all compressed tensors of a step, fused into one bucket.

Layer-wise selection gives every tensor its own k; global selection lets a layer whose accumulator is
large take more of the budget. The bucket is the concatenation of the step's compressed tensors in key
order (identical on every rank, whatever order Horovod's hooks fired in), so the ranks' buckets line up
entry for entry and any transport applies to it as to one tensor. Both doors use it: the optimizer keeps
the bucket's residual whole (``GLOBAL_KEY``); ``TopKEF`` hands each key its slice of it.
"""
from typing import NamedTuple, Optional

import torch

__all__ = ["GLOBAL_KEY", "GlobalBucket", "Part"]

GLOBAL_KEY = "__global__"        # the bucket's key in the transports (and the optimizer's residual)


class Part(NamedTuple):
    """One tensor's share of the bucket's outcome."""
    aggregate: Optional[torch.Tensor]     # its slice of the aggregate; None: some rank was non-finite
    sent: Optional[torch.Tensor]          # its indices among those ``send`` named; None where it named none
    residual: Optional[torch.Tensor]      # its slice of the new residual ``send`` gave, or None


class GlobalBucket:
    """Collects the step's compressed tensors, flat, by key; the first ``output`` of a step sends them all."""

    def __init__(self):
        self.entries = {}                     # key -> flat tensor of this step
        self.outputs = {}                     # key -> Part, not yet handed out

    def add(self, key, flat):
        self.entries[key] = flat

    def output(self, key, send):
        """``key``'s ``Part``. On the first call of a step, ``send(flat)`` runs the transport over the
        whole bucket and returns (aggregate or None, indices or None, new residual or None); every entry
        gets its slice of each."""
        if self.entries:
            keys = sorted(self.entries)
            flats = [self.entries[k] for k in keys]
            self.entries = {}
            aggregate, sent, residual = send(torch.cat(flats))
            offset = 0
            for k, flat in zip(keys, flats):
                end = offset + flat.numel()
                self.outputs[k] = Part(None if aggregate is None else aggregate[offset:end],
                                       None if sent is None else sent[(sent >= offset) & (sent < end)] - offset,
                                       None if residual is None else residual[offset:end])
                offset = end
        return self.outputs.pop(key)
