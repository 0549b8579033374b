"""Horovod's optimizer contract with ``compression=`` swapped for ours (``tests/workers/contract.py``):
sparse embeddings, ranks that use different parameters, two optimizers in turn, a second synchronize(),
a momentum scheduler. At ratio 1.0 every column gives dense Horovod's parameters (float64); compressed,
the ranks stay identical; the class form without names works where positions are stable and otherwise
fails on every rank within seconds, naming the fix."""
import pytest
import torch

from testbed.launch import JobFailed
from testbed.pytest_jobs import job

from conftest import assert_identical_across_ranks

SCENARIOS = {"sparse": [], "sparse_as_dense": ["--sparse-as-dense"], "uneven": [], "gan": [],
             "sync_twice": [], "schedule": []}


def contract_job(scenario, column, *extra, **settings):
    name = "sparse" if scenario == "sparse_as_dense" else scenario
    # the class form keeps its state in the class, for the life of the process: a job of its own
    return job(2, "contract.py", "--scenario", name, "--column", column, *SCENARIOS[scenario], *extra,
               alone=column == "topkef_class", **settings)


@pytest.mark.parametrize("scenario,jobs", [
    (scenario, [contract_job(scenario, column, *([] if column == "dense" else ["--ratio", 1.0]))
                for column in ("dense", "topkef", "hvd_topk")]) for scenario in SCENARIOS], ids=list(SCENARIOS))
def test_ratio_one_gives_dense_horovods_parameters(results, scenario, jobs):
    dense, *columns = map(results, jobs)
    for column, ours in zip(("topkef", "hvd_topk"), columns):
        assert_identical_across_ranks(ours)
        for name, value in dense[0]["params"].items():
            torch.testing.assert_close(ours[0]["params"][name], value, rtol=0, atol=1e-12,
                                       msg=f"{column}: {name} differs from dense Horovod")
        if scenario == "schedule":           # the user's momentum, as the scheduler set it, every step
            assert ours[0]["momenta"] == dense[0]["momenta"], column


@pytest.mark.parametrize("jobs", [[contract_job(scenario, column, "--ratio", 0.1) for column in ("topkef", "hvd_topk")]
                                  for scenario in SCENARIOS], ids=list(SCENARIOS))
def test_compressed_keeps_ranks_identical(results, jobs):
    for ours in map(results, jobs):
        assert_identical_across_ranks(ours)


# sync_twice: Horovod compresses every gradient again, in a per-process order, but they are the very
# tensors of the step before, which keep their slots (hvd_topk/step/gradient_keys.py)
# Each class-form job is a launch of its own (about 10 s): the fast loop keeps one of each test.
@pytest.mark.parametrize("class_job", [pytest.param(contract_job(scenario, "topkef_class"),
                                                    marks=[] if scenario == "sync_twice" else [pytest.mark.slow])
                                       for scenario in ["sparse", "sparse_as_dense", "schedule", "sync_twice"]],
                         ids=["sparse", "sparse_as_dense", "schedule", "sync_twice"])
def test_class_form_works_where_positions_are_stable(results, class_job):
    assert_identical_across_ranks(results(class_job))


@pytest.mark.parametrize("refused", [pytest.param(contract_job(scenario, "topkef_class", timeout=120, fails=True),
                                                  marks=[] if scenario == "uneven" else [pytest.mark.slow])
                                     for scenario in ["uneven", "gan"]], ids=["uneven", "gan"])
def test_class_form_fails_on_every_rank_naming_the_fix(results, refused):
    """compression=TopKEF cannot know which parameter a gradient is; where positions change, every
    rank raises within seconds, naming TopKEF(named_parameters=...)."""
    with pytest.raises(JobFailed) as failed:
        results(refused)
    assert results.run(refused).seconds < 60
    for rank in (0, 1):
        lines = [line for line in failed.value.output.splitlines() if line.startswith(f"[{rank}]")]
        assert any("named_parameters=model.named_parameters()" in line for line in lines), f"rank {rank}"


PROCESS_SETS = {"dense": job(4, "process_sets.py", "--column", "dense"),
                "topkef": job(4, "process_sets.py", "--column", "topkef"),
                "hvd_topk": job(4, "process_sets.py", "--column", "hvd_topk"),
                "topkef sparse": job(4, "process_sets.py", "--column", "topkef", "--ratio", 0.1, "--leader", "star"),
                "hvd_topk sparse": job(4, "process_sets.py", "--column", "hvd_topk", "--ratio", 0.1, "--leader", "var")}


@pytest.mark.jobs(list(PROCESS_SETS.values()))
def test_process_sets_train_apart_and_ratio_one_is_dense(results):
    """Two process sets of 2 ranks each train their own model: within a set the ranks stay identical,
    ratio 1.0 gives stock Horovod's parameters in both columns, and the two sets differ. (In a shared
    launch a job's ``hvd.init(process_sets=...)`` binds its new ProcessSet objects to the sets the
    first job registered: the same ranks, so the same sets.)"""
    dense = results(PROCESS_SETS["dense"])
    for column in ("topkef", "hvd_topk"):
        ours = results(PROCESS_SETS[column])
        for r in range(4):
            for name, value in dense[r]["params"].items():
                torch.testing.assert_close(ours[r]["params"][name], value, rtol=0, atol=1e-12,
                                           msg=f"{column}, rank {r}: {name}")
        sparse = results(PROCESS_SETS[f"{column} sparse"])
        for pair in ((0, 1), (2, 3)):
            assert_identical_across_ranks([sparse[r] for r in pair])
        assert not torch.equal(sparse[0]["params"]["0.weight"], sparse[2]["params"]["0.weight"])
