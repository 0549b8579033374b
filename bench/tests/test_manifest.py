"""bench/manifest.py: the commit a results folder names, in a checkout and in a copy without .git, and
the command as the harness's command line records it."""
import json
import os
import re
import sys

from bench import manifest


def test_checkout_names_its_head():
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", manifest.git_commit())


def test_a_copy_takes_the_commit_its_maker_gives(tmp_path, monkeypatch):
    monkeypatch.delenv("HVD_TOPK_COMMIT", raising=False)
    assert manifest.git_commit(root=str(tmp_path)) is None
    monkeypatch.setenv("HVD_TOPK_COMMIT", "0123abc")
    assert manifest.git_commit(root=str(tmp_path)) == "0123abc"
    assert manifest.git_commit() == "0123abc"          # a copy may carry a stale .git: the maker's word wins


def test_the_command_of_python_dash_m_bench(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name in manifest.MEASURED_ENV or name.startswith(manifest.MEASURED_ENV_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", [f"{manifest.ROOT}/bench/__main__.py", "scale", "--alpha", "1e-3"])
    assert manifest.manifest()["command"] == "python -m bench scale --alpha 1e-3"
    monkeypatch.setenv("HVD_TOPK_SPIN_WAIT", "1")           # what the run measured depends on these
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "20")
    monkeypatch.setenv("HVD_TOPK_VENV", "/elsewhere")        # where the venv is: not recorded
    assert manifest.manifest()["command"] == \
        "HOROVOD_CYCLE_TIME=20 HVD_TOPK_SPIN_WAIT=1 python -m bench scale --alpha 1e-3"
    path = manifest.write_manifest(str(tmp_path / "out"), "python -m bench run --task cnn")
    facts = json.loads(open(path).read())
    assert facts["command"] == "python -m bench run --task cnn" and facts["machine"]["cores"] >= 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", facts["date"])
