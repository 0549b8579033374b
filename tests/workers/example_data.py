"""Small synthetic MNIST and CIFAR-10 files in the real formats, for tests/test_examples.py.

Imported, it gives the writers (``write_idx``, ``write_mnist``, ``write_cifar``) to the tests of the
readers; run as a job's worker, rank 0 writes ``<out>/mnist`` (gzipped IDX, 200 training images) and
``<out>/cifar`` (the six binary batches) and every rank waits for it, so that the examples' jobs after it
in the launch read them (``OutOf(data_job, "mnist")``). The file names are the published datasets', as
a user's download holds them, written here independently of examples/data.py.
"""
import argparse
import gzip
import os
import struct

import numpy as np

MNIST_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
               "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
CIFAR_BATCHES = (*(f"data_batch_{i}.bin" for i in range(1, 6)), "test_batch.bin")


def write_idx(path, array, gz=False):
    """An IDX file of unsigned bytes (magic 0x0000 08 ndim, big-endian uint32 dims, the data)."""
    array = np.asarray(array, dtype=np.uint8)
    raw = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw += array.tobytes()
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(raw)


def write_mnist(folder, n_train=96, n_test=32, gz=False, seed=0):
    """The four MNIST files (28x28) with random pixels and labels; returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {"train_images": rng.integers(0, 256, (n_train, 28, 28)),
              "train_labels": rng.integers(0, 10, n_train),
              "test_images": rng.integers(0, 256, (n_test, 28, 28)),
              "test_labels": rng.integers(0, 10, n_test)}
    os.makedirs(folder, exist_ok=True)
    for key, name in MNIST_FILES.items():
        write_idx(os.path.join(folder, name + (".gz" if gz else "")), arrays[key], gz=gz)
    return arrays


def write_cifar(folder, per_batch=16, seed=0):
    """The six CIFAR-10 binary batches: records of 1 label byte + 3072 pixel bytes (R, G, B planes);
    returns each file's (pixels, labels)."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    written = {}
    for name in CIFAR_BATCHES:
        labels = rng.integers(0, 10, per_batch).astype(np.uint8)
        pixels = rng.integers(0, 256, (per_batch, 3, 32, 32)).astype(np.uint8)
        records = np.concatenate([labels[:, None], pixels.reshape(per_batch, -1)], axis=1)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(records.tobytes())
        written[name] = (pixels, labels)
    return written


if __name__ == "__main__":
    import horovod.torch as hvd

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    hvd.init()
    if hvd.rank() == 0:
        write_mnist(os.path.join(out, "mnist"), n_train=200, gz=True)
        write_cifar(os.path.join(out, "cifar"))
    hvd.barrier()           # no rank goes on to read them before they are whole
