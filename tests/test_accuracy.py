"""Digits CNN accuracy (2 ranks, 3 fixed seeds) and the byte-level LM's test loss (2 ranks, AdamW, seed
0) of hvd_topk.DistributedOptimizer against dense Horovod."""
import statistics
from types import SimpleNamespace

import pytest

from bench.accuracy import run_records

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

SEEDS = (0, 1, 2)
ARGS = SimpleNamespace(np=2, epochs=20, min_numel=2048)
PAIRS = [("SGD dense", "SGD top-k 0.001, correction + warm-up, allgather"),
         ("Adam dense", "Adam top-k 0.01"),
         ("Adam dense", "Adam top-k 0.01, update")]     # compress='update': error feedback on Adam's update
# The LM at 2 blocks x 128 for 400 steps (a quarter of the 4 x 600 run's time) keeps the gaps that the
# full size shows (docs/results.md, "The LM in the test suite"): this recipe +0.3% (full size +0.9%),
# local momentum on +16% (+22%), split_reduce +4.1% (+3.9%); only the first is within 2%.
LM_ARGS = SimpleNamespace(np=2, example="lm", steps=400, lm_layers=2, lm_width=128)


@pytest.fixture(scope="module")
def mean_accuracy():
    """Each digits config's mean test accuracy over the seeds; every run in one launch."""
    configs = list(dict.fromkeys(config for pair in PAIRS for config in pair))   # "Adam dense" once
    runs = [(config, seed) for config in configs for seed in SEEDS]
    accuracy = {}
    for (config, _), record in zip(runs, run_records(runs, ARGS)):
        accuracy.setdefault(config, []).append(record["test_accuracy"])
    return {config: statistics.mean(values) for config, values in accuracy.items()}


@pytest.mark.parametrize("dense,compressed", PAIRS)
def test_compressed_within_one_point_of_dense(mean_accuracy, dense, compressed):
    base, ours = mean_accuracy[dense], mean_accuracy[compressed]
    print(f"\n{dense}: {base:.4f}   {compressed}: {ours:.4f}")
    assert base > 0.95
    assert ours >= base - 0.01


def test_lm_update_without_local_momentum_within_two_percent_of_dense():
    """Top-k 0.01 of each rank's AdamW update, allgather, local_momentum=False: the LM's final test
    loss within 2% of dense AdamW's (both runs are deterministic)."""
    base, ours = (r["test_loss"] for r in run_records(
        [("AdamW dense", 0), ("AdamW top-k 0.01, update, no local momentum, allgather", 0)], LM_ARGS))
    print(f"\nAdamW dense: {base:.4f}   update, no local momentum: {ours:.4f} ({ours / base - 1:+.2%})")
    assert base < 1.8                  # the model learned (ln 256 = 5.5 for a uniform guess; measured 1.769)
    assert ours <= 1.02 * base
