"""split_reduce (hvd_topk/transports/split_reduce.py): its rows, its regions and real multi-rank jobs.

The jobs set the gradients themselves (tests/workers/split_reduce.py), so every figure below can be
recomputed here from what each rank recorded. Ratio 1.0 against dense Horovod, bit-identical
parameters after 200 steps, checkpoints and non-finite steps are in tests/test_optimizer.py with the
other transports.
"""
import pytest
import torch

from hvd_topk.transports.regions import Regions
from hvd_topk.transports.hierarchical import from_rows, to_rows
from testbed.pytest_jobs import job


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rows_carry_values_and_indices_exactly(dtype):
    values = torch.tensor([1.5, -2.25, float("inf"), 0.0], dtype=dtype)
    indices = torch.tensor([7, 0, 2 ** 31 - 1, 12345])
    rows = to_rows(values, indices)
    assert rows.dtype == torch.uint8 and rows.shape == (4, values.element_size() + 4)
    back_values, back_indices = from_rows(rows, dtype)
    assert torch.equal(back_values, values) and torch.equal(back_indices, indices)


def test_regions_start_equal_and_follow_the_kept_indices():
    regions = Regions(rebalance_every=2)
    bounds = regions.of("w", 1000, 3)
    assert bounds.tolist() == [0, 333, 666, 1000]
    assert Regions.owners(torch.tensor([0, 332, 333, 665, 666, 999]), bounds).tolist() == [0, 0, 1, 1, 2, 2]
    busy = torch.arange(0, 300, 3)                     # everything kept lies in the first 300 indices
    regions.observe("w", busy)
    assert regions.of("w", 1000, 3).tolist() == [0, 333, 666, 1000]     # not yet: one step of two
    regions.observe("w", busy)
    balanced = regions.of("w", 1000, 3)
    assert balanced[0] == 0 and balanced[-1] == 1000 and balanced[2] <= 300
    per_owner = torch.bincount(Regions.owners(busy, balanced), minlength=3)
    assert per_owner.max() <= 40                       # about 100 / 3 each, at chunk resolution
    assert regions.largest_share("w", busy) == per_owner.max()
    saved = regions.state_dict()                       # a checkpoint restores the moved boundaries
    restored = Regions(rebalance_every=2)
    restored.load_state_dict(saved)
    assert torch.equal(restored.of("w", 1000, 3), balanced)
    restored.load_state_dict(None)                     # a checkpoint from before split_reduce
    assert restored.of("w", 1000, 3).tolist() == [0, 333, 666, 1000]
    # other sizes or rank counts (an elastic job) start equal again; forget() too
    assert regions.of("w", 1000, 4).tolist() == [0, 250, 500, 750, 1000]
    regions.forget()
    assert regions.of("w", 10, 3).tolist() == [0, 3, 6, 10]


def test_regions_with_nothing_kept_stay_equal():
    assert Regions._balanced(torch.zeros(8, dtype=torch.int64), 80, 4).tolist() == [0, 20, 40, 60, 80]


def _records(ranks):
    return [res["records"] for res in ranks]


def _assert_exact_error_feedback(per_rank, name, steps):
    """Every step, on every rank: what left the rank (acc - new residual) is its whole acc on the
    aggregate's support and zero elsewhere, and the ranks' sent entries add up to the aggregate."""
    ranks = len(per_rank)
    previous = [torch.zeros(per_rank[0][0]["local"][name].numel(), dtype=torch.float64) for _ in range(ranks)]
    for t in range(steps):
        aggregate = per_rank[0][t]["aggregate"][name].reshape(-1)
        support = aggregate != 0
        sent_sum = torch.zeros_like(aggregate)
        for r in range(ranks):
            acc = per_rank[r][t]["local"][name].reshape(-1) + previous[r]
            residual = per_rank[r][t]["residual"][name]
            sent = acc - residual
            assert torch.all(sent[~support] == 0), f"rank {r} step {t}: sent outside the aggregate"
            assert torch.all((residual == 0) | (residual == acc)), f"rank {r} step {t}: partly sent"
            sent_sum += sent
            previous[r] = residual
        torch.testing.assert_close(sent_sum, aggregate * ranks, rtol=1e-12, atol=1e-12)


SKEWED = job(3, "split_reduce.py", "--skew", "--steps", 12)


