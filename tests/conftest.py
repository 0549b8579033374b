"""What the tests in tests/ share: assertion helpers and the ``hvd`` fixture. The multi-rank jobs they
declare (``job``, ``OutOf``, ``Out``, the ``results`` fixture) are the plugin testbed/pytest_jobs.py,
loaded for every test folder by the root conftest.py; ``job`` and ``OutOf`` are also importable from
here."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
if ROOT not in sys.path:        # imported outside pytest too: scripts/draw_layers.py reads test_layout.py
    sys.path.insert(1, ROOT)

from testbed.pytest_jobs import Out, OutOf, job  # noqa: E402,F401  (imported from here by the tests)


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


def resume_jobs(args, save_at):
    """Three 2-rank opt_train.py jobs: straight through, saved after step ``save_at``, resumed from that
    save (see ``assert_resume_bit_identical``)."""
    first = job(2, "opt_train.py", *args, "--save-at", save_at)
    return job(2, "opt_train.py", *args), first, job(2, "opt_train.py", *args, "--resume", OutOf(first, "ckpt.pt"))


def assert_resume_bit_identical(results, jobs):
    """The run saved and resumed (``resume_jobs``) ends bit-identical to the one straight run."""
    full, _, resumed = map(results, jobs)
    for r in range(2):
        for name, value in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][name], value), f"rank {r} {name} differs after resume"


@pytest.fixture(scope="session")
def hvd():
    """Horovod initialised in this process (world size 1: collectives are local)."""
    import horovod.torch as hvd
    hvd.init()
    return hvd
