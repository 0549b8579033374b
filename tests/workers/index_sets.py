"""A multi-rank job for the tests: ``IndexPipeline`` shares every step's AR-Topk index sets with one
allgather, and every rank must receive, for each key, exactly the set its leader picked.

Each rank builds the accumulators of every rank (seeded by rank, step and key), so it can compute the
set each leader must have sent. Each step one rank leads two sets, one leads one, and with 3 or more
ranks some lead none (an empty block); odd ranks pick their sets in reverse key order (the plan must
not depend on it). Writes ``<out>/rank<r>.pt`` with the checks and the keys of the final state.
"""
import argparse
import os

import horovod.torch as hvd
import torch

from hvd_topk.transports.index_sets import IndexPipeline
from hvd_topk.transports.leaders import star_leader
from hvd_topk.core.sparsify import topk_indices

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

hvd.init()
KEYS = {"a": (1000, 10), "b": (5000, 7), "c": (300, 30)}    # key -> (numel, k)
SPREAD = {"a": 0, "b": 0, "c": 1}     # STAR offsets: one rank leads a and b, one c, the others nothing


def leader_of(key, step):
    return star_leader(SPREAD[key], step, hvd.size())


def acc_of(rank, step, key):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + sorted(KEYS).index(key))
    return torch.randn(KEYS[key][0], generator=g)


pipe = IndexPipeline("test.index_sets")
checks = []
for step in range(args.steps):
    keys = sorted(KEYS) if hvd.rank() % 2 == 0 else sorted(KEYS, reverse=True)
    for key in keys:
        numel, k = KEYS[key]
        acc = acc_of(hvd.rank(), step, key)
        got = pipe.current(key, acc, k, leader=None)
        if step > 0:
            leader = leader_of(key, step)
            want = topk_indices(acc_of(leader, step - 1, key), k)
            checks.append({"step": step, "key": key, "leader": leader, "equal": torch.equal(got, want)})
        # launch_next predicts from acc and the gradient at the sent entries: with grad = acc (and the
        # sent set = got) the prediction is acc itself, so the leader's set is topk(acc).
        pipe.launch_next(key, acc, acc, got, k, leader_of(key, step + 1))
    pipe.flush()
    assert not pipe.outgoing and (hvd.size() == 1 or pipe.in_flight is not None)

state = pipe.state_dict()        # the sets for the step after the last: waits for the allgather
torch.save({"checks": checks, "state_keys": sorted(state)}, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
