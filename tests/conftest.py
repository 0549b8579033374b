import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


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
