"""Datasets of the examples, read with numpy from the files their publishers ship, and non-IID sharding.

- digits: scikit-learn's shipped 8x8 digits (1797 images, built in; nothing to download).
- mnist: the IDX files from http://yann.lecun.com/exdb/mnist/ (train-images-idx3-ubyte,
  train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte; plain or .gz), in
  --data-dir or its MNIST/raw/ (torchvision's layout).
- cifar10: the binary version from https://www.cs.toronto.edu/~kriz/cifar.html (data_batch_1.bin ..
  data_batch_5.bin, test_batch.bin: records of 1 label byte + 3072 pixel bytes, the red, green and
  blue 32x32 planes), in --data-dir or its cifar-10-batches-bin/.

Every loader returns float32 images (N, C, H, W), normalised, and int64 labels.
"""
import gzip
import importlib.util
import os
import zlib

import numpy as np
import torch

__all__ = ["load_dataset", "read_idx", "read_mnist", "read_cifar10_batch", "read_cifar10",
           "shard_partition", "label_histogram", "DATASETS"]

DATASETS = ("digits", "mnist", "cifar10")
MNIST_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
               "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
CIFAR_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR_TEST = "test_batch.bin"
CIFAR_RECORD = 1 + 3 * 32 * 32
# Usual normalisation constants (training-set mean and standard deviation of the pixels in [0, 1]).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IDX_UBYTE = 0x08


def load_dataset(name, data_dir=None):
    """(x_train, y_train, x_test, y_test) of dataset ``name``.

    Args:
        name: ``"digits"`` (built in), ``"mnist"`` or ``"cifar10"`` (read from ``data_dir``).
        data_dir: folder holding the dataset's files (see the module docstring).

    Returns:
        float32 tensors (N, C, H, W) of normalised pixels and int64 label tensors (N,).

    Raises:
        FileNotFoundError: a file is missing (its name and the expected format in the message).
        ValueError: a file is not in the expected format (the file named in the message).
    """
    if name == "digits":
        return _digits()
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    if not data_dir:
        raise FileNotFoundError(f"--dataset {name} reads the real files: give --data-dir "
                                f"({_expected(name)})")
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"--data-dir {data_dir}: no such folder ({_expected(name)})")
    if name == "mnist":
        return read_mnist(data_dir)
    return read_cifar10(data_dir)


def _digits():
    """scikit-learn's 8x8 digits, pixels / 16, a fixed 80/20 split (the split the results were made with).

    Read with numpy from the file scikit-learn ships (its ``datasets/data/digits.csv.gz``: per image 64
    pixels, then the label), as ``sklearn.datasets.load_digits`` reads it, to the same bits; but without
    importing scikit-learn, whose import (with scipy's) costs every rank ~1.7 s of CPU, far more than
    reading 1797 images."""
    table = _sklearn_digits_table()
    x = torch.tensor(table[:, :-1].reshape(-1, 1, 8, 8), dtype=torch.float32) / 16.0
    y = torch.tensor(table[:, -1].astype(np.int64))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    n_test = len(y) // 5
    return x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]


def _sklearn_digits_table():
    """The rows of scikit-learn's shipped digits.csv.gz, float64, found without importing the package."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise FileNotFoundError("--dataset digits reads scikit-learn's shipped digits: pip install scikit-learn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=",")


def _expected(name):
    """One line saying which files a dataset needs."""
    if name == "mnist":
        return ("MNIST IDX files: " + ", ".join(MNIST_FILES.values()) + " (plain or .gz)")
    return ("CIFAR-10 binary version: " + ", ".join(CIFAR_TRAIN + (CIFAR_TEST,)) +
            f" ({CIFAR_RECORD}-byte records: 1 label byte + 3072 pixel bytes)")


def _find(data_dir, filename, subdirs, dataset):
    """Path of ``filename`` (or ``filename.gz`` for MNIST) in data_dir or one of its subdirs."""
    candidates = [filename, filename + ".gz"] if dataset == "mnist" else [filename]
    for folder in (data_dir, *(os.path.join(data_dir, s) for s in subdirs)):
        for c in candidates:
            path = os.path.join(folder, c)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(f"{os.path.join(data_dir, filename)}: missing; --dataset {dataset} "
                            f"expects the {_expected(dataset)}")


def _read_bytes(path):
    """The file's bytes, gunzipped when it ends in .gz; a damaged gzip raises ValueError."""
    if not path.endswith(".gz"):
        with open(path, "rb") as f:
            return f.read()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:    # BadGzipFile is an OSError; truncated: EOFError
        raise ValueError(f"{path}: not a valid gzip file ({e})") from e


