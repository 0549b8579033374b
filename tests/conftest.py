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


@pytest.fixture(scope="session")
def hvd():
    """Horovod initialised in this process (world size 1: collectives are local)."""
    import horovod.torch as hvd
    hvd.init()
    return hvd


@pytest.fixture
def run_ranks(tmp_path):
    """Run a test worker on N real ranks; returns the per-rank result dicts saved by the worker."""
    from hvd_topk.launch import run_job

    def run(np, worker, *args, backend="gloo", timeout=240, prefix=(), out=None):
        out = out or tmp_path / f"job{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        argv = [sys.executable, os.path.join(WORKERS, worker), "--out", str(out), *map(str, args)]
        run_job(np, argv, backend=backend, timeout=timeout, prefix=prefix, cwd=ROOT)
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(np)]

    return run
