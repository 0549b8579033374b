"""The alpha-beta cost model (docs/costmodel.md) against numbers worked out by hand."""
import math

import pytest

from hvd_topk.auto.costmodel import COLLECTIVES, HIST_BYTES, choose, crossover_density, predict

GBIT = 8 / 1e9        # beta of a 1 Gbit/s link, s/byte


def test_predict_hand_computed_int32_indices():
    # N = 4, M = 1e6 B, c = 0.01, α = 1e-5 s, β = 1e-9 s/B, r = 4/4 = 1; log2 4 = 2, Mc = 1e4 B.
    t = predict(4, 1e6, 0.01, alpha=1e-5, beta=1e-9)
    # ring:      2·3·1e-5 + 2·3/4·1e6·1e-9          = 6e-5 + 1.5e-3   = 1.56e-3
    assert t["dense_ring"] == pytest.approx(1.56e-3, rel=1e-12)
    # tree:      2·1e-5·2 + 2·2·1e6·1e-9             = 4e-5 + 4e-3     = 4.04e-3
    assert t["dense_tree"] == pytest.approx(4.04e-3, rel=1e-12)
    # allgather: 1e-5·2 + 1e4·(1+1)·1e-9·3           = 2e-5 + 6e-5     = 8e-5   (docs/costmodel.md: 2Mcβ(N-1))
    assert t["allgather"] == pytest.approx(8e-5, rel=1e-12)
    # AR ring:   1e-5·(2·3 + 2) + 1e4·1e-9·(1.5 + 2)  = 8e-5 + 3.5e-5   = 1.15e-4
    assert t["artopk_ring"] == pytest.approx(1.15e-4, rel=1e-12)
    # AR tree:   3·1e-5·2 + 3·1e4·1e-9·2              = 6e-5 + 6e-5     = 1.2e-4
    assert t["artopk_tree"] == pytest.approx(1.2e-4, rel=1e-12)
    # split:     12·1e-5 + 1.5·(1e4·2 + 520)·1e-9     = 1.2e-4 + 3.078e-5 = 1.5078e-4
    assert t["split_reduce"] == pytest.approx(1.5078e-4, rel=1e-12)
    assert set(t) == set(COLLECTIVES)


def test_predict_hand_computed_int64_indices_no_latency():
    # N = 8, M = 4e6 B, c = 1e-3, α = 0, β = 1e-8, int64 indices with fp32 values: r = 8/4 = 2;
    # log2 8 = 3, Mc = 4e3 B, Mcβ = 4e-5 s.
    t = predict(8, 4e6, 1e-3, alpha=0.0, beta=1e-8, index_bytes=8, value_bytes=4)
    # ring:      2·7/8·4e6·1e-8          = 0.07
    assert t["dense_ring"] == pytest.approx(0.07, rel=1e-12)
    # tree:      2·3·4e6·1e-8            = 0.24
    assert t["dense_tree"] == pytest.approx(0.24, rel=1e-12)
    # allgather: 4e-5·(1 + 2)·7          = 8.4e-4   (values and twice as many index bytes)
    assert t["allgather"] == pytest.approx(8.4e-4, rel=1e-12)
    # AR ring:   4e-5·(2·7/8 + 2·3)      = 4e-5·7.75 = 3.1e-4  (index broadcast of Mc·r bytes)
    assert t["artopk_ring"] == pytest.approx(3.1e-4, rel=1e-12)
    # AR tree:   4e-5·3·(2 + 2)          = 4.8e-4
    assert t["artopk_tree"] == pytest.approx(4.8e-4, rel=1e-12)
    # split:     2·7/8·(4e3·3 + 520)·1e-8 = 1.75·1.252e-4 = 2.191e-4
    assert t["split_reduce"] == pytest.approx(2.191e-4, rel=1e-12)


