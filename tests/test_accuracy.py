"""Digits CNN accuracy (2 ranks, 3 fixed seeds) and the byte-level LM's test loss (2 ranks, 600 AdamW
steps, seed 0) of hvd_topk.DistributedOptimizer against dense Horovod."""
import functools
import statistics
from types import SimpleNamespace

import pytest

from bench.accuracy import run

SEEDS = (0, 1, 2)
ARGS = SimpleNamespace(np=2, epochs=20, min_numel=2048)
LM_ARGS = SimpleNamespace(np=2, example="lm", steps=600)


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


def test_lm_update_without_local_momentum_within_two_percent_of_dense():
    """Top-k 0.01 of each rank's AdamW update, allgather, local_momentum=False: the LM's final test
    loss within 2% of dense AdamW's (both runs are deterministic)."""
    base = run("AdamW dense", 0, LM_ARGS)
    ours = run("AdamW top-k 0.01, update, no local momentum, allgather", 0, LM_ARGS)
    print(f"\nAdamW dense: {base:.4f}   update, no local momentum: {ours:.4f} ({ours / base - 1:+.2%})")
    assert base < 1.7                  # the model learned (ln 256 = 5.5 for a uniform guess)
    assert ours <= 1.02 * base
