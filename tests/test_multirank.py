"""Real multi-rank jobs (horovodrun --gloo, mpirun) with TopKEF in stock hvd.DistributedOptimizer."""
import re

import pytest
import torch

from testbed.launch import JobFailed
from testbed.pytest_jobs import job

from conftest import assert_identical_across_ranks


def dense_and_ratio_one(*common):
    """Dense stock Horovod and TopKEF at ratio 1.0, both with the arguments ``common``."""
    return (job(2, "train.py", "--compression", "none", *common),
            job(2, "train.py", "--compression", "topkef", "--ratio", 1.0, *common))


@pytest.mark.parametrize("jobs", [dense_and_ratio_one("--steps", 15, "--op", op, "--bpps", bpps)
                                  for op, bpps in [("average", 1), ("sum", 1), ("average", 2)]],
                         ids=["average-1", "sum-1", "average-2"])
def test_ratio_one_reproduces_dense_horovod(results, jobs):
    dense, topk = map(results, jobs)
    for name, value in dense[0]["params"].items():
        torch.testing.assert_close(topk[0]["params"][name], value, rtol=1e-6, atol=1e-7)
    assert_identical_across_ranks(topk)


THREE_RANKS_100_STEPS = job(3, "train.py", "--steps", 100, "--ratio", 0.01, "--width", 128, "--min-numel", 1000)


@pytest.mark.slow
@pytest.mark.jobs(THREE_RANKS_100_STEPS)
def test_params_bit_identical_after_100_steps_three_ranks(results):
    ranks = results(THREE_RANKS_100_STEPS)
    assert_identical_across_ranks(ranks)
    # zero_grad() set every grad to None each step (checked in the worker), yet the residuals of the
    # weights (two 128x128 layers share a shape) survived; the biases (< min_numel) went dense.
    for res in ranks:
        shapes = sorted(tuple(v.shape) for v in res["residuals"].values())
        assert shapes == [(4096,), (16384,), (16384,)]
    # Sparse training really happened: the residuals hold mass on every rank, and differ between ranks.
    norms = [sum(float(v.norm()) for v in res["residuals"].values() if v is not None) for res in ranks]
    assert all(n > 0 for n in norms)
    assert len({round(n, 6) for n in norms}) == 3


@pytest.mark.slow
@pytest.mark.parametrize("gloo_job", [
    job(2, "train.py", "--steps", 200, "--ratio", 0.01, *extra, backend="gloo")
    for extra in ([], ["--sync-indices"])], ids=["stale-indices", "sync-indices"])
def test_params_bit_identical_after_200_steps_horovodrun_gloo(results, gloo_job):
    """The other tests' jobs run under mpirun by default (testbed/pytest_jobs.py): these long runs keep
    Horovod's Gloo data path, as horovodrun launches it, under test."""
    assert_identical_across_ranks(results(gloo_job))


GROUPS_THREE_RANKS = job(3, "train.py", "--steps", 60, "--ratio", 0.02, "--width", 128, "--groups", 2)
GROUPS_RATIO_ONE = dense_and_ratio_one("--steps", 15, "--groups", 1)


@pytest.mark.jobs(GROUPS_THREE_RANKS, GROUPS_RATIO_ONE)
def test_horovod_groups_keep_ranks_identical_and_ratio_one_dense(results):
    """TopKEF under stock Horovod's ``groups``: Horovod compresses a group's gradients together and
    decompresses them from one grouped allreduce; residuals and index sets follow that order."""
    ranks = results(GROUPS_THREE_RANKS)
    assert_identical_across_ranks(ranks)
    norms = [sum(float(v.norm()) for v in res["residuals"].values() if v is not None) for res in ranks]
    assert all(n > 0 for n in norms) and len({round(n, 6) for n in norms}) == 3
    dense, topk = map(results, GROUPS_RATIO_ONE)
    for name, value in dense[0]["params"].items():
        torch.testing.assert_close(topk[0]["params"][name], value, rtol=1e-6, atol=1e-7)


SUM_THREE_PASSES = job(2, "train.py", "--steps", 40, "--op", "sum", "--bpps", 3, "--ratio", 0.05)


