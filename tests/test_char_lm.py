"""examples/char_lm.py: corpus, --data errors, the model's causality and size, non-IID slices, and real
2-rank jobs (TopKEF in stock Horovod; hvd_topk.DistributedOptimizer with --non-iid)."""
import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from testbed.pytest_jobs import Out, job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "char_lm.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import char_lm  # noqa: E402  (examples/ is not a package; the script imports common the same way)


def test_default_corpus_is_large_and_deterministic():
    data, name = char_lm.load_corpus(None, block_size=128)
    assert name == char_lm.DEFAULT_CORPUS
    assert data.dtype == torch.uint8 and len(data) >= 200_000
    again = char_lm.default_corpus()
    assert hashlib.sha256(data.numpy().tobytes()).digest() == hashlib.sha256(again).digest()
    assert again.startswith(b".. _breast_cancer_dataset:")   # sklearn's descr/*.rst first, sorted
    train, val = char_lm.split_train_val(data)
    assert len(train) + len(val) == len(data) and len(val) == pytest.approx(0.1 * len(data), abs=1)


def test_data_file_is_used_as_bytes(tmp_path):
    raw = bytes(range(256)) * 20
    path = tmp_path / "corpus.bin"
    path.write_bytes(raw)
    data, name = char_lm.load_corpus(str(path), block_size=64)
    assert name == str(path) and data.numpy().tobytes() == raw


@pytest.mark.parametrize("block,slices", [(128, 1), (64, 1), (128, 20)])
def test_shortest_accepted_file_holds_every_window(tmp_path, block, slices):
    need = char_lm.min_corpus_bytes(block, slices)
    path = tmp_path / "c.txt"
    path.write_bytes(b"x" * need)
    data, _ = char_lm.load_corpus(str(path), block, slices)
    train, val = char_lm.split_train_val(data)
    assert len(val) >= block + 1
    for r in range(slices):
        lo, hi = char_lm.rank_slice(len(train), r, slices)
        assert hi - lo >= block + 1
    # one byte less: the validation part or some rank's slice is shorter than a window
    train, val = char_lm.split_train_val(torch.zeros(need - 1, dtype=torch.uint8))
    assert min([len(val)] + [hi - lo for lo, hi in (char_lm.rank_slice(len(train), r, slices)
                                                    for r in range(slices))]) == block
    path.write_bytes(b"x" * (need - 1))
    with pytest.raises(ValueError, match=f"--data .*need at least {need} bytes"):
        char_lm.load_corpus(str(path), block, slices)


def test_missing_and_empty_files_name_data(tmp_path):
    with pytest.raises(ValueError, match="--data .*no such file"):
        char_lm.load_corpus(str(tmp_path / "nope.txt"), 128)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="--data .*empty"):
        char_lm.load_corpus(str(tmp_path / "empty.txt"), 128)


def test_cli_reports_a_short_file_and_the_length_needed(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"too short")
    proc = subprocess.run([sys.executable, SCRIPT, "--data", str(path), "--quiet"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert f"--data {path}: 9 bytes is too short" in proc.stderr
    assert f"need at least {char_lm.min_corpus_bytes(128)} bytes" in proc.stderr


def test_model_is_causal():
    torch.manual_seed(0)
    model = char_lm.GPT(n_layer=2, n_head=4, d_model=32, block_size=24).eval()
    x = torch.randint(0, 256, (3, 24))
    t = 10
    y = x.clone()
    y[:, t:] = (y[:, t:] + 1) % 256   # change position t and everything after it
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t], b[:, t])


