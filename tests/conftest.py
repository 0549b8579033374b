import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def assert_identical_across_ranks(results):
    """Bit-identical parameters on every rank, and training that did not blow up (a stronger check
    than identity alone: diverged runs can be identical too)."""
    for name, value in results[0]["params"].items():
        assert torch.isfinite(value).all() and value.abs().max() < 100, f"{name} diverged"
    for r, res in enumerate(results[1:], start=1):
        for name, value in results[0]["params"].items():
            assert torch.equal(value, res["params"][name]), f"rank {r} differs from rank 0 in {name}"


def assert_skipped_everywhere(results, step):
    """The job's --overflow-step ``step`` was skipped on every rank with every state, residual and
    parameter unchanged (the worker's snapshot), and the next step was not; returns the skip records."""
    assert_identical_across_ranks(results)
    skips = []
    for res in results:
        (skip,) = res["skipped"]
        assert skip["had_residuals"] and skip["state_unchanged"] and skip["params_unchanged"]
        assert res["stats"][step]["skipped"] and not res["stats"][step + 1]["skipped"]
        skips.append(skip)
    return skips


def assert_resume_bit_identical(run_ranks, tmp_path, args, save_at):
    """2 ranks: a run saved after step ``save_at`` and resumed ends bit-identical to one straight run."""
    full = run_ranks(2, "opt_train.py", *args)
    first = tmp_path / "first"
    run_ranks(2, "opt_train.py", *args, "--save-at", save_at, out=first)
    resumed = run_ranks(2, "opt_train.py", *args, "--resume", str(first / "ckpt.pt"))
    for r in range(2):
        for name, value in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][name], value), f"rank {r} {name} differs after resume"


@pytest.fixture(scope="session")
def hvd():
    """Horovod initialised in this process (world size 1: collectives are local)."""
    import horovod.torch as hvd
    hvd.init()
    return hvd


@pytest.fixture
def run_ranks(tmp_path):
    """Run a test worker on N real ranks; returns the per-rank result dicts saved by the worker."""
    from bench.infra.launch import run_job

    def run(np, worker, *args, backend="gloo", timeout=240, prefix=(), out=None):
        out = out or tmp_path / f"job{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        argv = [sys.executable, os.path.join(WORKERS, worker), "--out", str(out), *map(str, args)]
        run_job(np, argv, backend=backend, timeout=timeout, prefix=prefix, cwd=ROOT)
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(np)]

    return run