@pytest.mark.jobs(SUM_THREE_PASSES)
def test_sum_op_and_gradient_accumulation_keep_ranks_identical(results):
    assert_identical_across_ranks(results(SUM_THREE_PASSES))


NAN_ON_RANK_ONE = job(2, "train.py", "--steps", 12, "--nan-rank", 1, "--nan-step", 6, "--ratio", 0.05)


@pytest.mark.jobs(NAN_ON_RANK_ONE)
def test_nan_on_one_rank_skips_step_everywhere_and_keeps_residuals(results):
    ranks = results(NAN_ON_RANK_ONE)
    assert_identical_across_ranks(ranks)
    for res in ranks:
        assert res["nan_step_grads_finite"] is False     # every rank saw the non-finite step
        before, after = res["residual_before_nan"], res["residual_after_nan"]
        assert before.keys() == after.keys() and len(before) > 0
        for slot in before:
            assert torch.equal(before[slot], after[slot]), f"residual of slot {slot} changed"
        assert all(torch.isfinite(v).all() for v in res["residuals"].values() if v is not None)


# mpirun: the test reads rank 1's error only, and a failed job ends its launch (Gloo's are dearer)
CRASH_ON_RANK_ONE = job(2, "train.py", "--steps", 10, "--crash-rank", 1, timeout=120, fails=True, backend="mpi")


@pytest.mark.jobs(CRASH_ON_RANK_ONE)
def test_a_failing_rank_fails_the_job_instead_of_hanging(results):
    with pytest.raises(JobFailed) as failed:
        results(CRASH_ON_RANK_ONE)
    # rank 1's error in the whole output: rank 0's own traceback (Horovod shut down under it) can be
    # long enough to push it out of the message's tail
    assert "injected failure" in failed.value.output
    assert results.run(CRASH_ON_RANK_ONE).seconds < 60


FROZEN_MID_RUN = job(2, "train.py", "--steps", 10, "--freeze-step", 5, "--ratio", 0.1, timeout=120, fails=True,
                     backend="mpi")     # one rank's error is enough, as above


@pytest.mark.jobs(FROZEN_MID_RUN)
def test_layer_frozen_mid_run_raises_instead_of_mixing_residuals(results):
    with pytest.raises(JobFailed, match="sequence of gradients changed"):
        results(FROZEN_MID_RUN)


INDEX_SETS = job(4, "index_sets.py", "--steps", 6)


@pytest.mark.jobs(INDEX_SETS)
def test_one_allgather_per_step_gives_every_rank_each_leaders_index_set(results):
    """IndexPipeline on 4 ranks with 3 keys: each step one rank leads two sets, one leads one and two
    lead none (empty blocks in the allgather); odd ranks pick in reverse key order; every rank still
    gets each leader's set."""
    for res in results(INDEX_SETS):
        assert len(res["checks"]) == 5 * 3
        assert all(c["equal"] for c in res["checks"]), [c for c in res["checks"] if not c["equal"]]
        assert {c["leader"] for c in res["checks"]} == {0, 1, 2, 3}
        assert res["state_keys"] == ["a", "b", "c"]


UNEVEN = {name: job(2, "uneven_params.py", "--compression", *args) for name, args in
          {"dense": ["none"], "exact": ["named", "--ratio", "1.0"], "sparse": ["named", "--ratio", "0.1"]}.items()}


@pytest.mark.jobs(list(UNEVEN.values()))
def test_named_topkef_holds_when_ranks_use_different_parameters(results):
    """Rank 1 uses fc3, rank 0 does not (Horovod allreduces rank 0's fc3 at synchronize(), out of hook
    order). TopKEF keyed by parameter name: ratio 1.0 gives dense Horovod's parameters, and at 0.1 the
    ranks stay identical."""
    dense, exact = results(UNEVEN["dense"]), results(UNEVEN["exact"])
    for name, value in dense[0]["params"].items():
        assert torch.equal(exact[0]["params"][name], value), f"{name} differs from dense Horovod"
    assert_identical_across_ranks(results(UNEVEN["sparse"]))