def test_predict_reduces_to_design_formulas_and_one_worker_is_free():
    n, m, c, a, b = 64, 1e8, 0.01, 5e-5, GBIT
    t, log_n = predict(n, m, c, a, b), math.log2(n)
    assert t["allgather"] == pytest.approx(a * log_n + 2 * m * c * b * (n - 1), rel=1e-12)
    assert t["artopk_tree"] == pytest.approx(3 * a * log_n + 3 * m * c * b * log_n, rel=1e-12)
    ring = 2 * (n - 1) / n
    assert t["split_reduce"] == pytest.approx(4 * (n - 1) * a + ring * (2 * m * c + HIST_BYTES) * b, rel=1e-12)
    assert predict(1, 1e9, 0.5, 1.0, 1.0) == {name: 0.0 for name in COLLECTIVES}


def test_choose_allgather_for_tiny_density_on_a_fast_link_with_few_workers():
    # 100 Gbit/s (β = 8e-11), N = 4, c = 1e-4, M = 1e8: allgather = 2α + 2Mcβ·3 ≈ 1.05e-4 s is latency
    # bound and beats AR-Topk ring (8α ≈ 4e-4 s) and dense ring (6α + 1.5Mβ ≈ 1.23e-2 s).
    assert choose(4, 1e8, 1e-4, alpha=5e-5, beta=8e-11) == "allgather"


def test_choose_split_reduce_on_a_slow_link_with_many_workers():
    # 100 Mbit/s (β = 8e-8), N = 512, c = 0.05, M = 1e8: allgather ≈ 408 s, dense ring ≈ 16.0 s,
    # AR-Topk tree ≈ 10.8 s, AR-Topk ring ≈ 0.05 + 5e6·8e-8·(2·511/512 + 9) ≈ 4.45 s (its index
    # broadcast grows with log N), split_reduce ≈ 0.10 + 2·511/512·(1e7 + 520)·8e-8 ≈ 1.70 s.
    t = predict(512, 1e8, 0.05, alpha=5e-5, beta=8e-8)
    assert t["artopk_ring"] == pytest.approx(5e-5 * (1022 + 9) + 0.4 * (1022 / 512 + 9), rel=1e-12)
    assert t["split_reduce"] == pytest.approx(5e-5 * 2044 + 1022 / 512 * (1e7 + 520) * 8e-8, rel=1e-12)
    assert choose(512, 1e8, 0.05, alpha=5e-5, beta=8e-8) == "split_reduce"
    # The same at small density from 16 workers to 1024.
    for n in (16, 64, 256, 1024):
        assert choose(n, 1e8, 0.01, alpha=5e-5, beta=8e-8) == "split_reduce"


def test_choose_artopk_ring_where_split_reduce_latency_outweighs_its_bytes():
    # 10 Gbit/s (β = 8e-10), N = 64, c = 0.01, M = 1e8 (Mcβ = 0.8 ms): split_reduce's 4·63 messages
    # (12.6 ms) against AR-Topk ring's 2·63 + 6 (6.6 ms) cost more than the bytes it saves:
    # Mcβ·(2·63/64 + 6) = 6.4 ms against 2·63/64·2·Mcβ = 3.2 ms.
    t = predict(64, 1e8, 0.01, alpha=5e-5, beta=8e-10)
    assert t["artopk_ring"] < t["split_reduce"] < t["allgather"]
    assert choose(64, 1e8, 0.01, alpha=5e-5, beta=8e-10) == "artopk_ring"


