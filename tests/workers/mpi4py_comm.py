"""Horovod initialised on an mpi4py communicator: MPI.COMM_WORLD, or halves of it (``--split``).

Run under mpirun. With ``--split``, COMM_WORLD is split by ``rank % 2`` into two communicators and
``hvd.init(comm=...)`` gets this rank's; each half then trains on its own. Each half trains the same
small MLP three times from the same start: dense Horovod (``hvd.Compression.none``), TopKEF in stock
``hvd.DistributedOptimizer`` and ``hvd_topk.DistributedOptimizer``. Every rank writes
``<out>/rank<world rank>.pt``: its Horovod rank and size, its half, and the final parameters per run.
"""
import argparse
import os

from mpi4py import MPI

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--split", action="store_true", help="two communicators: world ranks with equal rank % 2")
p.add_argument("--ratio", type=float, default=0.05)
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()

world = MPI.COMM_WORLD
color = world.Get_rank() % 2 if args.split else 0
comm = world.Split(color=color, key=world.Get_rank()) if args.split else world
hvd.init(comm=comm)
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)      # so that ratio 1.0 vs dense compares at rounding level


def train(kind, ratio):
    """Final parameters of ``args.steps`` SGD steps; data depend on (world rank, step) only."""
    torch.manual_seed(1234 + world.Get_rank())     # different per rank: the broadcast must fix it
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = list(model.named_parameters())
    if kind == "dense":
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=hvd.Compression.none)
    elif kind == "topkef":
        compressor = hvd_topk.TopKEF(ratio=ratio, min_numel=64, named_parameters=named)
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compressor)
    else:
        opt = hvd_topk.DistributedOptimizer(base, named_parameters=named,
                                            compression=hvd_topk.TopKEF(ratio=ratio, min_numel=64))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        opt.zero_grad()
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100_000 * world.Get_rank() + step))
        ((model(x) - x @ w_true) ** 2).mean().backward()
        opt.step()
    return {n: q.detach().clone() for n, q in model.named_parameters()}


runs = {"dense": train("dense", 1.0)}
for kind in ("topkef", "hvd_topk"):
    runs[kind] = train(kind, args.ratio)
    runs[f"{kind}_ratio1"] = train(kind, 1.0)
torch.save({"hvd_rank": hvd.rank(), "hvd_size": hvd.size(), "color": color, "world_size": world.Get_size(),
            "runs": runs}, os.path.join(args.out, f"rank{world.Get_rank()}.pt"))
hvd.shutdown()