@pytest.mark.jobs(SKEWED)
def test_skewed_gradients_give_the_exact_global_topk_and_exact_error_feedback(results):
    """3 ranks, float64: only rank 0 holds large entries, all in one owner's region at first.

    - step 0: the aggregate is exactly the global top-k of the sum: each index's value is the sum of
      the ranks that selected it, over the ranks (Average);
    - every step, on every rank: what left the rank (acc - new residual) is its acc on the aggregate's
      support and zero elsewhere, and the ranks' sent entries add up to the aggregate (nothing lost,
      nothing counted twice): Σ sent + residual = Σ grad, per rank;
    - the aggregates are identical on every rank, bit for bit;
    - the busiest owner keeps everything at first (imbalance 3.0); after the regions are rebalanced
      (every 4 steps here) the imbalance is reported below 1.6.
    """
    per_rank = _records(results(SKEWED))
    ranks = len(per_rank)
    for t in range(12):
        for name in per_rank[0][t]["aggregate"]:
            for r in range(1, ranks):
                assert torch.equal(per_rank[r][t]["aggregate"][name], per_rank[0][t]["aggregate"][name])
    for name in ("a", "b"):
        numel = per_rank[0][0]["local"][name].numel()
        k = max(1, int(-(-0.02 * numel // 1)))
        grads = [rec[0]["local"][name].reshape(-1) for rec in per_rank]
        total = sum(grads)
        top = set(torch.topk(total.abs(), k).indices.tolist())
        aggregate = per_rank[0][0]["aggregate"][name].reshape(-1)
        assert set(aggregate.nonzero().reshape(-1).tolist()) == top
        expected = torch.zeros_like(total)
        for g in grads:
            mine = torch.topk(g.abs(), k).indices
            expected[mine] += g[mine]
        mask = torch.zeros_like(total, dtype=torch.bool)
        mask[list(top)] = True
        torch.testing.assert_close(aggregate, torch.where(mask, expected, 0.0) / ranks, rtol=0, atol=1e-15)
        _assert_exact_error_feedback(per_rank, name, 12)
    imbalance = [rec["stats"]["split_imbalance"] for rec in per_rank[0]]
    assert imbalance[0] == pytest.approx(3.0)
    assert max(imbalance[5:]) < 1.6, imbalance
    assert all(rec["stats"]["split_kept"] <= 2 * max(1, int(-(-0.02 * 2000 // 1))) for rec in per_rank[0])


EIGHT_RANKS = job(8, "split_reduce.py", "--steps", 6)


@pytest.mark.jobs(EIGHT_RANKS)
def test_eight_ranks_keep_two_k_of_the_sums_by_default_with_exact_error_feedback(results):
    """8 ranks (oversubscribed), float64, every rank's own noise: the ranks nominate up to 8k distinct
    entries per tensor, and the default budget (one k per 4 ranks, ``budget_at``) keeps more than k and
    at most 2k of their sums; aggregates identical on every rank, error feedback exact."""
    per_rank = _records(results(EIGHT_RANKS))
    assert len(per_rank) == 8
    for name in ("a", "b"):
        k = max(1, int(-(-0.02 * per_rank[0][0]["local"][name].numel() // 1)))
        for t in range(6):
            aggregates = [rec[t]["aggregate"][name] for rec in per_rank]
            assert all(torch.equal(a, aggregates[0]) for a in aggregates[1:]), (name, t)
            assert k < int(aggregates[0].count_nonzero()) <= 2 * k, (name, t, k)
        _assert_exact_error_feedback(per_rank, name, 6)


@pytest.mark.parametrize("agreeing", [
    job(np, "split_reduce.py", "--steps", 8, *extra)
    for np, extra in [(4, ["--groups", "1", "--values", "fp16", "--dtype", "float32"]),
                      (2, ["--selection", "global", "--ratio", "0.01"])]], ids=["4-extra0", "2-extra1"])
def test_grouped_float16_and_global_jobs_agree_on_every_rank(results, agreeing):
    """Horovod's groups (a dense tensor's grouped allreduce is pending while split_reduce adds its
    collectives), float16 values on 4 ranks and global selection on 2: no hang, aggregates and
    parameters identical on every rank, something kept every step."""
    ranks = results(agreeing)
    per_rank = _records(ranks)
    for t in range(8):
        aggregates = [rec[t]["aggregate"] for rec in per_rank]
        for name in aggregates[0]:
            assert all(torch.equal(a[name], aggregates[0][name]) for a in aggregates[1:]), (t, name)
        assert aggregates[0]["a"].count_nonzero() > 0
    assert all(per_rank[0][t]["stats"]["split_kept"] > 0 for t in range(8))
    for res in ranks[1:]:
        assert all(torch.equal(value, res["params"][name]) for name, value in ranks[0]["params"].items())


def test_the_cost_model_counts_the_histogram_the_transport_sends():
    from hvd_topk.auto import costmodel
    from hvd_topk.transports.split_reduce import HIST_BINS, histogram_row
    row = histogram_row(torch.zeros(HIST_BINS, dtype=torch.long), mismatched=0, unreadable=0)
    assert row.numel() * row.element_size() == costmodel.HIST_BYTES == 520