def test_choose_allgather_over_split_reduce_with_few_workers():
    # N = 2: split_reduce runs as one allgather (its two-rank path): the same time on any link
    for beta in (8e-8, 8e-9, 8e-11):
        t = predict(2, 1e8, 0.01, alpha=5e-5, beta=beta)
        assert t["allgather"] == t["split_reduce"] == 5e-5 + 2e6 * beta
    # N = 4 on 10 Gbit/s: allgather = 2α + 3·2Mcβ = 1.06e-4 s, split_reduce = 12α + 1.5·(2Mc + H)β
    # ≈ 6.2e-4 s: the 10 extra messages cost more than the 1.5·2Mc bytes saved.
    t = predict(4, 1e7, 1e-3, alpha=5e-5, beta=8e-10)
    assert t["allgather"] == pytest.approx(1e-4 + 6 * 1e4 * 8e-10, rel=1e-12)
    assert t["split_reduce"] == pytest.approx(6e-4 + 1.5 * (2e4 + 520) * 8e-10, rel=1e-12)
    assert choose(4, 1e7, 1e-3, alpha=5e-5, beta=8e-10) == "allgather"
    # ... while on 100 Mbit/s the bytes count most: split_reduce sends half of allgather's.
    assert choose(4, 1e8, 0.01, alpha=5e-5, beta=8e-8) == "split_reduce"


def test_split_reduce_bytes_per_rank_are_flat_in_workers():
    # Bandwidth term alone (α = 0): 2(N−1)/N grows from 1.5 at N = 4 to < 2 at any N, while allgather's
    # N − 1 grows 341-fold.
    four, many = (predict(n, 1e8, 0.01, alpha=0.0, beta=8e-9) for n in (4, 1024))
    assert many["split_reduce"] < 4 / 3 * four["split_reduce"]
    assert many["split_reduce"] == pytest.approx(2 * 1023 / 1024 / 1.5 * four["split_reduce"], rel=1e-12)
    assert many["allgather"] == pytest.approx(1023 / 3 * four["allgather"], rel=1e-12)
    # Latency alone (β = 0): 4(N−1) messages.
    assert predict(1024, 1e8, 0.01, alpha=1.0, beta=0.0)["split_reduce"] == 4 * 1023


def test_split_reduce_gathers_kept_times_k():
    # Bandwidth term alone: the alltoall carries (N−1)/N·Mc(1+r), the gather kept times that; the
    # histogram's ring allreduce stays. kept = 1 is the formula of every other test here.
    one, two = (predict(8, 4e6, 0.01, alpha=0.0, beta=1e-8, kept=kept)["split_reduce"] for kept in (1, 2))
    assert two - one == pytest.approx(7 / 8 * 4e6 * 0.01 * 2 * 1e-8, rel=1e-12)
    assert one == pytest.approx(2 * 7 / 8 * (4e6 * 0.01 * 2 + HIST_BYTES) * 1e-8, rel=1e-12)
    with pytest.raises(ValueError, match=r"kept must be a finite number >= 1"):
        predict(8, 4e6, 0.01, alpha=0.0, beta=1e-8, kept=0.5)


def test_packed_entries_price_allgather_and_split_reduce_at_their_bytes():
    # 4-byte entries (bf16 value, 16-bit index offset) of fp32 values: Mc·4/4 = Mc bytes, half of the
    # (value, int32 index) rows' 2Mc; artopk's dense k-vector is not packed
    packed, rows = (predict(4, 1e8, 0.01, alpha=0.0, beta=8e-9, entry_bytes=e) for e in (4, None))
    assert packed["allgather"] == pytest.approx(rows["allgather"] / 2, rel=1e-12) == 3 * 1e6 * 8e-9
    assert packed["split_reduce"] == pytest.approx(1.5 * (1e6 + HIST_BYTES) * 8e-9, rel=1e-12)
    assert packed["artopk_ring"] == rows["artopk_ring"]
    with pytest.raises(ValueError, match="entry_bytes must be a finite number > 0"):
        predict(4, 1e8, 0.01, alpha=0.0, beta=8e-9, entry_bytes=0)


@pytest.mark.parametrize("n", [2, 16, 256])
@pytest.mark.parametrize("beta", [8e-8, 8e-11])
def test_choose_dense_near_full_density(n, beta):
    assert choose(n, 1e8, 0.95, alpha=5e-5, beta=beta) in ("dense_ring", "dense_tree")