# the class form keeps its state in the class, for the life of the process: a launch of its own, in the
# full suite only (the fast loop refuses the class form in tests/test_contract.py)
@pytest.mark.parametrize("refused", [
    pytest.param(job(2, "uneven_params.py", "--compression", form, timeout=90, fails=True, alone=form == "class"),
                 marks=[pytest.mark.slow] if form == "class" else [])
    for form in ("positional", "class")], ids=["positional", "class"])
def test_positional_topkef_refuses_ranks_that_order_gradients_differently(results, refused):
    """Without names, TopKEF keys gradients by position; the ranks' orders differ here, so every rank
    raises, naming the fix, within seconds (it used to hang until killed)."""
    with pytest.raises(JobFailed) as failed:
        results(refused)
    assert results.run(refused).seconds < 60
    for rank in (0, 1):
        lines = [line for line in failed.value.output.splitlines() if line.startswith(f"[{rank}]")]
        assert any("named_parameters=model.named_parameters()" in line for line in lines), f"rank {rank}"


# A launch of their own: one shared with jobs that ran hvd.init() without process sets cannot register
# one. They all register the same set {0, 1}, so they share theirs.
OUTSIDE_SET = "process set {0, 1} of 3"
OUTSIDE_SET_GIVEN = job(3, "outside_set.py", "--compression", "positional", "--topkef-set", "optimizer",
                        alone=OUTSIDE_SET, backend="gloo")   # the refused jobs' launcher: one launch


@pytest.mark.slow      # a 3-rank launch of its own; the fast loop keeps tests/test_contract.py's process sets
@pytest.mark.jobs(OUTSIDE_SET_GIVEN)
def test_positional_topkef_given_the_optimizers_process_set_trains_within_it(results):
    """The optimizer reduces within {0, 1} of 3 ranks and TopKEF (no names) is given that set: ranks 0
    and 1 stay identical, rank 2 (outside) trains on its own gradients."""
    ranks = results(OUTSIDE_SET_GIVEN)
    assert all(res["error"] is None for res in ranks)
    assert_identical_across_ranks(ranks[:2])
    assert not torch.equal(ranks[2]["params"]["0.weight"], ranks[0]["params"]["0.weight"])


def outside_set_refused(form, communication):
    # the class form keeps its state in the class, for the life of the process: a launch of its own
    return job(3, "outside_set.py", "--compression", form, "--topkef-set", "none", "--communication", communication,
               timeout=150, fails=True, alone=True if form == "class" else OUTSIDE_SET)


# in the full suite only, as the job above (each waits out the shutdown grace, 3 s in the suite, and
# the next job needs a launch of its own). One job per way the wrong reduction is met: the class form
# (which cannot be given the set), and an instance whose transport's collective is first waited for
# a step later (artopk). The token's check is the same code for instances made with names or without
# (hvd_topk/step/op_token.py); split_reduce through an instance also ran here until 2026-11-30.
@pytest.mark.slow
@pytest.mark.parametrize("refused", [outside_set_refused("class", "split_reduce"),
                                     outside_set_refused("positional", "artopk")],
                         ids=["class-split_reduce", "positional-artopk"])
def test_topkef_not_given_the_optimizers_process_set_fails_every_rank(results, refused):
    """The optimizer reduces within {0, 1} of 3 ranks; TopKEF is not given that set (the class form
    cannot be), so its collectives span rank 2, which never joins them. Ranks 0 and 1 raise at the
    first step, naming process_set; rank 2 carries on to its next global collective, which they never
    reach, and is ended there by their shutdown of Horovod. It used to hang until killed (the launch's
    timeout then fails it here too: the job ends long after the first error). artopk's collective (the
    index sets' allgather) starts at the end of the first step and is first waited for in the second."""
    with pytest.raises(JobFailed) as failed:
        results(refused)
    ended = results.run(refused).ended
    output = failed.value.output
    raised_at = []
    for rank in (0, 1):
        found = re.search(rf"rank {rank} failed at ([0-9.]+): ValueError: TopKEF: Horovod reduced this gradient "
                          "over a set of ranks other than TopKEF's process_set", output)
        assert found, f"rank {rank} did not name process_set; the job's output:\n{output[-6000:]}"
        raised_at.append(float(found.group(1)))
    assert re.search(r"rank 2 failed at [0-9.]+: HorovodInternalError: Horovod has been shut down", output)
    assert ended - min(raised_at) < 60, "the job outlived its first error by a minute"


