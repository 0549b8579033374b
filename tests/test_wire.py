"""Bytes on the link, read from the loopback counters of a private network namespace."""
import re
import subprocess
import sys

import pytest

from testbed.pytest_jobs import ROOT
from testbed.wire import can_make_namespace

needs_netns = pytest.mark.skipif(not can_make_namespace(), reason="network namespaces need root + iproute2")


@pytest.mark.slow
@pytest.mark.multirank
@needs_netns
def test_digits_demo_accuracy_and_bytes():
    """The demo's command as scripts/demo.sh runs it (python -m bench demo: dense Horovod, then TopKEF 0.01, each
    job in a private namespace), at 10 epochs instead of its 20 (dense 0.9861, TopKEF 0.9833 at 35.4-35.6x fewer
    bytes, on two machines: 2026-11-30 and 2026-12-02), read from its table: TopKEF within 2 points of dense,
    dense's bytes those of a ring allreduce (the counter is real: 4 bytes per parameter per rank and step on 2
    ranks, measured 1.01x), TopKEF's at most 1/20 of them, and the same parameters on every rank in both runs.
    (From 2026-12-01 it ran 5 epochs: TopKEF 0.9805 when that was set and within 2 points in every run after,
    until a machine with the same code and dense's same 0.9861 gave 0.9499 in every run: at the end of a
    schedule that short, Top-K's trajectory follows the CPU's rounding. Until 2026-11-30 a test of its own
    checked the 1/20 on a 1.08M-parameter MLP, 55.5x measured; the demo's 151k-parameter CNN keeps small dense
    layers and still sends 35x fewer bytes.)"""
    proc = subprocess.run([sys.executable, "-m", "bench", "demo", "--epochs", "10", "--timeout", "600"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = r"^\| {} +\| +([\d.]+) \| +([\d,]+) \| +[\d.]+x \| +[\d.]+ \| +(\w+) \|$"
    found = {name: re.search(row.format(re.escape(name)), proc.stdout, re.M)
             for name in ("dense Horovod", "TopKEF ratio 0.01")}
    assert all(found.values()), proc.stdout[-3000:]
    (dense_acc, dense_bytes, dense_same), (topk_acc, topk_bytes, topk_same) = (
        (float(m.group(1)), int(m.group(2).replace(",", "")), m.group(3)) for m in found.values())
    print(f"\ndigits demo: dense acc {dense_acc:.4f}, TopKEF acc {topk_acc:.4f}, "
          f"bytes/rank/step {dense_bytes:,} vs {topk_bytes:,}")
    assert dense_same == topk_same == "yes"
    params = int(re.search(r"digits CNN \(([\d,]+) parameters\), 2 ranks", proc.stdout).group(1).replace(",", ""))
    assert dense_acc > 0.9
    assert topk_acc >= dense_acc - 0.02
    assert 0.95 * 4 * params <= dense_bytes <= 1.1 * 4 * params, (dense_bytes, params)
    assert topk_bytes <= dense_bytes / 20
