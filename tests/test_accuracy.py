"""Digits CNN accuracy of hvd_topk.DistributedOptimizer against dense Horovod (2 ranks, 3 fixed seeds)."""
import functools
import statistics
from types import SimpleNamespace

import pytest

from bench.accuracy import run

SEEDS = (0, 1, 2)
ARGS = SimpleNamespace(np=2, epochs=20, min_numel=2048)


@functools.lru_cache(maxsize=None)      # "Adam dense" is the reference of two pairs: run it once
def mean_accuracy(config):
    return statistics.mean(run(config, seed, ARGS) for seed in SEEDS)


@pytest.mark.parametrize("dense,compressed", [
    ("SGD dense", "SGD top-k 0.001, correction + warm-up, allgather"),
    ("Adam dense", "Adam top-k 0.01"),
    ("Adam dense", "Adam top-k 0.01, update"),       # compress='update': error feedback on Adam's update
])
def test_compressed_within_one_point_of_dense(dense, compressed):
    base, ours = mean_accuracy(dense), mean_accuracy(compressed)
    print(f"\n{dense}: {base:.4f}   {compressed}: {ours:.4f}")
    assert base > 0.95
    assert ours >= base - 0.01
