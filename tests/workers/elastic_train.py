"""An elastic Horovod job (``horovodrun --min-np/--max-np --host-discovery-script``), written as
Horovod's documentation writes one (``hvd.elastic.TorchState``, ``@hvd.elastic.run``, ``state.commit()``),
with both front doors and both compressors side by side: each rank trains four copies of one MLP,
through ``hvd_topk.DistributedOptimizer`` and through stock ``hvd.DistributedOptimizer``, each with TopKEF
and with PowerSGD (low rank), all in the one state that elastic Horovod commits, restores and syncs. One
job tests them all: an elastic job here costs about 30 s, mostly its workers' starts and Horovod's
resets, not its steps.

Every process appends one JSON line per finished step to ``<out>/log.<pid>.jsonl``: the step, the world
size, its rank and a digest of each door's parameters; rank 0 also writes ``<out>/progress`` ("step
size") for the test that changes the hosts. ``--kill-host H --kill-step S``: the worker on host H
SIGKILLs itself after step S, between two commits.
"""
import argparse
import hashlib
import json
import os
import signal
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk import PowerSGD, TopKEF

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--ratio", type=float, default=0.1)
p.add_argument("--commit-every", type=int, default=1)
p.add_argument("--sleep", type=float, default=0.2, help="seconds per step, so that hosts can change mid-run")
p.add_argument("--kill-host", default="")
p.add_argument("--kill-step", type=int, default=-1)
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)


def mlp():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


# Each copy's own names: Horovod matches the ranks' collectives by name, and the copies' collectives of
# one step must not share one. PowerSGD at rank 2 compresses the two weight matrices (the rest dense),
# after 2 dense steps: a rank that joins later must not take them again (hvd_topk.step.schedule.DoorSteps).
models = {door: mlp() for door in ("hvd_topk", "topkef", "hvd_topk_powersgd", "powersgd")}
named = {door: [(f"{door}.{n}", q) for n, q in model.named_parameters()] for door, model in models.items()}
sgd = {door: torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9) for door, model in models.items()}
opts = {"hvd_topk": hvd_topk.DistributedOptimizer(sgd["hvd_topk"], named_parameters=named["hvd_topk"],
                                                  compression=TopKEF(ratio=args.ratio, min_numel=16)),
        "topkef": hvd.DistributedOptimizer(
            sgd["topkef"], named_parameters=named["topkef"],
            compression=TopKEF(ratio=args.ratio, min_numel=16, named_parameters=named["topkef"])),
        "hvd_topk_powersgd": hvd_topk.DistributedOptimizer(sgd["hvd_topk_powersgd"],
                                                           named_parameters=named["hvd_topk_powersgd"],
                                                           compression=PowerSGD(rank=2, dense_steps=2)),
        "powersgd": hvd.DistributedOptimizer(
            sgd["powersgd"], named_parameters=named["powersgd"],
            compression=PowerSGD(rank=2, named_parameters=named["powersgd"], dense_steps=2))}
w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
log = open(os.path.join(args.out, f"log.{os.getpid()}.jsonl"), "a")


def digest(model):
    h = hashlib.sha256()
    for _, q in sorted(model.named_parameters()):
        h.update(q.detach().numpy().tobytes())
    return h.hexdigest()[:16]


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1000 * hvd.rank() + state.step))
        for door, model in models.items():
            opts[door].zero_grad()
            ((model(x) - x @ w_true) ** 2).mean().backward()
            opts[door].step()
        state.step += 1
        log.write(json.dumps({"step": state.step, "size": hvd.size(), "rank": hvd.rank(),
                              "digest": {door: digest(model) for door, model in models.items()}}) + "\n")
        log.flush()
        if hvd.rank() == 0:
            with open(os.path.join(args.out, "progress"), "w") as f:
                f.write(f"{state.step} {hvd.size()}\n")
        if os.environ.get("HOROVOD_HOSTNAME") == args.kill_host and state.step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.sleep)
        if state.step % args.commit_every == 0:
            state.commit()


train(hvd.elastic.TorchState(step=0, **{f"{door}_model": model for door, model in models.items()},
                             **{f"{door}_optimizer": opt for door, opt in opts.items()}))
