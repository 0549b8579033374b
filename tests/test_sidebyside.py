"""bench.sidebyside: the figures it derives, its bad input, and one real job."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from bench import sidebyside

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(ms):
    return {"modes": {m: {"step_s": [t / 1e3 for t in ts], "bytes": [1000.0] * len(ts), "warmup_steps": 5}
                      for m, ts in ms.items()},
            "auto": {"stats": {"auto_dense": 0, "auto_artopk": 4, "auto_allgather": 0}}}


def test_summary_judges_tbf_links_against_the_fastest_fixed_mode_and_unlimited_against_dense():
    ms = {"dense": [100, 96, 104], "hvd_topk allgather": [80, 90, 85], "hvd_topk auto": [86, 91, 88]}
    s = sidebyside.summarise(_record(ms), "1gbit")
    assert s["modes"]["hvd_topk allgather"]["median_ms"] == 85 and s["best"] == "hvd_topk allgather"
    assert s["vs_best"] == pytest.approx(88 / 85 - 1) and s["met"] is True and s["auto_plan"] == "4 artopk"
    assert s["paired_vs_best"] == pytest.approx(88 / 85 - 1)    # rounds: 86/80, 91/90, 88/85
    assert "vs_same" not in s                                  # no 'hvd_topk artopk' in this job
    with_artopk = sidebyside.summarise(_record({**ms, "hvd_topk artopk": [84, 86, 90]}), "1gbit")
    assert with_artopk["vs_same"] == ("hvd_topk artopk", pytest.approx(88 / 86 - 1))
    slow = sidebyside.summarise(_record({**ms, "hvd_topk auto": [92, 90, 91]}), "1gbit")
    assert slow["vs_best"] == pytest.approx(91 / 85 - 1) and slow["met"] is False
    # unlimited: 91 ms is 7% behind allgather but 9% ahead of dense, the target there
    assert sidebyside.summarise(_record({**ms, "hvd_topk auto": [92, 90, 91]}), "unlimited")["met"] is True
    lost = sidebyside.summarise(_record({**ms, "hvd_topk auto": [106, 105, 107]}), "unlimited")
    assert lost["vs_dense"] == pytest.approx(106 / 100 - 1) and lost["met"] is False
    assert "not met" in sidebyside.report([dict(lost, repeat=1, rounds=3)], "cmd")


def test_pooled_jobs_and_the_paired_figure():
    one = _record({"dense": [100, 100], "hvd_topk artopk": [80, 100], "hvd_topk auto": [84, 100]})
    two = _record({"dense": [100, 100], "hvd_topk artopk": [90, 110], "hvd_topk auto": [90, 121]})
    s = sidebyside.pooled([one, two], "1gbit")
    assert s["modes"]["hvd_topk artopk"]["median_ms"] == 95 and s["modes"]["hvd_topk auto"]["median_ms"] == 95
    assert s["best"] == "hvd_topk artopk" and s["vs_best"] == 0 and s["met"] is True
    assert s["paired_vs_best"] == pytest.approx(0.025)       # rounds: 1.05, 1.00, 1.00, 1.10
    assert s["auto_plan"] == "4 artopk; 4 artopk"


def test_topkef_is_compared_but_is_not_a_fixed_mode_of_the_target():
    """TopKEF (no momentum correction) is reported against auto, not taken as the fastest fixed mode."""
    ms = {"topkef": [70, 70, 70], "hvd_topk artopk": [80, 80, 80], "hvd_topk auto": [82, 82, 82]}
    s = sidebyside.summarise(_record(ms), "1gbit")
    assert s["best"] == "hvd_topk artopk" and s["met"] is True
    assert s["vs_topkef"] == pytest.approx(82 / 70 - 1)
    assert "| +17.1% |" in sidebyside.report([dict(s, repeat=1, rounds=3)], "cmd")


@pytest.mark.parametrize("argv, match", [
    (["--bandwidths", "10mbit"], "10mbit"), (["--modes", "dense,fp8"], "fp8"), (["--modes", "topkef nomc"], "nomc"),
    (["--modes", "dense,dense"], "dense"),
    (["--rounds", "0"], "--rounds must be at least 1"), (["--ratio", "1.5"], "--ratio must be in (0, 1]"),
    (["--turn", "0"], "--turn must be at least 1"),
])
def test_bad_arguments_name_the_flag(capsys, argv, match):
    with pytest.raises(SystemExit):
        sidebyside.parse_args(argv)
    assert match in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip (network namespace)")
def test_one_real_job_interleaves_dense_and_auto(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.sidebyside", "--bandwidths", "unlimited", "--modes",
                    "dense,hvd_topk auto", "--rounds", "3", "--turn", "2", "--out", str(tmp_path)], cwd=ROOT,
                   check=True, timeout=600, capture_output=True)
    record = json.loads((tmp_path / "unlimited-rep1.json").read_text())
    # 3 turns of 2 steps each; a turn's first step is not recorded
    assert [len(record["modes"][m]["step_s"]) for m in ("dense", "hvd_topk auto")] == [3, 3]
    assert record["modes"]["dense"]["warmup_steps"] == 5
    assert record["modes"]["hvd_topk auto"]["warmup_steps"] > 5           # its probe and trial came first
    assert any(h[3].startswith("trial, ") for h in record["auto"]["history"])
    assert min(record["modes"]["dense"]["bytes"]) > 2e7                     # 6.33M fp32 gradients, ring of 2
    text = (tmp_path / "report.md").read_text()
    assert "## Target" in text and "(3 rounds, turns of 2 steps)" in text and "auto's trial: trial, " in text
