"""One checkpoint file per rank, so that every rank's residuals and momentum survive a restart.

The usual "rank 0 saves the optimizer" habit throws the other ranks' error-feedback state away.
"""
import contextlib
import os
import zipfile

import torch
from horovod.torch import mpi_ops

from .coordinator import split_bucket

__all__ = ["CheckpointError", "rank_path", "save_checkpoint", "load_checkpoint"]

# What save_checkpoint writes; a file without these keys was written by something else.
REQUIRED_KEYS = ("world_size", "rank", "model", "optimizer", "extra")
STATE_KEY = "hvd_topk"          # hvd_topk.DistributedOptimizer's per-rank state inside its state_dict


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: truncated, corrupted, unreadable, not written by
    ``save_checkpoint``, or written by another job (world size, rank) or for another model."""


def rank_path(path, rank=None, size=None):
    """This rank's file: ``path`` with ``{rank}`` filled in, or ``<path>.rank<r>-of-<size>``."""
    rank = mpi_ops.rank() if rank is None else rank
    size = mpi_ops.size() if size is None else size
    return path.format(rank=rank, size=size) if "{rank}" in path else f"{path}.rank{rank}-of-{size}"


def save_checkpoint(path, model, optimizer, **extra):
    """Write this rank's model, optimizer (with hvd_topk residuals) and ``extra`` to its own file.

    Every rank must call it. The file is written to a temporary name, flushed to disk and renamed, so
    a job killed mid-write leaves the previous checkpoint intact. Every record of the file carries a
    CRC-32, which ``load_checkpoint`` verifies.

    Args:
        path: file path (``{rank}`` may appear in it; otherwise ``.rank<r>-of-<size>`` is appended).
        model: the torch module.
        optimizer: an ``hvd_topk.DistributedOptimizer`` (or any optimizer).
        **extra: anything picklable to restore with it (epoch, step, scheduler state, RNG state ...).

    Returns:
        The path written.

    Example (in a training script; writes ``ckpt/run1.pt.rank<r>-of-<n>``)::

        hvd_topk.save_checkpoint("ckpt/run1.pt", model, opt, epoch=epoch)
    """
    target = rank_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    tmp = f"{target}.tmp"
    state = {"world_size": mpi_ops.size(), "rank": mpi_ops.rank(), "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "extra": extra}
    with _crc32_on(), open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def load_checkpoint(path, model, optimizer):
    """Restore what ``save_checkpoint`` wrote for this rank; returns its ``extra`` dict.

    Every rank must call it: the ranks agree (one small allgather) that every rank's file is readable
    and fits before any rank loads anything, so a damaged file on one rank fails the job on every rank
    at once, with the model and optimizer untouched everywhere and no file written.

    Policies:
        - another world size: refused (residuals are per rank and are never silently re-split).
        - another model (parameter names or shapes, parameter groups, the optimizer's named tensors or
          selection): refused.
        - another ``TopKEF(ratio=...)``: allowed. The residuals and velocities are still valid
          error-feedback state; the optimizer's new ratio applies from the next step (the AR-Topk
          index set prepared for the old size is replaced by a spread set of the new size, identical
          on every rank). With the same configured ratio, the ratio in use is restored (the adaptive
          ratio may have moved it). A stock-Horovod ``TopKEF``'s own ``load_state_dict`` keeps the
          compressor's ratio too.

    Raises:
        FileNotFoundError: this rank's file is missing.
        CheckpointError (a ValueError): this rank's file is truncated, corrupted (a record fails its
            CRC-32 check) or unreadable, was not written by ``save_checkpoint``, was written by a job
            with another number of ranks, or for another model; or another rank's file is one of those
            (the message names the ranks). The message names the file.
    """
    target = rank_path(path)
    try:
        state, error = _read_checkpoint(target), None
        _check_fits(target, state, model, optimizer)
    except Exception as e:          # any failure: the other ranks must hear of it, not wait for us
        state, error = None, e
    failed = _failed_ranks(error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{target} was not loaded: the checkpoint of rank(s) "
                              f"{', '.join(map(str, failed))} of {mpi_ops.size()} could not be loaded (see "
                              "their error); nothing was loaded on any rank")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["extra"]


def _read_checkpoint(target):
    """The dict ``save_checkpoint`` wrote to ``target``, after checking the file's integrity."""
    if not os.path.exists(target):
        raise FileNotFoundError(f"no checkpoint for rank {mpi_ops.rank()} of {mpi_ops.size()}: {target} "
                                "(was it written with another number of ranks?)")
    # torch.load does not verify the archive's CRC-32s: flipped bytes in tensor data would load as
    # silently wrong weights or residuals. zipfile checks every record.
    try:
        with zipfile.ZipFile(target) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{target}: truncated or corrupted checkpoint file (not a complete archive: "
                              f"{e}); the file was left as it is") from e
    if bad is not None:
        raise CheckpointError(f"{target}: corrupted checkpoint file (record {bad} fails its CRC-32 "
                              "check); the file was left as it is")
    try:
        state = torch.load(target, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"{target}: unreadable checkpoint file ({type(e).__name__}: {e}); "
                              "the file was left as it is") from e
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    missing += [f"{k} as a dict" for k in ("model", "optimizer", "extra")
                if not missing and not isinstance(state[k], dict)]
    if missing:
        raise CheckpointError(f"{target}: not a checkpoint written by hvd_topk.save_checkpoint "
                              f"(missing {', '.join(missing)})")
    return state


def _check_fits(target, state, model, optimizer):
    """CheckpointError unless ``state`` loads into ``model`` and ``optimizer`` as a whole: checked
    before anything is loaded, so a refused checkpoint leaves both untouched."""
    if state["world_size"] != mpi_ops.size() or state["rank"] != mpi_ops.rank():
        raise CheckpointError(f"{target} was written by rank {state['rank']} of {state['world_size']}, "
                              f"this is rank {mpi_ops.rank()} of {mpi_ops.size()}")
    mine, theirs = model.state_dict(), state["model"]
    if set(mine) != set(theirs):
        raise CheckpointError(f"{target} was written for another model: not in this model: "
                              f"{sorted(set(theirs) - set(mine))[:5]}, missing from the checkpoint: "
                              f"{sorted(set(mine) - set(theirs))[:5]}")
    for name, value in mine.items():
        if getattr(value, "shape", None) != getattr(theirs[name], "shape", None):
            raise CheckpointError(f"{target} was written for another model: {name} has shape "
                                  f"{tuple(theirs[name].shape)} there, {tuple(value.shape)} here")
    groups = [len(g["params"]) for g in state["optimizer"].get("param_groups", [])]
    if groups != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(f"{target} was written for an optimizer with other parameter groups "
                              f"(sizes {groups}, here {[len(g['params']) for g in optimizer.param_groups]})")
    coordinator = getattr(optimizer, "_hvd_topk", None)
    if coordinator is not None:
        ours = state["optimizer"].get(STATE_KEY)
        if ours is None:
            raise CheckpointError(f"{target} holds no hvd_topk state (residuals, momentum): it was not "
                                  "saved from an hvd_topk.DistributedOptimizer")
        try:
            check_loadable(coordinator, ours)
        except ValueError as e:
            raise CheckpointError(f"{target}: {e}") from e


def _failed_ranks(failed):
    """The ranks on which ``failed`` is true (every rank calls it: one allgather)."""
    if mpi_ops.size() == 1:
        return [0] if failed else []
    flags = mpi_ops.allgather(torch.tensor([int(failed)], dtype=torch.int32), name="hvd_topk.load_checkpoint")
    return [r for r, f in enumerate(flags.tolist()) if f]


@contextlib.contextmanager
def _crc32_on():
    """Write CRC-32s even if the user switched them off (torch.serialization.set_crc32_options)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    if get is None or get():
        yield
        return
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(False)


# -- the optimizer's per-rank state, inside ``optimizer.state_dict()['hvd_topk']`` ----------------------

def coordinator_state(c):
    """This rank's hvd_topk state of one optimizer (a ``StepCoordinator``), between steps: residuals, the
    row-sparse tensors selected alone (``bucket.GlobalBucket``), velocities, the shared index sets, VAR's
    scores, the schedule, the tuner's decisions, split_reduce's index regions and low rank's warm-start
    Q's (per transport that keeps state: 'lowrank', 'hierarchical')."""
    leaders = c.leaders.state_dict()
    schedule = c.schedule.state_dict()
    ps = c.collectives.process_set
    return {"world_size": ps.size(), "rank": ps.rank(), "names": c.names, "selection": c.selection,
            "step": c.step, "epoch": schedule["epoch"], "residuals": c.residuals.state_dict(),
            "velocities": c.momentum.state_dict(), "index_sets": c.index_sets.state_dict(),
            "score": leaders.get("score", 0.0), "scores": leaders.get("scores"),
            "ratio": schedule["ratio"], "ratio_change": schedule["ratio_change"],
            "configured_ratio": schedule["configured_ratio"],
            "tuner": None if c.tuner is None else c.tuner.state_dict(),
            "regions": c.transports["split_reduce"].regions.state_dict(),
            "row_sparse": None if c.bucket.alone is None else sorted(c.bucket.alone),
            "transports": _transport_states(c)}


def _transport_states(c):
    """name -> state_dict() of the transports that keep state between steps (low rank's Q's)."""
    return {name: t.state_dict() for name, t in c.transports.items() if hasattr(t, "state_dict")}


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
    for name, saved in state.get("transports", {}).items():
        mine = _transport_states(c).get(name)
        if mine is not None and saved["rank"] != mine["rank"]:
            raise ValueError(f"checkpoint holds the warm-start Q's of PowerSGD(rank={saved['rank']}) ({name!r}), "
                             f"this optimizer's compression has rank={mine['rank']}: resume with the same rank")


def load_coordinator_state(c, state, check=True):
    """Restore what ``coordinator_state`` returned on this rank (``check=False``: from an elastic commit,
    whatever the world size now: see ``hvd_topk.step.elastic``)."""
    if check:
        check_loadable(c, state)
    c.step = state["step"]
    c.schedule.load_state_dict(state)
    c.residuals.load_state_dict(state["residuals"])
    if c.selection == "global":           # the residuals' layout follows the saved split; without one
        c.bucket.forget()                 # (an older checkpoint: all pooled) it is measured at the next step
        row_sparse = state.get("row_sparse")
        c.bucket.alone = None if row_sparse is None else set(row_sparse)
        split_bucket(c, c.bucket.alone or set())
    c.momentum.load_state_dict(state["velocities"])
    c.index_sets.load_state_dict(state["index_sets"])
    c.leaders.load_state_dict(state)
    if c.tuner is not None and state.get("tuner") is not None:
        c.tuner.load_state_dict(state["tuner"])
    c.transports["split_reduce"].forget()
    c.transports["split_reduce"].regions.load_state_dict(state.get("regions"))
    for name, saved in state.get("transports", {}).items():
        if name in c.transports and hasattr(c.transports[name], "load_state_dict"):
            c.transports[name].load_state_dict(saved)
