"""bench/figures.py: the theoretical bytes of every scheme against hand-computed values, the time to a
target, the targets per seed (fixed, dense - 1 pt, dense + 2%), medians over seeds, the reference's
ratios and auto against the fastest fixed transport, from records made by hand."""
import doctest

import pytest

from bench import figures
from bench.figures import scheme_of, summarize, targets_of, theoretical_bytes, time_to

TENSORS = [["w", 10_000, 2], ["b", 2048, 1], ["s", 100, 1]]


def test_theoretical_bytes_by_hand():
    # 4 ranks: ring allreduce 2(N-1)/N = 1.5 of the buffer; broadcast (N-1)/N = 0.75; allgather N-1 = 3.
    # w: k = 100; b: k = ceil(20.48) = 21; s: 100 < min_numel, always dense.
    assert theoretical_bytes("dense", TENSORS, 1024, 0.01, 4) == pytest.approx(1.5 * 4 * 12_148)
    assert theoretical_bytes("fp16", TENSORS, 1024, 0.01, 4) == pytest.approx(1.5 * 2 * 12_148)
    w_ar = 1.5 * 4 * 101 + 0.75 * 4 * 100        # values + flag allreduced, indices broadcast
    b_ar = 1.5 * 4 * 22 + 0.75 * 4 * 21          # TopKEF compresses a 1-D tensor of >= min_numel
    s_dense = 1.5 * 4 * 100
    assert theoretical_bytes("topkef", TENSORS, 1024, 0.01, 4) == pytest.approx(w_ar + b_ar + s_dense)
    assert theoretical_bytes("artopk", TENSORS, 1024, 0.01, 4) == pytest.approx(w_ar + 1.5 * 4 * 2048 + s_dense)
    assert theoretical_bytes("allgather", TENSORS, 1024, 0.01, 4) == pytest.approx(3 * 8 * 101 + 1.5 * 4 * 2048 + s_dense)
    assert theoretical_bytes("allgather", TENSORS, 1024, 0.01, 4, value_bytes=2) == pytest.approx(
        3 * 6 * 101 + 1.5 * 4 * 2048 + s_dense)
    w_sr = 8 * (0.75 * 100 + 3) + 1.5 * 520 + 8 * 0.75 * (100 + 4)        # 624 + 780 + 624 = 2028
    assert theoretical_bytes("split_reduce", TENSORS, 1024, 0.01, 4) == pytest.approx(w_sr + 1.5 * 4 * 2048 + s_dense)
    w = [["w", 10_000, 2]]
    assert [theoretical_bytes("allgather", w, 0, 0.01, n) for n in (2, 4, 8)] == pytest.approx([808, 2424, 7 * 808])
    assert theoretical_bytes("artopk", [["w", 2000, 2]], 0, 1.0, 4) == pytest.approx(1.5 * 4 * 2001)   # k = numel
    assert theoretical_bytes("dense", TENSORS, 1024, 0.01, 1) == 0.0
    with pytest.raises(ValueError, match="scheme"):
        theoretical_bytes("tree", TENSORS, 1024, 0.01, 4)


def test_scheme_of_each_arm():
    def stats(**last):
        return {"stats": {k: [0, v] for k, v in last.items()}}
    assert [scheme_of(n, stats()) for n in ("horovod dense", "ddp", "horovod fp16", "ddp fp16")] == \
        ["dense", "dense", "fp16", "fp16"]
    assert [scheme_of(n, stats()) for n in ("topkef", "topkef artopk", "topkef allgather", "hvd_topk",
                                            "hvd_topk artopk", "hvd_topk[communication=allgather]")] == \
        ["split_reduce", "topkef", "allgather", "split_reduce", "artopk", "allgather"]
    assert scheme_of("hvd_topk hierarchical", stats()) is None and scheme_of("ddp powersgd r4", stats()) is None
    assert scheme_of("hvd_topk auto", stats(auto_dense=0, auto_artopk=4, auto_allgather=0)) == "artopk"
    assert scheme_of("hvd_topk auto", stats(auto_dense=1, auto_artopk=3)) is None


def test_time_to_a_target_is_the_first_evaluation_that_reached_it():
    curve = [[10, 4.0, 0.50, 1.0], [20, 8.5, 0.91, 0.3], [30, 12.0, 0.89, 0.35], [40, 16.0, 0.96, 0.1]]
    assert time_to(curve, 0.40) == (4.0, 10)            # at the first evaluation
    assert time_to(curve, 0.90) == (8.5, 20)            # the first time, not the last
    assert time_to(curve, 0.96) == (16.0, 40)           # at the target counts
    assert time_to(curve, 0.97) is None and time_to([], 0.1) is None
    assert time_to(curve, 0.32, lower_is_better=True) == (8.5, 20)
    assert time_to(curve, 0.05, lower_is_better=True) is None


def _arm(curve, step_s=(0.1, 0.3, 0.2), nbytes=(4000.0, 4200.0, 4100.0), stats=None, kind="horovod"):
    return {"kind": kind, "steps": curve[-1][0], "step_s": list(step_s), "measured_s": list(step_s),
            "bytes": list(nbytes), "curve": curve, "stats": stats or {}, "params_identical": True,
            "num_params": 1000, "tensors": [["w", 1000, 2]], "auto": None, "powersgd_compression_rate": None}


def _record(seed, arms, link="100mbit"):
    return {"task": "cnn", "ranks": 2, "hosts": 0, "link": link, "iface": "lo", "cycle_ms": None, "launcher": "gloo",
            "steps": 40, "warmup": 1, "turn": 2, "eval_every": 20, "batch_size": 16, "ratio": 0.01, "min_numel": None,
            "non_iid": False, "recipe": {}, "steps_per_epoch": 44, "rounds": 20, "env": [], "seed": seed,
            "job_s": 10.0, "arms": arms}


