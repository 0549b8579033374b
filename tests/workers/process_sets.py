"""A 4-rank job in two process sets, {0, 1} and {2, 3}: each set trains its own copy of a model on its
own data, with ``--column`` dense (stock Horovod), topkef (stock Horovod with TopKEF) or hvd_topk.
Every rank writes ``<out>/rank<r>.pt`` with its final parameters and its set's ranks.
"""
import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk
from hvd_topk import TopKEF

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--column", choices=["dense", "topkef", "hvd_topk"], required=True)
p.add_argument("--ratio", type=float, default=1.0)
p.add_argument("--leader", default="star")
args = p.parse_args()

sets = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])]
hvd.init(process_sets=sets)
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
mine = sets[hvd.rank() // 2]
torch.manual_seed(11 + hvd.rank() // 2)                 # the same init within a set (Horovod 0.28.1's
                                                        # broadcast_parameters takes no process set)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
named = list(model.named_parameters())
base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if args.column == "hvd_topk":
    opt = hvd_topk.DistributedOptimizer(base, named_parameters=named, process_set=mine,
                                        compression=TopKEF(ratio=args.ratio, min_numel=16),
                                        settings=hvd_topk.OptimizerSettings(leader=args.leader))
else:
    compression = hvd.Compression.none if args.column == "dense" else \
        TopKEF(ratio=args.ratio, min_numel=16, named_parameters=named, process_set=mine)
    opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression, process_set=mine)
w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(7 + hvd.rank() // 2))   # per set
for step in range(10):
    opt.zero_grad()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * hvd.rank() + step))
    ((model(x) - x @ w_true) ** 2).mean().backward()
    opt.step()
hvd.barrier()          # a rank that exits while the other set still trains shuts Horovod down for it
torch.save({"params": {n: q.detach().clone() for n, q in model.named_parameters()}, "set": mine.ranks},
           os.path.join(args.out, f"rank{hvd.rank()}.pt"))