def read_idx(path, ndim=None):
    """Read an IDX file of unsigned bytes (the MNIST format) into a numpy uint8 array.

    Header: two zero bytes, the type code 0x08 (unsigned byte), the number of dimensions, then each
    dimension as a big-endian uint32; the data follows, exactly prod(dims) bytes.

    Args:
        path: the file (``.gz``: gunzipped first).
        ndim: the number of dimensions expected (3 for images, 1 for labels), or None for any.

    Raises:
        ValueError: naming the file, when the magic number, the dimensions or the size is wrong.
    """
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != IDX_UBYTE:
        expected = f"0x{0x800 + ndim:08x}" if ndim is not None else "0x000008 and the number of dimensions"
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic number "
                         f"{'0x' + raw[:4].hex() if raw else 'missing: empty file'}, expected {expected})")
    dims_n = raw[3]
    if ndim is not None and dims_n != ndim:
        raise ValueError(f"{path}: IDX file with {dims_n} dimensions (magic 0x{raw[:4].hex()}), expected "
                         f"{ndim} (magic 0x{0x800 + ndim:08x})")
    header = 4 + 4 * dims_n
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, expected {header})")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=dims_n, offset=4))
    size = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != size:
        raise ValueError(f"{path}: IDX dimensions {dims} need {size} data bytes, the file has "
                         f"{len(raw) - header} (truncated or not IDX)")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _mnist_pair(images_path, labels_path):
    """Normalised images (N, 1, H, W) and labels (N,) from one IDX image file and its label file."""
    images, labels = read_idx(images_path, ndim=3), read_idx(labels_path, ndim=1)
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise ValueError(f"{labels_path}: label {labels.max()} out of range 0..9")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return (x - MNIST_MEAN) / MNIST_STD, torch.from_numpy(labels.astype(np.int64))


def read_mnist(data_dir):
    """(x_train, y_train, x_test, y_test) from MNIST's four IDX files in data_dir (or data_dir/MNIST/raw)."""
    path = {k: _find(data_dir, f, ["MNIST/raw", "raw"], "mnist") for k, f in MNIST_FILES.items()}
    x_train, y_train = _mnist_pair(path["train_images"], path["train_labels"])
    x_test, y_test = _mnist_pair(path["test_images"], path["test_labels"])
    return x_train, y_train, x_test, y_test


def read_cifar10_batch(path):
    """One CIFAR-10 binary batch: uint8 images (N, 3, 32, 32) and uint8 labels (N,).

    Raises:
        ValueError: naming the file, when its size is not a whole number of 3073-byte records or a
            label is not in 0..9.
    """
    raw = _read_bytes(path)
    if len(raw) == 0 or len(raw) % CIFAR_RECORD:
        raise ValueError(f"{path}: {len(raw)} bytes is not a whole number of CIFAR-10 records "
                         f"({CIFAR_RECORD} bytes each: 1 label byte + 3072 pixel bytes; truncated?)")
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, CIFAR_RECORD)
    labels = records[:, 0]
    if labels.max() > 9:
        raise ValueError(f"{path}: label byte {labels.max()} out of range 0..9 (not a CIFAR-10 batch?)")
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def _cifar_tensors(batches):
    """Normalised float images and int64 labels from a list of (images, labels) batches."""
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return (x - mean) / std, torch.from_numpy(labels.astype(np.int64))


def read_cifar10(data_dir):
    """(x_train, y_train, x_test, y_test) from CIFAR-10's binary batches in data_dir (or its
    cifar-10-batches-bin/)."""
    sub = ["cifar-10-batches-bin"]
    train = [read_cifar10_batch(_find(data_dir, f, sub, "cifar10")) for f in CIFAR_TRAIN]
    test = [read_cifar10_batch(_find(data_dir, CIFAR_TEST, sub, "cifar10"))]
    return (*_cifar_tensors(train), *_cifar_tensors(test))


def shard_partition(labels, size, shards_per_rank=2, seed=0):
    """Non-IID split of a training set over ``size`` ranks: McMahan et al.'s label shards.

    The sample indices are sorted by label (ties in a seeded random order), cut into
    ``size * shards_per_rank`` shards of equal length, and the shards dealt out in a seeded random
    order, ``shards_per_rank`` per rank. Each rank thus sees a few labels only (with 2 shards per
    rank: about 2 * (classes / (2 * size)) labels each, fewer as size grows), all ranks get the same
    number of samples (so the same number of steps per epoch), the ranks' sets are disjoint, and
    their union is the whole set except the last ``len(labels) % (size * shards_per_rank)`` samples of
    the sorted order. Pure and deterministic: every rank computes every rank's part identically.

    Args:
        labels: 1-D int tensor or array of the training labels.
        size: number of ranks, >= 1.
        shards_per_rank: shards per rank, >= 1 (McMahan et al.: 2).
        seed: seed of the tie order and of the dealing.

    Returns:
        A list of ``size`` int64 tensors: rank r's sample indices.

    Example:
        >>> parts = shard_partition(y_train, hvd.size())
        >>> mine = parts[hvd.rank()]
    """
    if size < 1 or shards_per_rank < 1:
        raise ValueError(f"size and shards_per_rank must be >= 1, got {size} and {shards_per_rank}")
    labels = torch.as_tensor(labels).reshape(-1)
    n_shards = size * shards_per_rank
    shard_len = len(labels) // n_shards
    if shard_len == 0:
        raise ValueError(f"{len(labels)} samples cannot be cut into {n_shards} non-empty shards")
    g = torch.Generator().manual_seed(seed)
    tie_order = torch.randperm(len(labels), generator=g)
    order = tie_order[torch.argsort(labels[tie_order], stable=True)]
    shards = order[:n_shards * shard_len].view(n_shards, shard_len)
    deal = torch.randperm(n_shards, generator=g).view(size, shards_per_rank)
    return [shards[deal[r]].reshape(-1).clone() for r in range(size)]


def label_histogram(labels, num_classes=10):
    """Count of each label 0..num_classes-1, as a list of ints."""
    return torch.bincount(torch.as_tensor(labels).reshape(-1), minlength=num_classes).tolist()