def _two_seeds():
    return [_record(0, {"horovod dense": _arm([[20, 80.0, 0.90, 0.4], [40, 160.0, 0.95, 0.2]], step_s=[4.0] * 3,
                                              nbytes=[1e6] * 3),
                        "topkef": _arm([[20, 10.0, 0.93, 0.5], [40, 20.0, 0.945, 0.3]], step_s=[0.5] * 3),
                        "ddp powersgd r4": _arm([[20, 9.0, 0.80, 0.5], [40, 18.0, 0.85, 0.3]], step_s=[0.45] * 3)}),
            _record(1, {"horovod dense": _arm([[20, 82.0, 0.91, 0.4], [40, 164.0, 0.96, 0.2]], step_s=[4.2] * 3,
                                              nbytes=[1e6] * 3),
                        "topkef": _arm([[20, 11.0, 0.90, 0.5], [40, 22.0, 0.951, 0.3]], step_s=[0.7] * 3),
                        "ddp powersgd r4": _arm([[20, 9.0, 0.80, 0.5], [40, 18.0, 0.95, 0.3]], step_s=[0.45] * 3)})]


def test_targets_per_seed_from_each_seeds_dense_run():
    records = _two_seeds()
    assert [(n, pytest.approx(v)) for n, v in targets_of(records[0], [0.9], "accuracy")] == \
        [("accuracy 0.9", 0.9), ("horovod dense - 1 pt", 0.94)]
    assert targets_of(records[1], [], "accuracy")[0][1] == pytest.approx(0.95)
    assert targets_of(records[0], [2.5], "loss") == [("loss 2.5", 2.5), ("horovod dense + 2%", pytest.approx(0.204))]


def test_summary_pools_seeds_and_compares_with_the_reference():
    s = summarize(_two_seeds(), [0.9])
    topkef, dense, psgd = (s["arms"][n] for n in ("topkef", "horovod dense", "ddp powersgd r4"))
    assert list(s["arms"]) == ["horovod dense", "topkef", "ddp powersgd r4"] and s["reference"] == "horovod dense"
    assert dense["step_ms"] == pytest.approx(4100) and topkef["step_ms"] == pytest.approx(600)
    assert topkef["speedup"] == pytest.approx(4100 / 600) and topkef["bytes_vs_reference"] == pytest.approx(4100 / 1e6)
    assert topkef["final_accuracy"] == pytest.approx(0.948) and topkef["final_per_seed"] == [0.945, 0.951]
    # dense - 1 pt is 0.94 in seed 0 and 0.95 in seed 1: topkef reaches both at its last evaluation
    reached = topkef["targets"]["horovod dense - 1 pt"]
    assert reached["per_seed"] == [(20.0, 40), (22.0, 40)] and reached["train_s"] == 21.0 and reached["reached"] == "2/2"
    assert topkef["targets"]["accuracy 0.9"]["per_seed"] == [(10.0, 20), (11.0, 20)]
    # PowerSGD reached dense - 1 pt in one seed of two: no median time
    assert psgd["targets"]["horovod dense - 1 pt"]["reached"] == "1/2" and psgd["targets"]["horovod dense - 1 pt"]["train_s"] is None
    assert s["fastest"] == {"accuracy 0.9": "topkef", "horovod dense - 1 pt": "topkef"}
    assert dense["theoretical_bytes"] == pytest.approx(4000) and s["setup"]["seeds"] == [0, 1]
    assert s["auto"] is None and s["setup"]["metric"] == "accuracy"


def test_auto_against_the_fastest_fixed_transport():
    def run(auto_ms, link):
        arms = {"horovod dense": _arm([[1, 1.0, 0.5, 1.0]], step_s=[0.100] * 3),
                "hvd_topk allgather": _arm([[1, 1.0, 0.5, 1.0]], step_s=[0.080] * 3),
                "topkef": _arm([[1, 1.0, 0.5, 1.0]], step_s=[0.050] * 3),          # not a fixed transport
                "hvd_topk auto": _arm([[1, 1.0, 0.5, 1.0]], step_s=[auto_ms / 1e3] * 3)}
        return summarize([_record(0, arms, link)])["auto"]
    met = run(83, "1gbit")
    assert met["fastest_fixed"] == "hvd_topk allgather" and met["vs_fastest"] == pytest.approx(83 / 80 - 1)
    assert met["met"] is True and run(85, "1gbit")["met"] is False
    assert run(99, "unlimited")["met"] is True and run(106, "unlimited")["met"] is False     # unlimited: dense
    assert run(99, "unlimited")["vs_dense"] == pytest.approx(-0.01)


def test_a_loss_task_aims_at_dense_plus_two_percent():
    arms = {"horovod dense": _arm([[10, 5.0, None, 2.0], [20, 10.0, None, 1.5]]),
            "topkef": _arm([[10, 1.0, None, 1.6], [20, 2.0, None, 1.52]])}
    s = summarize([_record(0, arms)])
    assert s["setup"]["metric"] == "loss" and s["targets"][0]["name"] == "horovod dense + 2%"
    assert s["arms"]["topkef"]["targets"]["horovod dense + 2%"]["per_seed"] == [(2.0, 20)]
    assert s["arms"]["topkef"]["final_loss"] == 1.52 and s["arms"]["topkef"]["final_accuracy"] is None


def test_docstring_examples():
    result = doctest.testmod(figures)
    assert result.attempted >= 4 and result.failed == 0
