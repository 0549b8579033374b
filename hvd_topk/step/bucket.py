"""Global selection: one top-k over all compressed tensors of a step, fused into one bucket.

Layer-wise selection gives every tensor its own k; global selection lets a layer whose accumulator is
large take more of the budget. The bucket is the concatenation of the step's compressed tensors in name
order (identical on every rank, whatever order Horovod's hooks fired in), so the ranks' buckets line up
entry for entry and any transport applies to it as to one tensor.
"""
import torch

__all__ = ["GLOBAL_KEY", "GlobalBucket"]

GLOBAL_KEY = "__global__"        # residual and index-set key of the bucket


class GlobalBucket:
    """Collects the step's compressed tensors; the first ``output`` of a step sends them all."""

    def __init__(self):
        self.entries = []                     # (name, p, flat g, velocity or None) of this step
        self.outputs = {}                     # name -> (p, aggregate slice or None, sent part, velocity)

    def add(self, name, p, g, u_new):
        self.entries.append((name, p, g, u_new))

    def output(self, name, send):
        """(p, aggregate of ``name`` or None if non-finite, its sent indices or None, its velocity).

        On the first call of a step, ``send(flat)`` runs the transport over the whole bucket and
        returns (aggregate or None, sent indices or None); every entry gets its slice."""
        if self.entries:
            entries = sorted(self.entries, key=lambda e: e[0])
            self.entries = []
            aggregate, sent = send(torch.cat([g for _, _, g, _ in entries]))
            offset = 0
            for n, p, g, u_new in entries:
                end = offset + g.numel()
                part = None if sent is None else sent[(sent >= offset) & (sent < end)] - offset
                self.outputs[n] = (p, None if aggregate is None else aggregate[offset:end], part, u_new)
                offset = end
        return self.outputs.pop(name)
