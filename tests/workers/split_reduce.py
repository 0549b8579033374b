"""split_reduce on gradients the test controls (tests/test_split_reduce.py).

Every rank sets its parameters' gradients itself, then calls ``synchronize()`` (Horovod submits what no
hook submitted). With ``--skew`` only rank 0 holds large entries: k per tensor, of magnitude 10 to 20,
all in the first quarter of the index space (one owner's region while the regions are equal); every
rank adds noise below 0.01. Writes ``<out>/rank<r>.pt``: per step the local gradients, the aggregates
and the residuals after the step, and the stats.
"""
import argparse

import horovod.torch as hvd
import torch

import hvd_topk
from hvd_topk.core.sparsify import k_for

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--ratio", type=float, default=0.02)
p.add_argument("--rebalance-every", type=int, default=4)
p.add_argument("--dtype", choices=["float32", "float64"], default="float64")
p.add_argument("--values", choices=["bf16", "fp16", "fp32"], default="bf16")
p.add_argument("--selection", default="layerwise")
p.add_argument("--groups", type=int, default=0)
p.add_argument("--skew", action="store_true")
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
dtype = getattr(torch, args.dtype)
# sizes that 2, 3 and 4 ranks do not divide, and a 1-D tensor that goes dense (plain allreduce)
shapes = {"a": (37, 53), "b": (64, 31), "bias": (40,)}
params = {name: torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for name, shape in shapes.items()}
opt = hvd_topk.DistributedOptimizer(
    torch.optim.SGD(params.values(), lr=0.01), named_parameters=params.items(),
    compression=hvd_topk.TopKEF(ratio=args.ratio, min_numel=16, values=args.values), groups=args.groups or None,
    communication="split_reduce", settings=hvd_topk.OptimizerSettings(selection=args.selection))
opt._hvd_topk.transports["split_reduce"].regions.rebalance_every = args.rebalance_every

records = []
for step in range(args.steps):
    gen = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    local = {}
    for name, q in params.items():
        n = q.numel()
        g = (torch.rand(n, generator=gen, dtype=dtype) - 0.5) * 0.02
        if args.skew and hvd.rank() == 0 and q.dim() > 1:
            where = torch.randperm(n // 4, generator=gen)[:k_for(n, args.ratio)]
            sign = torch.randint(0, 2, (where.numel(),), generator=gen).to(dtype) * 2 - 1
            g[where] = sign * (10 + 10 * torch.rand(where.numel(), generator=gen, dtype=dtype))
        local[name] = g.reshape(q.shape)
        q.grad = local[name].clone()
    opt.synchronize()
    aggregates = {name: q.grad.detach().clone() for name, q in params.items()}
    with opt.skip_synchronize():
        opt.step()
    residuals = {name: (torch.zeros(q.numel(), dtype=dtype) if r is None else r.clone())
                 for name, q in params.items() for r in [opt._hvd_topk.residuals.residuals.get(name)]}
    records.append({"local": local, "aggregate": aggregates, "residual": residuals, "stats": opt.stats()})

torch.save({"records": records, "params": {n: q.detach().clone() for n, q in params.items()},
            "ranks": hvd.size()}, f"{args.out}/rank{hvd.rank()}.pt")
