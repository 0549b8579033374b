"""Transports for sparse gradients over Horovod's public collectives.

- AR-Topk (Tyagi & Swany, arXiv 2312.02493): one leader's index set is shared by all ranks and the k
  values are allreduced. ``IndexPipeline`` shares the index sets: by default the leader of step t+1
  picks its set during step t and sends it (int32) with an asynchronous broadcast that completes while
  the step goes on ("one step stale"), so the backward pass never waits on a collective per tensor.
- Sparse allgather: every rank sends its own (values, int32 indices); receivers scatter-add.
"""
import torch
from horovod.torch import mpi_ops

from .sparsify import spread_indices, topk_indices

__all__ = ["IndexPipeline", "star_leader", "finite_flag", "flag_raised", "allgather_sparse_async",
           "scatter_add_gathered", "agree"]


def agree(values, name, average=True):
    """``values`` averaged over the ranks (or rank 0's with ``average=False``), as rank 0 holds them.

    The broadcast makes the bits identical everywhere (an allreduce alone may round differently per
    rank), so decisions taken from the result are the same on every rank. Collective.
    """
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if mpi_ops.size() == 1:
        return t.tolist()
    if average:
        t = mpi_ops.allreduce(t, op=mpi_ops.Sum, name=f"{name}.sum") / mpi_ops.size()
    return mpi_ops.broadcast(t, root_rank=0, name=name).tolist()


def finite_flag(finite, like):
    """One element that rides with the values: 0 if this rank's accumulator is finite, else 1."""
    return torch.tensor([0.0 if finite else 1.0], dtype=like.dtype, device=like.device)


def flag_raised(flag):
    """True when an aggregated flag says some rank was non-finite (its sum > 0, or itself NaN/Inf)."""
    return not bool(torch.isfinite(flag)) or bool(flag != 0)


def star_leader(key_index, step, size):
    """STAR: round robin over steps, offset by the tensor's index so selection work spreads over ranks."""
    return (step + key_index) % size


class IndexPipeline:
    """Shared AR-Topk index sets, per key (tensor), identical on every rank.

    Args:
        name: prefix of the Horovod collective names (must be identical on all ranks).
        sync: broadcast the current step's index set and wait for it, instead of one step stale.
    """

    def __init__(self, name, sync=False):
        self.name = name
        self.sync = sync
        self.pending = {}          # key -> (handle or None, int32 index buffer) for the next step

    def current(self, key, acc, k, leader):
        """The int64 index set every rank uses for ``key`` now; ``leader`` picks it if ``sync``."""
        if self.sync:
            buf = (topk_indices(acc, k).to(torch.int32) if mpi_ops.rank() == leader
                   else torch.empty(k, dtype=torch.int32, device=acc.device))
            if mpi_ops.size() > 1:
                mpi_ops.broadcast_(buf, root_rank=leader, name=f"{self.name}.{key}")
            return buf.long()
        handle, buf = self.pending.pop(key, (None, None))
        if handle is not None:
            mpi_ops.synchronize(handle)
        if buf is None or buf.numel() != k:    # first step, or k changed: any shared set is valid
            return spread_indices(acc.numel(), k, device=acc.device)
        return buf.long()

    def select(self, key, acc, grad, k, leader, k_next, next_leader):
        """(indices, values) every rank sends for ``key`` now; starts sharing the next step's set.

        ``leader`` picks the set if ``sync``; ``next_leader`` picks the next one (k_next entries)."""
        indices = self.current(key, acc, k, leader)
        values = acc.index_select(0, indices)
        if k_next < acc.numel():
            self.launch_next(key, acc, grad, indices, k_next, next_leader)
        return indices, values

    def launch_next(self, key, acc, grad, indices, k, leader):
        """Leader of the next step picks top-k of (acc minus what is sent now, plus this gradient).

        ``acc`` still holds the values being sent at ``indices``; it is returned unchanged."""
        if self.sync:
            return
        if mpi_ops.rank() == leader:
            sent = acc.index_select(0, indices)
            acc.index_copy_(0, indices, grad.index_select(0, indices))   # predicts acc of next step
            buf = topk_indices(acc, k).to(torch.int32)
            acc.index_copy_(0, indices, sent)
        else:
            buf = torch.empty(k, dtype=torch.int32, device=acc.device)
        handle = None
        if mpi_ops.size() > 1:
            handle = mpi_ops.broadcast_async_(buf, root_rank=leader, name=f"{self.name}.{key}")
        self.pending[key] = (handle, buf)

    def state_dict(self):
        """Pending index sets (waits for in-flight broadcasts)."""
        out = {}
        for key, (handle, buf) in self.pending.items():
            if handle is not None:
                mpi_ops.synchronize(handle)
            out[key] = buf.clone()
        self.pending = {key: (None, buf) for key, buf in out.items()}
        return out

    def load_state_dict(self, state):
        self.pending = {key: (None, buf.clone()) for key, buf in state.items()}


def allgather_sparse_async(values, indices, name):
    """Start allgathers of this rank's ``values`` and int32 ``indices``; returns their handles."""
    return (mpi_ops.allgather_async(values.reshape(-1, 1), name=f"{name}.values"),
            mpi_ops.allgather_async(indices.to(torch.int32).reshape(-1, 1), name=f"{name}.indices"))


def scatter_add_gathered(handles, numel, dtype):
    """Wait for ``allgather_sparse_async`` and scatter-add every rank's set into a dense vector."""
    values = mpi_ops.synchronize(handles[0]).reshape(-1)
    indices = mpi_ops.synchronize(handles[1]).reshape(-1).long()
    dense = torch.zeros(numel, dtype=dtype, device=values.device)
    dense.index_add_(0, indices, values.to(dtype))
    return dense
