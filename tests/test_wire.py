"""Bytes on the link, read from the loopback counters of a private network namespace."""
import json
import os
import sys

import pytest
import torch

from bench.infra.batch import run_batch
from bench.infra.launch import run_job
from bench.infra.wire import Namespace, can_make_namespace

from conftest import ROOT, WORKERS

needs_netns = pytest.mark.skipif(not can_make_namespace(), reason="network namespaces need root + iproute2")


@needs_netns
@pytest.mark.multirank
def test_topkef_sends_at_most_one_twentieth_of_dense_on_the_wire(tmp_path):
    """Dense and TopKEF one after the other in one job, in one private namespace; each run counts the
    loopback bytes of its own measured steps (after a barrier at its end), so neither counts the other."""
    runs = {"dense": ["--compression", "none"], "topkef": ["--compression", "topkef", "--ratio", 0.01]}
    entries = [[os.path.join(WORKERS, "train.py"), "--out", tmp_path / name, "--width", 1024, "--depth", 2,
                "--steps", 23, "--warmup", 3, *args] for name, args in runs.items()]
    for name in runs:
        (tmp_path / name).mkdir()
    with Namespace() as ns:
        for failure in run_batch(2, entries, prefix=ns.prefix, cwd=ROOT):
            if failure is not None:
                raise failure
    per_step = {}
    for name in runs:
        res = torch.load(tmp_path / name / "rank0.pt", weights_only=False)
        assert res["num_params"] >= 1_000_000
        per_step[name] = res["loopback_tx_bytes"] / res["measured_steps"]
    dense, topk = per_step["dense"], per_step["topkef"]
    print(f"\nloopback bytes/step, 2 ranks, 1.08M params: dense {dense:,.0f}, TopKEF 0.01 {topk:,.0f}, "
          f"ratio {dense / topk:.1f}x")
    # Dense ring allreduce moves ~2(P-1)/P * 4 bytes per element per rank: check the counter is real.
    assert dense > 2 * 1_000_000 * 4 * 0.9
    assert topk <= dense / 20


@pytest.mark.slow
@pytest.mark.multirank
@needs_netns
def test_digits_demo_accuracy_and_bytes(tmp_path):
    """The main job's two runs: TopKEF at 0.01 within 2 points of dense, and far fewer bytes."""
    results = {}
    for mode in ("none", "topkef"):
        out = tmp_path / f"{mode}.json"
        with Namespace() as ns:
            run_job(2, [sys.executable, os.path.join(ROOT, "examples", "digits_cnn.py"), "--compression",
                        mode, "--ratio", "0.01", "--quiet", "--json-out", str(out)],
                    prefix=ns.prefix, timeout=600, cwd=ROOT)
        results[mode] = json.loads(out.read_text())
    dense, topk = results["none"], results["topkef"]
    print(f"\ndigits: dense acc {dense['test_accuracy']:.4f}, TopKEF acc {topk['test_accuracy']:.4f}, "
          f"bytes/rank/step {dense['bytes_per_rank_per_step']:,.0f} vs {topk['bytes_per_rank_per_step']:,.0f}")
    assert dense["params_identical"] and topk["params_identical"]
    assert dense["test_accuracy"] > 0.9
    assert topk["test_accuracy"] >= dense["test_accuracy"] - 0.02
    assert topk["bytes_per_rank_per_step"] < dense["bytes_per_rank_per_step"] / 5
