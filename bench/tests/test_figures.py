"""bench/figures.py: the theoretical bytes of every scheme against hand-computed values, the time to a
target, the targets per seed (fixed, dense - 1 pt, dense + 2%), medians over seeds, the reference's
ratios and auto against the fastest fixed transport, from records made by hand."""
import doctest

import pytest

from bench import figures
from bench.figures import scheme_of, summarize, targets_of, theoretical_bytes, time_to

TENSORS = [["w", 10_000, 2], ["b", 2048, 1], ["s", 100, 1]]


def test_theoretical_bytes_by_hand():
    # 4 ranks: ring allreduce 2(N-1)/N = 1.5 of the buffer; allgather N-1 = 3 blocks, (N-1)/N = 0.75 of
    # their sum on average. w: k = 100; b: k = ceil(20.48) = 21; s: 100 < min_numel, always dense.
    # A message of K entries over S < 65,536 indices: 8 (header) + 2K (bf16) + 2K (offsets), each rounded
    # up to 4 bytes; a bucket's frame: 8 + 4 per tensor.
    assert theoretical_bytes("dense", TENSORS, 1024, 0.01, 4) == pytest.approx(1.5 * 4 * 12_148)
    assert theoretical_bytes("fp16", TENSORS, 1024, 0.01, 4) == pytest.approx(1.5 * 2 * 12_148)
    b_dense, s_dense = 1.5 * 4 * 2048, 1.5 * 4 * 100
    # AR-Topk: values + flag allreduced (float32); one allgather of the sets, 3 int32 ahead of each rank's
    w_ar = 1.5 * 4 * 101 + 0.75 * 4 * (100 + 3 * 4)
    assert theoretical_bytes("artopk", TENSORS, 1024, 0.01, 4) == pytest.approx(w_ar + b_dense + s_dense)
    # TopKEF compresses a 1-D tensor of >= min_numel: both sets in the one allgather
    topkef = 1.5 * 4 * 101 + 1.5 * 4 * 22 + 0.75 * 4 * (121 + 3 * 4)
    assert theoretical_bytes("topkef", TENSORS, 1024, 0.01, 4) == pytest.approx(topkef + s_dense)
    assert theoretical_bytes("artopk", TENSORS, 1024, 0.01, 4, sync_indices=True) == pytest.approx(
        1.5 * 4 * 101 + 0.75 * 4 * 100 + b_dense + s_dense)           # a broadcast per tensor, no header
    # allgather: one bucket of w, every rank's frame (12) and message to 3 others; 16-bit values either way
    w_ag = 3 * (12 + 8 + 200 + 200)
    for kind in ("bf16", "fp16"):
        assert theoretical_bytes("allgather", TENSORS, 1024, 0.01, 4, kind) == pytest.approx(w_ag + b_dense + s_dense)
    assert theoretical_bytes("allgather", TENSORS, 1024, 0.01, 4, "fp32") == pytest.approx(
        3 * (12 + 8 + 400 + 200) + b_dense + s_dense)
    # through TopKEF: b joins w's bucket (16-byte frame, 121 entries: 242 -> 244 bytes per section),
    # and each compressed tensor's 4-float32 op token is allreduced
    assert theoretical_bytes("allgather", TENSORS, 1024, 0.01, 4, door="topkef") == pytest.approx(
        3 * (16 + 8 + 244 + 244) + 1.5 * 16 * 2 + s_dense)
    # split_reduce, 4 ranks: 25 entries to each owner (frame 12 + message 112), 3 of 4 on the link; the
    # histogram rows allreduced; the owners' 100 kept sums gathered (25 each, no frame)
    w_sr = 0.75 * 4 * (12 + 112) + 1.5 * 520 + 0.75 * 4 * 112           # 372 + 780 + 336 = 1488
    assert theoretical_bytes("split_reduce", TENSORS, 1024, 0.01, 4) == pytest.approx(w_sr + b_dense + s_dense)
    assert theoretical_bytes("split_reduce", TENSORS, 1024, 0.01, 4, budget=2) == pytest.approx(
        w_sr + 0.75 * 4 * (208 - 112) + b_dense + s_dense)           # up to 200 kept: 50 per owner
    # 2 ranks: split_reduce is one allgather, as allgather
    assert theoretical_bytes("split_reduce", TENSORS, 1024, 0.01, 2) == pytest.approx(
        theoretical_bytes("allgather", TENSORS, 1024, 0.01, 2)) == pytest.approx(420 + 4 * 2148)
    w = [["w", 10_000, 2]]
    assert [theoretical_bytes("allgather", w, 0, 0.01, n) for n in (2, 4, 8)] == pytest.approx([420, 1260, 7 * 420])
    assert theoretical_bytes("artopk", [["w", 2000, 2]], 0, 1.0, 4) == pytest.approx(1.5 * 4 * 2000)   # k = numel:
    assert theoretical_bytes("topkef", [["w", 2000, 2]], 0, 1.0, 4) == pytest.approx(1.5 * 4 * 2001)   # dense
    assert theoretical_bytes("dense", TENSORS, 1024, 0.01, 1) == 0.0
    with pytest.raises(ValueError, match="scheme"):
        theoretical_bytes("tree", TENSORS, 1024, 0.01, 4)
    with pytest.raises(ValueError, match="value_kind"):
        theoretical_bytes("allgather", TENSORS, 1024, 0.01, 4, "int8")
    with pytest.raises(ValueError, match="door"):
        theoretical_bytes("allgather", TENSORS, 1024, 0.01, 4, door="ddp")


