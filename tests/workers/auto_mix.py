"""communication='auto' with low rank among its choices, on two tensors built to favour one compressor each
(tests/test_auto.py): ``emb`` (2000 x 64) whose gradient is 30 rows of it (row-sparse, rank 30: Top-K at
``--ratio`` 0.02 sends all of it, rank 4 a fifth), and ``fc`` (512 x 256) whose gradient has rank 2 (rank 4
sends all of it, Top-K a quarter), of about equal energy. The loss is sum(W * G) per tensor, so the
gradients are exactly the built ones, new every step and rank.

Runs until auto's trial is over (at most ``--steps``), with a short trial (3 steps a turn, 3 to 6 rounds)
and ``--weight`` as the quality's weight (2: a plan that sends 60% of the energy at once must be 2.8x
faster to win, so that a busy host's slow spell in one turn does not decide). Every rank writes
``<out>/rank<r>.pt``: the plan after the probe, ``opt.auto_state()``, the quality figures, the steps run
and the final parameters.
"""
import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=150)
p.add_argument("--ratio", type=float, default=0.02)
p.add_argument("--weight", type=float, default=2.0)
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
model = nn.ParameterDict({"emb": nn.Parameter(torch.zeros(2000, 64)), "fc": nn.Parameter(torch.zeros(512, 256))})
opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                    named_parameters=model.named_parameters(), communication="auto",
                                    compression=hvd_topk.TopKEF(ratio=args.ratio, min_numel=64),
                                    settings=hvd_topk.OptimizerSettings(adaptive_weight=args.weight, auto_every=1000))
tuner = opt._hvd_topk.tuner
tuner.trial_steps, tuner.trial_rounds, tuner.trial_max_rounds = 3, 3, 6
rows = torch.randperm(2000, generator=torch.Generator().manual_seed(11))[:30]     # the same rows everywhere


def gradients(step):
    """The step's built gradients of this rank: 30 rows of emb (scaled to fc's energy), fc of rank 2."""
    gen = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    emb = torch.zeros(2000, 64)
    emb[rows] = 11.7 * torch.randn(30, 64, generator=gen)
    return {"emb": emb, "fc": torch.randn(512, 2, generator=gen) @ torch.randn(2, 256, generator=gen)}


model_plan, step = None, 0
for step in range(args.steps):
    opt.zero_grad()
    built = gradients(step)
    sum((model[name] * g).sum() for name, g in built.items()).backward()
    opt.step()
    if step == 1:                               # the probe's step: the second (the first is not timed)
        model_plan = dict(tuner.plan)
    if step > 0 and tuner.trial is None:
        break
result = {"model_plan": model_plan, "auto": opt.auto_state(), "quality": tuner.quality, "steps": step + 1,
          "params": {n: q.detach().clone() for n, q in model.named_parameters()}}
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
