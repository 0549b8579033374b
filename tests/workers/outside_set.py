"""A 3-rank job whose optimizer reduces within the process set {0, 1}; rank 2 is outside it and steps on
its own gradients. ``--topkef-set optimizer`` gives TopKEF that set too; ``--topkef-set none`` does not
(the mistake Horovod's own ``test_optimizer_process_sets`` makes with a swapped-in TopKEF): TopKEF then
runs its collectives over all three ranks, and rank 2 never joins them.

As in that test under a test runner, a rank whose training passed goes on to a global collective (the
test's check), and a rank whose step raised goes to another (the runner's teardown barrier). If only the
set's ranks raise, rank 2 waits in the first while they wait in the second: the job hangs, unless the
ranks that raised end Horovod. A rank prints the error it caught, with the time; every rank writes
``<out>/rank<r>.pt`` with its parameters and that error, if any; a rank whose barrier fails exits non-zero.
"""
import argparse
import os
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

from hvd_topk import TopKEF

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--compression", choices=["named", "positional", "class"], required=True)
p.add_argument("--topkef-set", choices=["optimizer", "none"], required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--communication", default="split_reduce", help="TopKEF's transport (not for the class form)")
args = p.parse_args()

pair = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[pair])
torch.set_num_threads(1)
torch.manual_seed(5)
model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))      # the 2048-entry weight is compressed
named = list(model.named_parameters())
given = {"process_set": pair} if args.topkef_set == "optimizer" else {}
given["communication"] = args.communication
compression = {"named": lambda: TopKEF(ratio=0.05, named_parameters=named, **given),
               "positional": lambda: TopKEF(ratio=0.05, **given),
               "class": lambda: TopKEF}[args.compression]()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=named,
                               compression=compression, process_set=pair)
error = None
try:
    for step in range(args.steps):
        opt.zero_grad()
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * hvd.rank() + step))
        (model(x) ** 2).mean().backward()
        opt.step()
    # the test's own check after training, a global collective: only ranks whose steps passed reach it
    hvd.allreduce(torch.zeros(1), name="outside_set.after_training")
except Exception as caught:                    # the test runner records the failure, then tears down
    error = f"{type(caught).__name__}: {caught}"
    print(f"rank {hvd.rank()} failed at {time.time():.3f}: {error}", flush=True)
hvd.barrier()                                  # the runner's teardown, a global collective
torch.save({"params": {n: q.detach().clone() for n, q in named}, "error": error},
           os.path.join(args.out, f"rank{hvd.rank()}.pt"))
