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


# -- the optimizer's per-rank state, inside ``optimizer.state_dict()['hvd_topk']`` ----------------------

def coordinator_state(c):
    """This rank's hvd_topk state of one optimizer (a ``StepCoordinator``), between steps: residuals,
    velocities, the shared index sets, VAR's scores, the schedule and the tuner's decisions."""
    leaders = c.leaders.state_dict()
    schedule = c.schedule.state_dict()
    ps = c.collectives.process_set
    return {"world_size": ps.size(), "rank": ps.rank(), "names": c.names, "selection": c.selection,
            "step": c.step, "epoch": schedule["epoch"], "residuals": c.residuals.state_dict(),
            "velocities": c.momentum.state_dict(), "index_sets": c.index_sets.state_dict(),
            "score": leaders.get("score", 0.0), "scores": leaders.get("scores"),
            "ratio": schedule["ratio"], "ratio_change": schedule["ratio_change"],
            "tuner": None if c.tuner is None else c.tuner.state_dict()}


def check_loadable(c, state):
    """ValueError if ``state`` belongs to another world size or model."""
    size = c.collectives.process_set.size()
    if state["world_size"] != size:
        raise ValueError(f"checkpoint holds the residuals of {state['world_size']} ranks, this job "
                         f"has {size}; residuals are per rank and cannot be re-split "
                         "(start the optimizer fresh, or resume with the same number of ranks)")
    if state["names"] != c.names or state["selection"] != c.selection:
        raise ValueError("checkpoint was written for a model with other parameters "
                         f"({len(state['names'])} vs {len(c.names)} named tensors) or another "
                         f"selection ({state['selection']!r} vs {c.selection!r})")


def load_coordinator_state(c, state):
    """Restore what ``coordinator_state`` returned on this rank."""
    check_loadable(c, state)
    c.step = state["step"]
    c.schedule.load_state_dict(state)
    c.residuals.load_state_dict(state["residuals"])
    c.momentum.load_state_dict(state["velocities"])
    c.index_sets.load_state_dict(state["index_sets"])
    c.leaders.load_state_dict(state)
    if c.tuner is not None and state.get("tuner") is not None:
        c.tuner.load_state_dict(state["tuner"])