def test_default_model_size():
    args = char_lm.build_parser().parse_args([])
    assert (args.n_layer, args.n_head, args.d_model, args.block_size) == (4, 4, 128, 128)
    model = char_lm.GPT(args.n_layer, args.n_head, args.d_model, args.block_size)
    d, layers = 128, 4
    # token + position embeddings, per block 12 d^2 + 13 d (qkv, proj, MLP, two LayerNorms), ln_f;
    # the head shares the token embedding.
    expected = 256 * d + 128 * d + layers * (12 * d * d + 13 * d) + 2 * d
    assert sum(p.numel() for p in model.parameters()) == expected == 842_496
    untied = char_lm.GPT(args.n_layer, args.n_head, args.d_model, args.block_size, tie_weights=False)
    assert sum(p.numel() for p in untied.parameters()) == expected + 256 * d


@pytest.mark.parametrize("size", [2, 3, 4])
def test_non_iid_windows_of_different_ranks_are_disjoint(size):
    n, block = 10_007, 32
    covered = []
    for rank in range(size):
        lo, hi = char_lm.rank_slice(n, rank, size)
        gen = torch.Generator().manual_seed(rank)
        starts = char_lm.window_starts(lo, hi, block, 2000, gen)
        assert starts.min() >= lo and (starts + block + 1).max() <= hi
        idx = (starts[:, None] + torch.arange(block + 1)).unique()
        covered.append(set(idx.tolist()))
        if rank > 0:
            assert lo == char_lm.rank_slice(n, rank - 1, size)[1]   # contiguous, in rank order
    assert char_lm.rank_slice(n, 0, size)[0] == 0 and char_lm.rank_slice(n, size - 1, size)[1] == n
    for a in range(size):
        for b in range(a + 1, size):
            assert not covered[a] & covered[b]
    # IID: one rank's windows span the whole text
    iid = char_lm.window_starts(0, n, block, 2000, torch.Generator().manual_seed(0))
    assert iid.min() < n // size and iid.max() > n - n // size


def test_validation_windows_are_fixed():
    a = char_lm.eval_starts(5000, 128, 64)
    assert torch.equal(a, char_lm.eval_starts(5000, 128, 64)) and len(a) == 64
    assert a.min() == 0 and a.max() == 5000 - 129


TWO_RANK_FLAGS = [["--compression", "topkef"],
                  ["--compression", "hvd_topk", "--non-iid"],
                  ["--compression", "hvd_topk", "--compress", "update", "--dense-steps", "5", "--local-momentum", "off",
                   "--second-moment", "frozen", "--communication", "allgather"]]


@pytest.mark.parametrize("flags,lm_job", [
    (flags, job(2, "examples/char_lm.py", "--quiet", "--max-steps", 10, "--eval-every", 5, "--batch-size", 8,
                "--eval-windows", 32, "--json-out", Out("result.json"), *flags)) for flags in TWO_RANK_FLAGS],
    ids=["topkef", "hvd_topk-non-iid", "update"])
def test_two_rank_job(results, flags, lm_job):
    """The three 2-rank jobs share a launch. Ten steps bring the test loss to 4.75-4.92 (measured), well
    under the bound, ln 256 - 0.25 = 5.29; 20 steps cost 3 s more each."""
    r = json.loads(results.path(lm_job, "result.json").read_text())
    assert r["example"] == "char_lm" and r["compression"] == flags[1] and r["ranks"] == 2
    assert r["dataset"] == char_lm.DEFAULT_CORPUS and r["model"] == "gpt-4x128"
    assert r["non_iid"] == ("--non-iid" in flags) and r["test_accuracy"] is None
    assert r["params_identical"] is True
    assert r["compress"] == ("update" if "update" in flags else "gradient" if "hvd_topk" in flags else None)
    assert r["local_momentum"] == ("off" if "off" in flags else "on" if "hvd_topk" in flags else None)
    assert r["second_moment"] == ("frozen" if "frozen" in flags else "local" if "hvd_topk" in flags else None)
    assert r["steps"] == 10 and len(r["step_times_s"]) == 10
    assert [p["step"] for p in r["curve"]] == [5, 10]
    assert math.isfinite(r["test_loss"]) and r["test_loss"] < math.log(256) - 0.25
    assert r["test_loss"] == r["curve"][-1]["test_loss"]