def test_choose_ties_and_candidates_are_deterministic():
    # One worker: everything costs 0, the first of COLLECTIVES' order wins (dense ring).
    assert COLLECTIVES == ("dense_ring", "dense_tree", "artopk_ring", "artopk_tree", "split_reduce", "allgather")
    assert choose(1, 1e6, 0.01, 1e-5, 1e-9) == "dense_ring"
    assert choose(1, 1e6, 0.01, 1e-5, 1e-9, candidates=["allgather", "artopk_tree"]) == "artopk_tree"
    assert choose(1, 1e6, 0.01, 1e-5, 1e-9, candidates=["allgather", "split_reduce"]) == "split_reduce"
    # No data: only latency counts; allgather's log N beats AR-Topk's, and dense ring's 2(N-1) = 2 ties
    # dense tree's 2·log2 2 = 2 at N = 2: the tie goes to dense_ring.
    assert choose(2, 0, 1.0, 1e-5, 1e-9, candidates=["dense_ring", "dense_tree"]) == "dense_ring"
    assert choose(2, 0, 1.0, 1e-5, 1e-9, candidates=["dense_tree", "dense_ring"]) == "dense_ring"
    # Restricted candidates: AR-Topk only.
    assert choose(4, 1e8, 1e-4, 5e-5, 8e-11, candidates=("artopk_ring", "artopk_tree")) == "artopk_tree"


def test_crossover_density_matches_predict():
    for n in (8, 64, 1024):
        for index_bytes in (4, 8):
            c_star = crossover_density(n, index_bytes=index_bytes)
            assert c_star == pytest.approx(2 / (n * (1 + index_bytes / 4)))
            below = predict(n, 1e8, c_star * 0.99, 0.0, GBIT, index_bytes=index_bytes)
            above = predict(n, 1e8, c_star * 1.01, 0.0, GBIT, index_bytes=index_bytes)
            assert below["allgather"] < below["dense_ring"] < above["allgather"]
    assert crossover_density(64) == 1 / 64                  # docs/costmodel.md: int32 indices, c < 1/N
    assert crossover_density(1) == 1.0


@pytest.mark.parametrize("args,name", [
    ((0, 1e6, 0.01, 1e-5, 1e-9), "n_workers"),
    ((2.0, 1e6, 0.01, 1e-5, 1e-9), "n_workers"),
    ((True, 1e6, 0.01, 1e-5, 1e-9), "n_workers"),
    ((4, -1, 0.01, 1e-5, 1e-9), "message_bytes"),
    ((4, float("inf"), 0.01, 1e-5, 1e-9), "message_bytes"),
    ((4, 1e6, 0.0, 1e-5, 1e-9), "density"),
    ((4, 1e6, 1.5, 1e-5, 1e-9), "density"),
    ((4, 1e6, float("nan"), 1e-5, 1e-9), "density"),
    ((4, 1e6, 0.01, -1e-5, 1e-9), "alpha"),
    ((4, 1e6, 0.01, 1e-5, -1e-9), "beta"),
    ((4, 1e6, 0.01, 1e-5, "1e-9"), "beta"),
])
def test_bad_input_raises_naming_the_parameter(args, name):
    with pytest.raises(ValueError, match=name):
        predict(*args)
    with pytest.raises(ValueError, match=name):
        choose(*args)


def test_bad_byte_sizes_and_candidates_raise():
    with pytest.raises(ValueError, match="index_bytes"):
        predict(4, 1e6, 0.01, 1e-5, 1e-9, index_bytes=0)
    with pytest.raises(ValueError, match="value_bytes"):
        crossover_density(4, value_bytes=-4)
    with pytest.raises(ValueError, match="candidates"):
        choose(4, 1e6, 0.01, 1e-5, 1e-9, candidates=["dense_ring", "sparse_ring"])
    with pytest.raises(ValueError, match="candidates"):
        choose(4, 1e6, 0.01, 1e-5, 1e-9, candidates=[])
