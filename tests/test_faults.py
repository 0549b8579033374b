"""Faults, measured: a rank SIGKILLed mid-step, a straggler, damaged checkpoints, checkpoints of another
job, model or ratio; and Horovod on mpi4py communicators.

Killed ranks: the dying rank writes the time just before SIGKILLing itself; every other rank's process
must be gone within EXIT_LIMIT_S of it, and the launcher must have returned non-zero. The seconds are
printed (pytest -s) and recorded as test properties.
"""
import os
import statistics
import struct
import time
import zipfile

import psutil
import pytest
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk.step.checkpoint import CheckpointError
from testbed.launch import JobFailed
from testbed.pytest_jobs import OutOf, job

from conftest import assert_identical_across_ranks

EXIT_LIMIT_S = 60          # every rank gone within this many seconds of one rank's death


# -- a rank SIGKILLed mid-step ---------------------------------------------------------------------

def _alive(pid, killed_at):
    """Whether ``pid`` is still a running rank of our job: not a zombie, and not a pid reused by a
    process started after the kill."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= killed_at
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _wait_gone(pids, killed_at, until):
    """time.time() when none of ``pids`` runs any more; polls until ``until`` at the latest."""
    while any(_alive(pid, killed_at) for pid in pids) and time.time() < until:
        time.sleep(0.1)
    return time.time()


def read_killed_job(results, killed):
    """Read a job of tests/workers/faults.py whose rank 1 SIGKILLed itself; returns (seconds from the
    kill to the launcher's return, seconds to the last rank gone, JobFailed)."""
    with pytest.raises(JobFailed) as failed:
        results(killed)
    run = results.run(killed)
    killed_at = float((run.folder / "killed_at").read_text())
    pids = [int((run.folder / f"pid{r}").read_text()) for r in range(killed.np)]
    gone = _wait_gone(pids, killed_at, until=killed_at + EXIT_LIMIT_S + 10)
    assert not any(_alive(pid, killed_at) for pid in pids), "a rank outlived the job"
    assert not any((run.folder / f"rank{r}.pt").exists() for r in range(killed.np)), "a rank finished training"
    return run.ended - killed_at, gone - killed_at, failed.value


# Each front door under one launcher and each launcher with one front door: the launcher, not the door,
# ends the survivors (docs/faults.md), and all four pairs ended within 0.5-1.3 s when each ran. The
# other two pairs run across hosts (tests/test_multihost.py).
KILLED = [("gloo", "hvd_topk"), ("mpi", "topkef")]


@pytest.mark.slow
@pytest.mark.parametrize("killed", [
    # a launch of its own: the test times the launcher's return after the kill
    job(3, "faults.py", "--mode", mode, "--steps", 40, "--kill-rank", 1, "--kill-step", 5, backend=backend,
        timeout=180, alone=True, fails=True) for backend, mode in KILLED], ids=[f"{m}-{b}" for b, m in KILLED])
def test_sigkilled_rank_ends_every_rank(results, record_property, killed):
    """3 ranks, rank 1 SIGKILLed between backward and step() at step 5 of 40: the job fails and the
    other ranks (inside the step's collectives) are gone within 60 s."""
    backend, mode = killed.backend, killed.args[1]
    returned_s, gone_s, failed = read_killed_job(results, killed)
    print(f"\n{backend}/{mode}: launcher returned {returned_s:.1f} s after the SIGKILL, "
          f"last rank gone after {gone_s:.1f} s")
    record_property("launcher_returned_s", round(returned_s, 2))
    record_property("last_rank_gone_s", round(gone_s, 2))
    assert "timed out" not in str(failed).splitlines()[0], "the surviving ranks hung"
    assert returned_s <= EXIT_LIMIT_S and gone_s <= EXIT_LIMIT_S


# -- one rank 10x slower ---------------------------------------------------------------------------

def residual_bound(grad_norms, momentum=0.9):
    """Per step, the most the residual norm can be: error feedback only keeps what was not sent, so
    each step adds at most the norm of that step's momentum-corrected gradient u (DGC), and
    ||u_t|| <= momentum * ||u_{t-1}|| + ||g_t||. A residual above it was poisoned (counted twice,
    never cleared of what was sent)."""
    u = v = 0.0
    bound = []
    for g in grad_norms:
        u = momentum * u + g
        v += u
        bound.append(v)
    return bound


STRAGGLER = ["--ratio", 0.01, "--steps", 30, "--work", 0.01]
STRAGGLER_JOBS = (job(2, "faults.py", *STRAGGLER), job(2, "faults.py", *STRAGGLER, "--slow-rank", 1, "--slow-factor", 10))


@pytest.mark.slow
@pytest.mark.jobs(STRAGGLER_JOBS)
def test_straggler_completes_with_bounded_residuals(results, record_property):
    """2 ranks, ratio 0.01, 30 steps; rank 1 takes 10x as long per step. The job completes with the
    same parameters and residuals as without the straggler: slowness changes timing, never results."""
    even, slow = map(results, STRAGGLER_JOBS)
    assert_identical_across_ranks(slow)
    for r in range(2):
        for name, value in even[r]["params"].items():
            assert torch.equal(slow[r]["params"][name], value), f"rank {r} {name} differs with a straggler"
        assert slow[r]["residual_norms"] == even[r]["residual_norms"]
        bound = residual_bound(slow[r]["grad_norms"])
        assert all(n <= b for n, b in zip(slow[r]["residual_norms"], bound)), (slow[r]["residual_norms"], bound)
    medians = {kind: [statistics.median(res["step_s"][1:]) for res in job]
               for kind, job in (("even", even), ("straggler", slow))}
    residuals = {kind: [max(res["residual_norms"]) for res in job]
                 for kind, job in (("even", even), ("straggler", slow))}
    print(f"\nmedian step seconds per rank: {medians}; max residual norm per rank: {residuals}; max "
          f"gradient norm per rank: {[max(res['grad_norms']) for res in slow]}")
    record_property("max_residual_norm", residuals)
    record_property("median_step_s", medians)
    # every rank's step takes the straggler's time: the fast rank waits inside the step
    assert all(m >= 0.9 * slow[1]["work_s"] for m in medians["straggler"]), medians


# -- damaged checkpoints ---------------------------------------------------------------------------

def make(hvd, width=16, ratio=0.01, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopKEF(ratio=ratio, min_numel=16), **kw)
    return model, opt


def train(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()


def snapshot(model, opt):
    """Copies of everything a load could change: parameters and the optimizer's whole state."""
    return {"params": {n: q.detach().clone() for n, q in model.named_parameters()},
            "residuals": {k: None if v is None else v.clone() for k, v in opt._hvd_topk.residuals.residuals.items()},
            "step": opt._hvd_topk.step, "inner": {id(q): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                                                  for q, s in opt.state.items()}}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_same(a[key], b[key])
        elif torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.fixture
def saved(hvd, tmp_path):
    """A checkpoint after 3 steps (world size 1); returns its file."""
    model, opt = make(hvd)
    train(model, opt, 3)
    return hvd_topk.save_checkpoint(str(tmp_path / "c.pt"), model, opt, step=3)


def truncate(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])


def flip_middle(path):
    """Flip 16 bytes in the middle of the largest tensor's data: torch.load alone would load it."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(open(path, "rb").read())
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    middle = record.header_offset + 30 + name_len + extra_len + record.file_size // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    with open(path, "wb") as f:
        f.write(data)


def not_an_archive(path):
    with open(path, "wb") as f:
        f.write(os.urandom(4096))


def not_ours(path):
    torch.save({"model": {}, "epoch": 3}, path)


def not_dicts(path):
    torch.save(dict.fromkeys(["world_size", "rank", "model", "optimizer", "extra"], 1), path)


@pytest.mark.parametrize("damage,match", [
    (truncate, "truncated or corrupted checkpoint file"),
    (flip_middle, "corrupted checkpoint file"),
    (not_an_archive, "truncated or corrupted checkpoint file"),
    (not_ours, "not a checkpoint written by hvd_topk.save_checkpoint"),
    (not_dicts, r"not a checkpoint written by hvd_topk.save_checkpoint \(missing model as a dict"),
])
def test_damaged_checkpoint_is_refused_and_nothing_changes(hvd, saved, damage, match):
    """A damaged file: CheckpointError (a ValueError) naming the file; the file, the model and the
    optimizer are untouched. Flipped bytes in tensor data load silently with torch.load alone."""
    damage(saved)
    before_bytes = open(saved, "rb").read()
    model, opt = make(hvd)
    train(model, opt, 2, seed=1)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match) as error:
        hvd_topk.load_checkpoint(saved[:-len(".rank0-of-1")], model, opt)
    assert isinstance(error.value, ValueError) and saved in str(error.value)
    assert open(saved, "rb").read() == before_bytes
    assert_same(snapshot(model, opt), before)
    train(model, opt, 1)                  # still usable


# -- checkpoints of another job, model or ratio ---------------------------------------------------

def rewrite(path, change):
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


@pytest.mark.parametrize("change,match", [
    (lambda s: s.update(world_size=2, rank=1), "written by rank 1 of 2, this is rank 0 of 1"),
    (lambda s: s["optimizer"]["hvd_topk"].update(world_size=2), "holds the residuals of 2 ranks"),
])
def test_checkpoint_of_another_world_size_is_refused(hvd, saved, change, match):
    rewrite(saved, change)
    model, opt = make(hvd)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match):
        hvd_topk.load_checkpoint(saved[:-len(".rank0-of-1")], model, opt)
    assert_same(snapshot(model, opt), before)


@pytest.mark.parametrize("kw,match", [
    ({"width": 32}, r"another model: 0.weight has shape \(16, 8\) there, \(32, 8\) here"),
    ({"selection": "layerwise"}, "another selection"),
])
def test_checkpoint_of_another_model_is_refused(hvd, saved, kw, match):
    """Another shape, or the same model under another selection: refused before anything is loaded
    (the model's parameters would otherwise be loaded before the optimizer refuses)."""
    model, opt = make(hvd, **kw)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match):
        hvd_topk.load_checkpoint(saved[:-len(".rank0-of-1")], model, opt)
    assert_same(snapshot(model, opt), before)


def test_checkpoint_of_another_ratio_loads_and_the_new_ratio_applies(hvd, saved):
    """Policy: residuals and velocities are loaded as they are; the optimizer's own ratio applies
    from the next step. With the same configured ratio, the ratio in use is restored."""
    state = torch.load(saved, weights_only=False)["optimizer"]["hvd_topk"]
    model, opt = make(hvd, ratio=0.05)
    assert hvd_topk.load_checkpoint(saved[:-len(".rank0-of-1")], model, opt) == {"step": 3}
    assert_same(snapshot(model, opt)["residuals"], state["residuals"])
    assert opt.stats()["ratio"] == 0.05 and opt._hvd_topk.step == 3
    train(model, opt, 1)
    assert opt.stats()["density"] == 0.05
    assert all(torch.isfinite(q).all() for q in model.parameters())

    rewrite(saved, lambda s: s["optimizer"]["hvd_topk"].update(ratio=0.02))   # as the adaptive ratio does
    model, opt = make(hvd, ratio=0.01)
    hvd_topk.load_checkpoint(saved[:-len(".rank0-of-1")], model, opt)
    assert opt.stats()["ratio"] == 0.02


SAVED_AT_RATIO_001 = job(2, "opt_train.py", "--steps", 10, "--ratio", 0.01, "--save-at", 4)
RESUMED_AT_RATIO_005 = job(2, "opt_train.py", "--steps", 10, "--ratio", 0.05, "--resume",
                           OutOf(SAVED_AT_RATIO_001, "ckpt.pt"))


@pytest.mark.jobs(RESUMED_AT_RATIO_005)
def test_resume_with_another_ratio_keeps_ranks_identical(results):
    resumed = results(RESUMED_AT_RATIO_005)
    assert_identical_across_ranks(resumed)
    assert [s["ratio"] for s in resumed[0]["stats"]] == [0.05] * 5
    assert resumed[0]["state"]["step"] == 10


SAVED_TO_DAMAGE = job(2, "opt_train.py", "--steps", 10, "--save-at", 4)    # no other test reads its files
# a launch of its own, after the test damaged the checkpoint
RESUMED_FROM_DAMAGED = job(2, "opt_train.py", "--steps", 10, "--resume", OutOf(SAVED_TO_DAMAGE, "ckpt.pt"),
                           timeout=90, alone=True, fails=True)


@pytest.mark.slow
@pytest.mark.jobs(RESUMED_FROM_DAMAGED)
def test_damaged_checkpoint_on_one_rank_fails_every_rank(results, record_property):
    """Rank 1's file corrupted: every rank raises at once (the ranks agree before loading), instead of
    rank 0 waiting in the next collective for a rank that died."""
    damaged = results.path(SAVED_TO_DAMAGE, "ckpt.pt.rank1-of-2")
    flip_middle(damaged)
    before = damaged.read_bytes()
    with pytest.raises(JobFailed) as failed:
        results(RESUMED_FROM_DAMAGED)
    elapsed = results.run(RESUMED_FROM_DAMAGED).seconds
    record_property("job_failed_after_s", round(elapsed, 1))
    assert "timed out" not in str(failed.value).splitlines()[0]
    assert f"{damaged}: corrupted checkpoint file" in failed.value.output
    assert damaged.read_bytes() == before
    assert elapsed < 60


# -- mpi4py communicators --------------------------------------------------------------------------

def assert_trained_like_dense(results):
    """Within one communicator: every run identical on its ranks; ratio 1.0 equals dense Horovod
    (TopKEF exactly; hvd_topk.DistributedOptimizer to rounding); ratio 0.05 compresses."""
    for kind in results[0]["runs"]:
        assert_identical_across_ranks([{"params": res["runs"][kind]} for res in results])
    runs = results[0]["runs"]
    for name, dense in runs["dense"].items():
        assert torch.equal(runs["topkef_ratio1"][name], dense), name
        torch.testing.assert_close(runs["hvd_topk_ratio1"][name], dense, rtol=1e-10, atol=1e-12)
    for kind in ("topkef", "hvd_topk"):
        assert not torch.equal(runs[kind]["0.weight"], runs["dense"]["0.weight"]), kind


# launches of their own: each initialises Horovod on its communicator and shuts it down
COMM_WORLD = job(2, "mpi4py_comm.py", backend="mpi", timeout=180, alone=True)
SPLIT_COMM = job(4, "mpi4py_comm.py", "--split", backend="mpi", timeout=300, alone=True)


@pytest.mark.slow
@pytest.mark.jobs(COMM_WORLD)
def test_mpi4py_comm_world(results):
    """hvd.init(comm=MPI.COMM_WORLD) under mpirun, 2 ranks."""
    ranks = results(COMM_WORLD)
    assert [(res["hvd_rank"], res["hvd_size"]) for res in ranks] == [(0, 2), (1, 2)]
    assert_trained_like_dense(ranks)


@pytest.mark.slow
@pytest.mark.jobs(SPLIT_COMM)
def test_mpi4py_split_communicators_train_independently(results):
    """4 ranks, COMM_WORLD split by rank % 2: hvd.init(comm=half); each half is a 2-rank Horovod job."""
    ranks = results(SPLIT_COMM)
    assert [(res["color"], res["hvd_rank"], res["hvd_size"]) for res in ranks] == \
        [(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)]
    for color in (0, 1):
        assert_trained_like_dense([res for res in ranks if res["color"] == color])
    # the halves averaged different data: had Horovod used COMM_WORLD, all four would be identical
    assert not torch.equal(ranks[0]["runs"]["dense"]["0.weight"], ranks[1]["runs"]["dense"]["0.weight"])