def test_theoretical_bytes_of_buckets_and_block_counts():
    # 2 ranks, ratio 0.01: a (100k elements) keeps 1,000, c (200k) 2,000. One bucket of 300k indices:
    # 4 block counts (uint16: 8 bytes), 2 x 6,000 bytes of values and offsets, a 16-byte frame
    ac = [["a", 100_000, 2], ["c", 200_000, 2]]
    assert theoretical_bytes("allgather", ac, 0, 0.01, 2) == pytest.approx(16 + 8 + 6000 + 8 + 6000)
    # 1 MB buckets (262,144 elements): c alone (3 counts: 6 -> 8 bytes), then a (1 count: 2 -> 4 bytes)
    assert theoretical_bytes("allgather", ac, 0, 0.01, 2, bucket_cap_mb=1) == pytest.approx(
        (12 + 8 + 4000 + 8 + 4000) + (12 + 8 + 2000 + 4 + 2000))
    # 100,000 entries in a message: its 152 block counts are int32
    assert theoretical_bytes("allgather", [["big", 10_000_000, 2]], 0, 0.01, 2) == pytest.approx(
        12 + 8 + 200_000 + 152 * 4 + 200_000)


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


def test_the_theoretical_bytes_follow_each_arms_values_and_door():
    """The arm's values (preset by its name or overridden) and door (TopKEF inside stock Horovod) reach
    the model: 2 ranks, w compressed (k = 100), b (2,048, 1-D) dense but through TopKEF."""
    tensors = [["w", 10_000, 2], ["b", 2048, 1]]
    names = ("hvd_topk allgather", "hvd_topk allgather fp32", "hvd_topk[communication=allgather,values=fp16]",
             "topkef allgather", "hvd_topk allgather fp32[values=bf16]")
    arms = {name: dict(_arm([[1, 1.0, 0.5, 1.0]]), tensors=tensors) for name in names}
    a = summarize([_record(0, arms)])["arms"]
    assert [a[n]["theoretical_bytes"] for n in names] == pytest.approx([
        420 + 4 * 2048, 620 + 4 * 2048, 420 + 4 * 2048,
        (16 + 8 + 244 + 244) + 2 * 16,                   # b joins w's bucket; 2 op tokens
        420 + 4 * 2048])                                 # the override wins over the name's preset


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
    assert result.attempted >= 8 and result.failed == 0
