"""The examples' data readers, non-IID sharding, models, and real 2-rank jobs of examples/digits_cnn.py
(MNIST and CIFAR-10 from small synthetic files in the real formats, digits non-IID with hvd_topk, a
time budget), checked against the JSON contract of examples/common.py; the copyable example
examples/pytorch_digits_topkef.py trained under horovodrun; and no example reaching outside examples/."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from testbed.pytest_jobs import ROOT, Out, OutOf, job

EXAMPLES = os.path.join(ROOT, "examples")
sys.path[:0] = [EXAMPLES, os.path.join(ROOT, "tests", "workers")]

import data  # noqa: E402  (examples/data.py, found through the path above)
from example_data import write_cifar, write_idx, write_mnist  # noqa: E402  (tests/workers/example_data.py)

# The keys the benchmark harness parses (examples/common.py, RunLog.finish).
CONTRACT = {"example", "compression", "optimizer", "ratio", "communication", "ranks", "model", "dataset",
            "non_iid", "num_params", "tensors", "min_numel", "steps", "step_times_s", "link_tx_bytes",
            "curve", "test_loss", "test_accuracy", "wall_s", "params_identical", "bytes_per_rank_per_step",
            "loopback_tx_bytes", "hvd_topk_stats"}


# -- readers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reader_round_trip(tmp_path, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    x_train, y_train, x_test, y_test = data.load_dataset("mnist", str(tmp_path))
    assert x_train.shape == (96, 1, 28, 28) and x_test.shape == (32, 1, 28, 28)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    assert torch.equal(y_train, torch.from_numpy(arrays["train_labels"]))
    assert torch.equal(y_test, torch.from_numpy(arrays["test_labels"]))
    pixels = x_test[:, 0] * data.MNIST_STD + data.MNIST_MEAN        # back to [0, 1]
    torch.testing.assert_close(pixels, torch.from_numpy(arrays["test_images"] / 255.0).float(),
                               rtol=0, atol=1e-6)


def test_mnist_reader_finds_torchvision_layout(tmp_path):
    write_mnist(tmp_path / "MNIST" / "raw", gz=True)
    assert data.load_dataset("mnist", str(tmp_path))[0].shape == (96, 1, 28, 28)


def test_idx_reader_checks_header_and_size(tmp_path):
    path = str(tmp_path / "images")
    write_idx(path, np.zeros((4, 28, 28)))
    assert data.read_idx(path, ndim=3).shape == (4, 28, 28)
    with pytest.raises(ValueError, match=r"3 dimensions \(magic 0x00000803\), expected 1"):
        data.read_idx(path, ndim=1)                                 # an image file where labels belong
    raw = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(b"\x01" + raw[1:])                       # bad magic
    with pytest.raises(ValueError, match=re.escape(path) + ": not an IDX file"):
        data.read_idx(path)
    pathlib.Path(path).write_bytes(raw[:-5])                                # truncated data
    with pytest.raises(ValueError, match=re.escape(path) + ": IDX dimensions .*truncated"):
        data.read_idx(path)
    pathlib.Path(path).write_bytes(raw[:6])                                 # truncated header
    with pytest.raises(ValueError, match=re.escape(path) + ": truncated IDX header"):
        data.read_idx(path)
    gz = str(tmp_path / "images.gz")
    write_idx(gz, np.zeros((4, 28, 28)), gz=True)
    raw_gz = pathlib.Path(gz).read_bytes()
    pathlib.Path(gz).write_bytes(raw_gz[:30])                               # truncated gzip
    with pytest.raises(ValueError, match=re.escape(gz) + ": not a valid gzip"):
        data.read_idx(gz)


def test_mnist_reader_checks_pairs_and_missing_files(tmp_path):
    write_mnist(tmp_path)
    write_idx(str(tmp_path / "t10k-labels-idx1-ubyte"), np.zeros(31))      # 32 images, 31 labels
    with pytest.raises(ValueError, match="32 images but .* 31 labels"):
        data.load_dataset("mnist", str(tmp_path))
    os.remove(tmp_path / "t10k-labels-idx1-ubyte")
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte: missing.*IDX"):
        data.load_dataset("mnist", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="give --data-dir"):
        data.load_dataset("mnist", None)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        data.load_dataset("cifar10", str(tmp_path / "nowhere"))


def test_cifar_reader_round_trip(tmp_path):
    written = write_cifar(tmp_path / "cifar-10-batches-bin")       # the tarball's folder is found too
    x_train, y_train, x_test, y_test = data.load_dataset("cifar10", str(tmp_path))
    assert x_train.shape == (80, 3, 32, 32) and x_test.shape == (16, 3, 32, 32)
    train_labels = np.concatenate([written[n][1] for n in data.CIFAR_TRAIN])
    assert torch.equal(y_train, torch.from_numpy(train_labels.astype(np.int64)))
    pixels, labels = written[data.CIFAR_TEST]
    assert torch.equal(y_test, torch.from_numpy(labels.astype(np.int64)))
    mean = torch.tensor(data.CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(data.CIFAR_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(x_test * std + mean, torch.from_numpy(pixels / 255.0).float(),
                               rtol=0, atol=1e-6)                  # channel planes in R, G, B order


def test_cifar_reader_rejects_bad_files(tmp_path):
    write_cifar(tmp_path)
    path = str(tmp_path / "data_batch_2.bin")
    raw = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(raw[:-1])                                # truncated record
    with pytest.raises(ValueError, match=re.escape(path) + ": .* not a whole number of CIFAR-10 records"):
        data.load_dataset("cifar10", str(tmp_path))
    pathlib.Path(path).write_bytes(b"\x0b" + raw[1:])                       # label 11
    with pytest.raises(ValueError, match=re.escape(path) + ": label byte 11"):
        data.load_dataset("cifar10", str(tmp_path))
    os.remove(path)
    with pytest.raises(FileNotFoundError, match="data_batch_2.bin: missing.*3073-byte records"):
        data.load_dataset("cifar10", str(tmp_path))


def test_digits_split_is_the_published_one():
    x_train, y_train, x_test, y_test = data.load_dataset("digits")
    assert x_train.shape == (1438, 1, 8, 8) and x_test.shape == (359, 1, 8, 8)
    assert 0 <= x_train.min() and x_train.max() <= 1


def test_digits_are_scikit_learns_to_the_bit_without_importing_it():
    """Read from the file scikit-learn ships, with numpy alone: the same tensors as from
    ``sklearn.datasets.load_digits`` (in the same split), and scikit-learn never imported."""
    code = ("import sys, torch; sys.path.insert(0, 'examples'); import data; "
            "loaded = data.load_dataset('digits'); assert 'sklearn' not in sys.modules, 'sklearn imported'; "
            "from sklearn.datasets import load_digits; d = load_digits(); "
            "x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0; y = torch.tensor(d.target); "
            "o = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234)); n = len(y) // 5; "
            "want = (x[o[n:]], y[o[n:]], x[o[:n]], y[o[:n]]); "
            "assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(loaded, want)), 'differs'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# -- non-IID sharding ------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 3, 4])
def test_shards_are_skewed_equal_disjoint_and_deterministic(size):
    per_class = 100
    labels = torch.arange(10).repeat_interleave(per_class)[torch.randperm(1000, generator=torch.Generator()
                                                                          .manual_seed(5))]
    parts = data.shard_partition(labels, size, shards_per_rank=2, seed=3)
    n_shards = 2 * size
    shard_len = 1000 // n_shards
    assert [len(p) for p in parts] == [2 * shard_len] * size       # same steps per epoch on every rank
    union = torch.cat(parts)
    assert len(torch.unique(union)) == len(union) == 1000 - 1000 % n_shards   # disjoint, all but remainder
    # Skew as documented: a shard is a contiguous run of the label-sorted order, so it holds at most
    # ceil(shard_len / per_class) + 1 labels, and a rank at most twice that; never all 10 at these sizes.
    bound = 2 * (-(-shard_len // per_class) + 1)
    for part in parts:
        hist = data.label_histogram(labels[part])
        present = sum(c > 0 for c in hist)
        assert present <= min(bound, 9), hist
    again = data.shard_partition(labels, size, shards_per_rank=2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))


def test_shards_of_the_digits_training_set():
    _, y_train, _, _ = data.load_dataset("digits")
    parts = data.shard_partition(y_train, 2)
    hists = [data.label_histogram(y_train[p]) for p in parts]
    assert all(sum(c > 0 for c in h) <= 6 for h in hists), hists  # each of 2 ranks misses >= 4 labels
    assert len(parts[0]) == len(parts[1]) == 1438 // 4 * 2


def test_shards_reject_bad_arguments():
    with pytest.raises(ValueError, match=">= 1"):
        data.shard_partition(torch.zeros(10, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="non-empty shards"):
        data.shard_partition(torch.zeros(3, dtype=torch.int64), 2)


# -- models ----------------------------------------------------------------------------------------
def test_model_sizes_and_input_shapes():
    import digits_cnn                                              # parses no flags when imported
    sizes = {}
    for name in ("cnn", "wide", "resnet18"):
        for channels, hw in ((1, 8), (1, 28), (3, 32)):
            torch.manual_seed(0)
            model = digits_cnn.build_model(name, channels)
            assert model(torch.randn(2, channels, hw, hw)).shape == (2, 10)
            sizes[name, channels] = sum(p.numel() for p in model.parameters())
    assert sizes["cnn", 1] == 151306                               # the original digits CNN
    assert sizes["wide", 1] >= 5_000_000
    assert 10_500_000 <= sizes["resnet18", 3] <= 12_000_000
    assert [n for n, _ in digits_cnn.build_model("cnn", 1).named_parameters()] == \
        ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias",
         "fc2.weight", "fc2.bias"]


# -- real 2-rank jobs ------------------------------------------------------------------------------
# examples/digits_cnn.py run as a user runs it (its own flags, a JSON result), the jobs in one launch;
# the first writes the synthetic MNIST and CIFAR-10 files the others read.
SYNTHETIC_DATA = job(2, "example_data.py")


def digits_job(*flags):
    return job(2, "examples/digits_cnn.py", "--quiet", "--json-out", Out("result.json"), *flags, timeout=150)


MNIST = digits_job("--dataset", "mnist", "--data-dir", OutOf(SYNTHETIC_DATA, "mnist"), "--max-steps", 5,
                   "--eval-every", 2, "--compression", "topkef", "--groups", 2)
CIFAR10 = digits_job("--dataset", "cifar10", "--data-dir", OutOf(SYNTHETIC_DATA, "cifar"), "--model", "resnet18",
                     "--batch-size", 8, "--max-steps", 2, "--compression", "none")
NON_IID = digits_job("--non-iid", "--compression", "hvd_topk", "--max-steps", 12, "--eval-every", 5,
                     "--tensorboard", Out("tb"))
TIME_BUDGET = digits_job("--time-budget", 1.0, "--epochs", 100, "--compression", "topkef")
LOW_RANK = {door: digits_job("--compression", door, "--powersgd-rank", 2, "--max-steps", 8, "--eval-every", 4)
            for door in ("powersgd", "hvd_topk_powersgd")}


def digits_result(results, digits):
    return json.loads(results.path(digits, "result.json").read_text())


def check_contract(res, steps=None):
    """The JSON keys of the contract and their consistency."""
    assert CONTRACT <= set(res), CONTRACT - set(res)
    assert res["example"] == "digits_cnn" and res["ranks"] == 2
    assert res["params_identical"] is True
    assert len(res["step_times_s"]) == len(res["link_tx_bytes"]) == res["steps"] > 0
    assert steps is None or res["steps"] == steps
    assert all(t > 0 for t in res["step_times_s"]) and all(b >= 0 for b in res["link_tx_bytes"])
    assert res["curve"] and res["curve"][-1]["step"] == res["steps"]
    assert set(res["curve"][0]) == {"step", "epoch", "wall_s", "test_loss", "test_acc"}
    assert res["curve"][-1]["test_acc"] == res["test_accuracy"]
    assert res["num_params"] == sum(n for _, n, _ in res["tensors"])
    assert res["loopback_tx_bytes"] >= sum(res["link_tx_bytes"]) > 0
    assert res["bytes_per_rank_per_step"] == pytest.approx(res["loopback_tx_bytes"] / 2 / res["steps"])


@pytest.mark.jobs(MNIST)
def test_job_mnist_from_idx_files(results):
    res = digits_result(results, MNIST)
    check_contract(res, steps=5)
    assert (res["dataset"], res["model"], res["non_iid"], res["ratio"], res["groups"]) == ("mnist", "cnn", False,
                                                                                        0.01, 2)
    assert [p["step"] for p in res["curve"]] == [2, 4, 5]
    assert res["hvd_topk_stats"] is None


@pytest.mark.jobs(CIFAR10)
def test_job_cifar10_resnet18(results):
    res = digits_result(results, CIFAR10)
    check_contract(res, steps=2)
    assert (res["dataset"], res["model"], res["ratio"], res["communication"]) == \
        ("cifar10", "resnet18", None, "dense")
    assert 10_500_000 <= res["num_params"] <= 12_000_000


@pytest.mark.jobs(NON_IID)
def test_job_digits_non_iid_hvd_topk(results):
    res = digits_result(results, NON_IID)
    check_contract(res, steps=12)
    assert res["non_iid"] is True and res["compression"] == "hvd_topk"
    assert isinstance(res["hvd_topk_stats"], dict) and "bytes_sent" in res["hvd_topk_stats"]
    hists = [json.loads(line.split("label histogram ")[1]) for line in results.run(NON_IID).output.splitlines()
             if "label histogram" in line]
    assert len(hists) == 2 and all(sum(c > 0 for c in h) <= 6 for h in hists), hists
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(results.path(NON_IID, "tb")))


@pytest.mark.jobs(TIME_BUDGET)
def test_job_time_budget_stops_every_rank_at_the_same_step(results):
    res = digits_result(results, TIME_BUDGET)
    check_contract(res)                           # identical parameters: both ranks ran the same steps
    assert res["steps"] < 100 * 44
    assert res["wall_s"] >= 1.0


@pytest.mark.jobs(*LOW_RANK.values())
def test_job_digits_low_rank_through_both_doors(results):
    """--compression powersgd (stock Horovod) and hvd_topk_powersgd (hvd_topk's optimizer) train with
    PowerSGD at the rank asked, and both doors, one transport, give the same test curve to the bit."""
    stock, ours = (digits_result(results, LOW_RANK[door]) for door in ("powersgd", "hvd_topk_powersgd"))
    for res in (stock, ours):
        check_contract(res, steps=8)
        assert (res["communication"], res["powersgd_rank"], res["ratio"]) == ("lowrank", 2, None)
    assert stock["hvd_topk_stats"] is None and "bytes_sent" in ours["hvd_topk_stats"]
    assert [p["test_loss"] for p in stock["curve"]] == [p["test_loss"] for p in ours["curve"]]


def test_missing_data_files_fail_with_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "digits_cnn.py"), "--dataset", "cifar10",
                           "--data-dir", str(tmp_path), "--quiet"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "data_batch_1.bin: missing" in proc.stderr and "CIFAR-10 binary version" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--compression", "topkef", "--dense-steps", "3"], "--dense-steps needs --compression hvd_topk"),
    (["--compression", "powersgd", "--compress", "update"], "need --compression hvd_topk or hvd_topk_powersgd"),
    (["--compression", "topkef", "--powersgd-rank", "2"], "--powersgd-rank needs --compression powersgd"),
])
def test_hvd_topk_flags_without_hvd_topk_are_a_usage_error(flags, message):
    """A flag only hvd_topk.DistributedOptimizer (or low rank) has, given to a door without it, stops the
    run before any training with argparse's usage error, naming the flags."""
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "digits_cnn.py"), *flags, "--quiet"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert flags[2] in proc.stderr and message in proc.stderr


