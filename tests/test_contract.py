"""Horovod's optimizer contract with ``compression=`` swapped for ours (``tests/workers/contract.py``):
sparse embeddings, ranks that use different parameters, two optimizers in turn, a second synchronize(),
a momentum scheduler. At ratio 1.0 every column gives dense Horovod's parameters (float64); compressed,
the ranks stay identical; the class form without names works where positions are stable and otherwise
fails on every rank within seconds, naming the fix."""
import time

import pytest
import torch

from bench.infra.launch import JobFailed
from conftest import assert_identical_across_ranks

SCENARIOS = {"sparse": [], "sparse_as_dense": ["--sparse-as-dense"], "uneven": [], "gan": [],
             "sync_twice": [], "schedule": []}


def run(run_ranks, scenario, column, *extra):
    name = "sparse" if scenario == "sparse_as_dense" else scenario
    return run_ranks(2, "contract.py", "--scenario", name, "--column", column, *SCENARIOS[scenario], *extra,
                     timeout=120)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ratio_one_gives_dense_horovods_parameters(run_ranks, scenario):
    dense = run(run_ranks, scenario, "dense")
    for column in ("topkef", "hvd_topk"):
        ours = run(run_ranks, scenario, column, "--ratio", 1.0)
        assert_identical_across_ranks(ours)
        for name, value in dense[0]["params"].items():
            torch.testing.assert_close(ours[0]["params"][name], value, rtol=0, atol=1e-12,
                                       msg=f"{column}: {name} differs from dense Horovod")
        if scenario == "schedule":           # the user's momentum, as the scheduler set it, every step
            assert ours[0]["momenta"] == dense[0]["momenta"], column


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_compressed_keeps_ranks_identical(run_ranks, scenario):
    for column in ("topkef", "hvd_topk"):
        assert_identical_across_ranks(run(run_ranks, scenario, column, "--ratio", 0.1))


@pytest.mark.parametrize("scenario", ["sparse", "sparse_as_dense", "schedule"])
def test_class_form_works_where_positions_are_stable(run_ranks, scenario):
    assert_identical_across_ranks(run(run_ranks, scenario, "topkef_class"))


@pytest.mark.parametrize("scenario", ["uneven", "gan", "sync_twice"])
def test_class_form_fails_on_every_rank_naming_the_fix(run_ranks, scenario):
    """compression=TopKEF cannot know which parameter a gradient is; where positions change, every
    rank raises within seconds, naming TopKEF(named_parameters=...)."""
    t0 = time.monotonic()
    with pytest.raises(JobFailed) as failed:
        run(run_ranks, scenario, "topkef_class")
    assert time.monotonic() - t0 < 60
    for rank in (0, 1):
        lines = [line for line in failed.value.output.splitlines() if line.startswith(f"[{rank}]")]
        assert any("named_parameters=model.named_parameters()" in line for line in lines), f"rank {rank}"


def test_process_sets_train_apart_and_ratio_one_is_dense(run_ranks):
    """Two process sets of 2 ranks each train their own model: within a set the ranks stay identical,
    ratio 1.0 gives stock Horovod's parameters in both columns, and the two sets differ."""
    dense = run_ranks(4, "process_sets.py", "--column", "dense", timeout=180)
    for column in ("topkef", "hvd_topk"):
        ours = run_ranks(4, "process_sets.py", "--column", column, timeout=180)
        for r in range(4):
            for name, value in dense[r]["params"].items():
                torch.testing.assert_close(ours[r]["params"][name], value, rtol=0, atol=1e-12,
                                           msg=f"{column}, rank {r}: {name}")
        sparse = run_ranks(4, "process_sets.py", "--column", column, "--ratio", 0.1, "--leader", "var"
                           if column == "hvd_topk" else "star", timeout=180)
        for pair in ((0, 1), (2, 3)):
            assert_identical_across_ranks([sparse[r] for r in pair])
        assert not torch.equal(sparse[0]["params"]["0.weight"], sparse[2]["params"]["0.weight"])