# -- every transport of TopKEF through stock Horovod ------------------------------------------------

TRANSPORTS = ("split_reduce", "allgather", "artopk")


def transport_job(np, communication, *extra):
    return job(np, "train.py", "--named", "--communication", communication, "--ratio", 0.05, *extra)


EF_ARGS = ("--steps", 8, "--record-ef", 8, "--dtype", "float64", "--reverse-odd")
EF_JOBS = {(np, c): transport_job(np, c, *EF_ARGS) for np in (2, 4) for c in TRANSPORTS}
# TopKEF(selection='global'): one top-k over the step's compressed tensors, residuals still per parameter
GLOBAL = ("split_reduce", "allgather")
EF_JOBS.update({(2, f"{c}-global"): transport_job(2, c, "--selection", "global", *EF_ARGS) for c in GLOBAL})


@pytest.mark.parametrize("ef_job", list(EF_JOBS.values()), ids=[f"{np}-{c}" for np, c in EF_JOBS])
def test_every_transport_sums_what_left_the_ranks_in_any_order(results, ef_job):
    """Odd ranks make their gradients ready in reverse order (no hang). In float64, at every step, the
    aggregate every rank receives is the average of what left the ranks, where what left rank r is
    its gradient plus its old residual minus its new one: error feedback is exact (Σ sent + residual =
    Σ grad per rank by construction, and nothing sent is lost or counted twice). The ranks stay
    bit-identical, and training was sparse (residuals hold mass). (Tensors under min_numel go to
    Horovod's own allreduce, in place in ``.grad``, so their local gradient cannot be read back.)"""
    ranks, np_ = results(ef_job), ef_job.np
    assert_identical_across_ranks(ranks)
    held_back = 0.0
    for step in range(8):
        records = [res["ef_records"][step] for res in ranks]
        compressed = records[0]["after"]          # the others went dense: Horovod's allreduce, in place
        assert len(compressed) == 7              # all but the 1-element output bias
        for name, aggregate in records[0]["aggregate"].items():
            if name not in compressed:
                continue
            sent = []
            for rec in records:
                assert torch.equal(rec["aggregate"][name], aggregate), (step, name)
                before, after = rec["before"].get(name), rec["after"].get(name)
                sent.append(rec["grad"][name] + (0 if before is None else before) - (0 if after is None else after))
                held_back += 0.0 if after is None else float(after.abs().sum())
            torch.testing.assert_close(sum(sent) / np_, aggregate, rtol=0, atol=1e-12, msg=f"step {step}, {name}")
    assert held_back > 0


NAN_JOBS = {c: transport_job(2, c, "--steps", 12, "--nan-rank", 1, "--nan-step", 6) for c in TRANSPORTS}
NAN_JOBS["split_reduce-global"] = transport_job(2, "split_reduce", "--selection", "global", "--steps", 12,
                                                "--nan-rank", 1, "--nan-step", 6)


@pytest.mark.parametrize("nan_job", list(NAN_JOBS.values()), ids=list(NAN_JOBS))
def test_every_transport_skips_a_nan_step_everywhere_and_keeps_residuals(results, nan_job):
    ranks = results(nan_job)
    assert_identical_across_ranks(ranks)
    for res in ranks:
        assert res["nan_step_grads_finite"] is False
        before, after = res["residual_before_nan"], res["residual_after_nan"]
        assert before.keys() == after.keys() and len(before) > 0
        assert all(torch.equal(before[key], after[key]) for key in before)


UNEVEN_TRANSPORTS = {c: job(2, "uneven_params.py", "--compression", "named", "--ratio", 0.1, "--communication", c)
                     for c in TRANSPORTS}


@pytest.mark.parametrize("uneven_job", list(UNEVEN_TRANSPORTS.values()), ids=TRANSPORTS)
def test_every_transport_holds_when_one_rank_leaves_a_parameter_unused(results, uneven_job):
    assert_identical_across_ranks(results(uneven_job))