# -- the examples stand alone ----------------------------------------------------------------------
def test_examples_stand_alone():
    """What a user copies runs from its own folder: no example edits sys.path or imports bench/ (the
    repository's tooling, not part of the package)."""
    for name in sorted(os.listdir(EXAMPLES)):
        if name.endswith(".py"):
            source = pathlib.Path(EXAMPLES, name).read_text()
            assert not re.search(r"sys\.path\s*(\.\w+\(|\[|\+?=)", source), f"examples/{name} edits sys.path"
            assert not re.search(r"^\s*(from|import) bench\b", source, re.M), f"examples/{name} imports bench"


# -- the copyable example --------------------------------------------------------------------------
COPYABLE = os.path.join(EXAMPLES, "pytorch_digits_topkef.py")


def test_copyable_example_is_one_screen():
    """The example to copy stays one screen, with TopKEF in Horovod's own optimizer."""
    source = pathlib.Path(COPYABLE).read_text()
    assert len(source.splitlines()) <= 60
    assert "hvd.DistributedOptimizer(" in source and "compression=TopKEF(" in source


@pytest.mark.slow       # horovodrun of its own; the fast loop trains examples/digits_cnn.py in shared launches
@pytest.mark.multirank
def test_copyable_example_trains_with_identical_parameters():
    """horovodrun -np 2 --gloo python examples/pytorch_digits_topkef.py, as its docstring launches it
    (4 epochs): the averaged test accuracy ends far above chance (0.1) and both ranks print the same
    checksum of their parameters."""
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"   # the venv's
    argv = [horovodrun, "-np", "2", "--gloo", sys.executable, COPYABLE, "--epochs", "4"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        import psutil
        for child in psutil.Process(proc.pid).children(recursive=True):   # the ranks: sessions of their own
            child.kill()
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail(f"no result in 150 s:\n{text[-3000:]}")
    assert proc.returncode == 0, text[-3000:]
    accuracies = [float(a) for a in re.findall(r"epoch \d+/4: test accuracy ([\d.]+)", text)]
    checksums = dict(re.findall(r"rank (\d): parameters sha256 (\w+)", text))
    print(f"\ncopyable example, 2 ranks: test accuracy per epoch {accuracies}, checksums {checksums}")
    assert len(accuracies) == 4 and accuracies[-1] >= 0.85, text[-3000:]
    assert set(checksums) == {"0", "1"} and checksums["0"] == checksums["1"], checksums
