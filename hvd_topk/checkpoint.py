"""One checkpoint file per rank, so that every rank's residuals and momentum survive a restart.

The usual "rank 0 saves the optimizer" habit throws the other ranks' error-feedback state away.
"""
import os

import torch
from horovod.torch import mpi_ops

__all__ = ["rank_path", "save_checkpoint", "load_checkpoint"]


def rank_path(path, rank=None, size=None):
    """This rank's file: ``path`` with ``{rank}`` filled in, or ``<path>.rank<r>-of-<size>``."""
    rank = mpi_ops.rank() if rank is None else rank
    size = mpi_ops.size() if size is None else size
    return path.format(rank=rank, size=size) if "{rank}" in path else f"{path}.rank{rank}-of-{size}"


def save_checkpoint(path, model, optimizer, **extra):
    """Write this rank's model, optimizer (with hvd_topk residuals) and ``extra`` to its own file.

    Every rank must call it. The file is written to a temporary name and renamed, so a job killed
    mid-write leaves the previous checkpoint intact.

    Args:
        path: file path (``{rank}`` may appear in it; otherwise ``.rank<r>-of-<size>`` is appended).
        model: the torch module.
        optimizer: an ``hvd_topk.DistributedOptimizer`` (or any optimizer).
        **extra: anything picklable to restore with it (epoch, step, scheduler state, RNG state ...).

    Returns:
        The path written.

    Example:
        >>> hvd_topk.save_checkpoint("ckpt/run1.pt", model, opt, epoch=epoch)
    """
    target = rank_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    tmp = f"{target}.tmp"
    torch.save({"world_size": mpi_ops.size(), "rank": mpi_ops.rank(), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "extra": extra}, tmp)
    os.replace(tmp, target)
    return target


def load_checkpoint(path, model, optimizer):
    """Restore what ``save_checkpoint`` wrote for this rank; returns its ``extra`` dict.

    Raises:
        FileNotFoundError: this rank's file is missing.
        ValueError: the checkpoint was written by a job with another number of ranks, or for another
            model (residuals are per rank and per parameter; they are never silently re-split).
    """
    target = rank_path(path)
    if not os.path.exists(target):
        raise FileNotFoundError(f"no checkpoint for rank {mpi_ops.rank()} of {mpi_ops.size()}: {target} "
                                "(was it written with another number of ranks?)")
    state = torch.load(target, map_location="cpu", weights_only=False)
    if state["world_size"] != mpi_ops.size() or state["rank"] != mpi_ops.rank():
        raise ValueError(f"{target} was written by rank {state['rank']} of {state['world_size']}, "
                         f"this is rank {mpi_ops.rank()} of {mpi_ops.size()}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["extra"]
