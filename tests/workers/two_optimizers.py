"""Two hvd_topk.DistributedOptimizers in one job (as a GAN's generator and discriminator would have),
stepping in turn, then the same two models each trained alone by a fresh optimizer.

Both use AR-Topk, so each keeps index sets in flight between its steps, and a VAR leader, so each
keeps its score allgather in flight too. Every rank writes ``<out>/rank<r>.pt``: the parameters of
both models after the interleaved run and after the solo runs, and the optimizers' collective tags.
"""
import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=15)
a = p.parse_args()

hvd.init()
torch.set_num_threads(1)


def build(i):
    torch.manual_seed(i)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                        named_parameters=model.named_parameters(),   # same names in both
                                        compression=hvd_topk.TopKEF(ratio=0.05, min_numel=64),
                                        communication="artopk",
                                        settings=hvd_topk.OptimizerSettings(leader="var"))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def train_step(model, opt, i, step):
    g = torch.Generator().manual_seed(1000 * i + 10 * step + hvd.rank())
    x = torch.randn(16, 64, generator=g, dtype=torch.float64)
    opt.zero_grad()
    ((model(x) - x[:, :1]) ** 2).mean().backward()
    opt.step()


pairs = [build(0), build(1)]
for step in range(a.steps):
    for i, (model, opt) in enumerate(pairs):
        train_step(model, opt, i, step)
interleaved = [{n: q.detach().clone() for n, q in model.named_parameters()} for model, _ in pairs]
tags = [opt._hvd_topk.tag for _, opt in pairs]

solo = []
for i in range(2):
    model, opt = build(i)
    for step in range(a.steps):
        train_step(model, opt, i, step)
    solo.append({n: q.detach().clone() for n, q in model.named_parameters()})
    tags.append(opt._hvd_topk.tag)

torch.save({"params": {f"m{i}.{n}": v for i, ps in enumerate(interleaved) for n, v in ps.items()},
            "solo": {f"m{i}.{n}": v for i, ps in enumerate(solo) for n, v in ps.items()}, "tags": tags},
           os.path.join(a.out, f"rank{hvd.rank()}.pt"))
