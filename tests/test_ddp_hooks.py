"""bench.ddp_hooks: PyTorch DDP with no hook, the fp16 hook and torch's PowerSGD hook on Gloo, as rows
beside the Horovod ones: one real 2-rank job over a private loopback, and the rows it derives."""
import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

from bench import ddp_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multirank
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip (network namespace)")
def test_one_real_job_gives_sane_rows_for_every_hook(tmp_path):
    """2 ranks (horovodrun as the launcher, torch.distributed on Gloo) in a fresh namespace, the small
    digits CNN, every mode: 3 steps alone, then 3 rounds of 1 step each. Per step the fp16 hook puts
    about half of dense DDP's bytes on the loopback and PowerSGD (one bucket, from step 2) far fewer,
    more at rank 4 than at rank 2; the parameters are identical on both ranks in every mode."""
    subprocess.run([sys.executable, "-m", "bench.ddp_hooks", "--model", "cnn", "--bandwidth", "unlimited",
                    "--rounds", "3", "--out", str(tmp_path), "--timeout", "240"],
                   cwd=ROOT, check=True, timeout=300, capture_output=True)
    rows = {r["label"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == list(ddp_hooks.MODES)
    dense, fp16, r2, r4 = (rows[m] for m in ddp_hooks.MODES)
    assert all(r["status"] == "ok" and r["params_identical"] and r["ranks"] == 2 for r in rows.values())
    assert all(r["steps"] == 6 and r["measured_steps"] == 3 and r["step_s"] > 0 for r in rows.values())
    # 0.15M fp32 gradients, a ring of 2 ranks: each rank sends about one copy (600 kB) per step
    assert 5.5e5 < dense["link_bytes"] < 7e5, dense["link_bytes"]
    assert 0.45 < fp16["bytes_vs_ddp"] < 0.55, fp16["bytes_vs_ddp"]
    assert r2["link_bytes"] < r4["link_bytes"] < 0.1 * dense["link_bytes"], (r2["link_bytes"], r4["link_bytes"])
    assert r2["powersgd_compression_rate"] > r4["powersgd_compression_rate"] > 5
    assert r4["bucket_cap_mb"] == 1 and dense["bucket_cap_mb"] is None       # the model in one bucket
    assert 0 < dense["test_accuracy"] <= 1 and dense["test_loss"] > 0
    assert json.loads((tmp_path / "manifest.json").read_text())["command"].startswith("python -m bench.ddp_hooks")
    assert "| ddp powersgd r4 |" in (tmp_path / "report.md").read_text()


def _record():
    mode = {"step_s": [0.1, 0.3, 0.2], "bytes": [4000.0, 4000.0, 4200.0], "steps": 6, "bucket_cap_mb": None,
            "params_identical": True, "num_params": 10, "powersgd_compression_rate": None,
            "test_loss": 1.0, "test_accuracy": 0.5}
    return {"example": "digits", "model": "wide", "dataset": "digits", "ranks": 4, "iface": "eth0",
            "powersgd_layout": "one-bucket", "torch": "x",
            "modes": {"ddp": mode, "ddp powersgd r2": {**mode, "bytes": [400.0] * 3, "step_s": [0.05] * 3,
                                                       "powersgd_compression_rate": 20.0}}}


def test_rows_are_medians_per_rank_and_against_dense_ddp():
    rows = {r["label"]: r for r in ddp_hooks.rows_of(_record(), "100mbit", hosts=2)}
    dense, psgd = rows["ddp"], rows["ddp powersgd r2"]
    assert dense["step_s"] == 0.2 and dense["link_bytes"] == 1000 and dense["interhost_bytes"] == 4000
    assert psgd["bytes_vs_ddp"] == pytest.approx(0.1) and psgd["speedup_vs_ddp"] == pytest.approx(4)
    assert psgd["powersgd_layout"] == "one-bucket" and dense["powersgd_layout"] is None
    assert ddp_hooks.rows_of(_record(), "100mbit", hosts=None)[0]["interhost_bytes"] is None
    assert "| digits | 100mbit | 4 | ddp powersgd r2 | 50.0 (50.0-50.0) | 100 | 0.100x | 400 |" in \
        ddp_hooks.report(list(rows.values()), "cmd")


@pytest.mark.parametrize("argv, match", [
    (["--modes", "ddp,ddp bf16"], "bf16"), (["--modes", "ddp,ddp"], "each once"),
    (["--bandwidth", "10mbit"], "10mbit"), (["--warmup", "2"], "--warmup must be more than 2"),
    (["--rounds", "0"], "--rounds must be at least 1"), (["--hosts", "40"], "--hosts must be 0..32"),
])
def test_bad_arguments_name_the_flag(capsys, argv, match):
    with pytest.raises(SystemExit):
        ddp_hooks.parse_args(argv)
    assert match in capsys.readouterr().err


def test_a_failed_job_leaves_its_whole_output_in_the_results_folder(tmp_path):
    from testbed.launch import JobFailed

    output = "[0]<stderr>: the first error\n" + "x" * 10000 + "\n[3]<stderr>: the last line\n"
    ddp_hooks.keep_output(argparse.Namespace(out=str(tmp_path / "res")), JobFailed("job exited with 1", output))
    assert (tmp_path / "res" / "job_failed.log").read_text() == output      # the tail in the exception is not enough
