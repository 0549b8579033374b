"""bench.manifest: the commit a results folder names, in a checkout and in a copy without .git."""
import re

from bench import manifest


def test_checkout_names_its_head():
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", manifest.git_commit())


def test_a_copy_takes_the_commit_its_maker_gives(tmp_path, monkeypatch):
    monkeypatch.delenv("HVD_TOPK_COMMIT", raising=False)
    assert manifest.git_commit(root=str(tmp_path)) is None
    monkeypatch.setenv("HVD_TOPK_COMMIT", "0123abc")
    assert manifest.git_commit(root=str(tmp_path)) == "0123abc"
    assert manifest.git_commit() == "0123abc"          # a copy may carry a stale .git: the maker's word wins
