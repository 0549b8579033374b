"""bench.time_to_accuracy: DDP's hooks and the Horovod / hvd_topk modes train side by side in one job,
and the training time at which each first reaches a test accuracy: one real 2-rank job over a private
loopback, and the time-to-target logic on its own."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from bench import time_to_accuracy as tta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multirank
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip (network namespace)")
def test_one_real_job_trains_every_mode_and_times_its_curve(tmp_path):
    """2 ranks (horovodrun; Horovod and torch.distributed's Gloo in the same processes), the small digits
    CNN, unlimited loopback, every mode: 3 steps alone, then turns of 2 until 9 steps, an evaluation
    every 3 steps and at the last. Every mode trains (a curve at steps 3, 6, 9), the parameters are
    identical on both ranks, and the dense modes of the two libraries compute the same model."""
    subprocess.run([sys.executable, "-m", "bench.time_to_accuracy", "--model", "cnn", "--bandwidth", "unlimited",
                    "--steps", "9", "--eval-every", "3", "--turn", "2", "--targets", "0,1.0", "--out",
                    str(tmp_path), "--timeout", "120"], cwd=ROOT, check=True, timeout=150, capture_output=True)
    record = json.loads((tmp_path / "record.json").read_text())
    rows = {r["label"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == list(tta.MODES) and record["ranks"] == 2
    for mode, m in record["modes"].items():
        assert [c[0] for c in m["curve"]] == [3, 6, 9], mode
        assert m["steps"] == 9 and len(m["step_s"]) == 9 and rows[mode]["params_identical"], mode
        assert [c[1] for c in m["curve"]] == sorted(c[1] for c in m["curve"]) and m["curve"][-1][1] > 0
        assert 0 < rows[mode]["final_accuracy"] <= 1 and rows[mode]["link_bytes"] > 0
        assert rows[mode]["reached"]["0.00"] == [m["curve"][0][1], 3]      # reached at the first evaluation
        assert rows[mode]["reached"]["1.00"] is None
    same = [record["modes"][m]["curve"][-1][2] for m in ("ddp", "ddp fp16", "horovod dense")]
    assert same[0] == pytest.approx(same[2], abs=0.02), same
    topk, dense = rows["topkef"]["link_bytes"], rows["horovod dense"]["link_bytes"]
    assert topk < 0.2 * dense, (topk, dense)
    assert record["load_avg"]["samples"]
    text = (tmp_path / "report.md").read_text()
    assert "| hvd_topk |" in text and "not reached" in text and "horovod dense final - 1 pt" in text
    assert json.loads((tmp_path / "manifest.json").read_text())["command"].startswith(
        "python -m bench.time_to_accuracy")


def test_time_to_a_target_is_the_first_evaluation_at_or_above_it():
    curve = [[10, 4.0, 0.50, 1.0], [20, 8.5, 0.91, 0.3], [30, 12.0, 0.89, 0.3], [40, 16.0, 0.96, 0.1]]
    assert tta.time_to(curve, 0.40) == (4.0, 10)            # reached at the first evaluation
    assert tta.time_to(curve, 0.90) == (8.5, 20)            # the first time, not the last
    assert tta.time_to(curve, 0.96) == (16.0, 40)           # at the target counts
    assert tta.time_to(curve, 0.97) is None                 # never reached
    assert tta.time_to([], 0.1) is None


def _record():
    def mode(curve, step_s):
        return {"steps": curve[-1][0], "step_s": step_s, "bytes": [100.0, 300.0, 200.0], "curve": curve,
                "num_params": 10, "params_identical": True}
    return {"ranks": 2, "model": "wide", "steps": 40, "warmup": 3, "turn": 5, "eval_every": 20, "modes": {
        "horovod dense": mode([[20, 80.0, 0.90, 0.4], [40, 160.0, 0.95, 0.2]], [4.0] * 40),
        "ddp": mode([[20, 82.0, 0.90, 0.4], [40, 164.0, 0.95, 0.2]], [4.1] * 40),
        "topkef": mode([[20, 10.0, 0.85, 0.5], [40, 20.0, 0.945, 0.3]], [0.5] * 40)}}


def test_rows_targets_and_winners():
    rows = {r["label"]: r for r in tta.rows_of(_record(), [0.9, 0.97], "100mbit")}
    names = list(rows["topkef"]["reached"])
    assert names == ["0.90", "0.97", "horovod dense final - 1 pt (0.9400)", "ddp final - 1 pt (0.9400)"]
    assert rows["topkef"]["reached"]["0.90"] == (20.0, 40) and rows["horovod dense"]["reached"]["0.90"] == (80.0, 20)
    assert rows["horovod dense"]["reached"]["0.97"] is None
    assert rows["topkef"]["reached"][names[2]] == (20.0, 40)
    assert rows["topkef"]["step_s"] == 0.5 and rows["topkef"]["link_bytes"] == 200.0
    assert rows["topkef"]["final_accuracy"] == 0.945 and rows["horovod dense"]["train_s"] == 160.0
    won = tta.winners(list(rows.values()))
    assert won == {"0.90": "topkef", "0.97": None, names[2]: "topkef", names[3]: "topkef"}
    text = tta.report(list(rows.values()), _record(), "cmd")
    assert "| topkef | 20.0 s (40) | not reached | 20.0 s (40) |" in text


@pytest.mark.parametrize("argv, match", [
    (["--modes", "ddp,ddp bf16"], "bf16"), (["--modes", "ddp,ddp"], "each once"),
    (["--bandwidth", "10mbit"], "10mbit"), (["--warmup", "2"], "--warmup must be more than 2"),
    (["--steps", "0"], "--steps must be at least 1"), (["--targets", "high"], "--targets takes"),
])
def test_bad_arguments_name_the_flag(capsys, argv, match):
    with pytest.raises(SystemExit):
        tta.parse_args(argv)
    assert match in capsys.readouterr().err
