"""A multi-rank training job for the tests: synthetic regression on an MLP, stock Horovod optimizer.

Every rank writes ``<out>/rank<r>.pt`` with its final parameters and TopKEF state. Launched by the
tests through horovodrun (Gloo) or mpirun.
"""
import argparse
import os
import sys
import time

# Run as a script, so only tests/workers/ is on sys.path: the loopback counters are the repository's
# testbed/ tooling, not part of the installed package.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from testbed.wire import loopback_bytes  # noqa: E402
from hvd_topk import TopKEF  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--compression", choices=["none", "topkef"], default="topkef")
p.add_argument("--ratio", type=float, default=0.01)
p.add_argument("--min-numel", type=int, default=64)
p.add_argument("--sync-indices", action="store_true")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--width", type=int, default=64)
p.add_argument("--depth", type=int, default=3, help="hidden Linear layers")
p.add_argument("--op", choices=["average", "sum"], default="average")
p.add_argument("--bpps", type=int, default=1, help="backward_passes_per_step")
p.add_argument("--groups", type=int, default=0, help="Horovod's groups (0: none)")
p.add_argument("--momentum", type=float, default=0.9)
p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
p.add_argument("--nan-rank", type=int, default=-1, help="inject a NaN gradient on this rank ...")
p.add_argument("--nan-step", type=int, default=-1, help="... at this step")
p.add_argument("--crash-rank", type=int, default=-1, help="this rank exits with an error at step 3")
p.add_argument("--freeze-step", type=int, default=-1, help="freeze a middle layer's weight here")
p.add_argument("--warmup", type=int, default=3, help="steps before timing and byte counting")
p.add_argument("--communication", default="split_reduce", help="TopKEF's transport")
p.add_argument("--selection", default="layerwise", help="TopKEF's selection")
p.add_argument("--named", action="store_true", help="TopKEF keyed by named_parameters (else by position)")
p.add_argument("--reverse-odd", action="store_true",
               help="odd ranks make their gradients ready in reverse order (one backward pass per parameter)")
p.add_argument("--record-ef", type=int, default=0,
               help="record each rank's gradient, residuals and aggregate for this many steps (float64 checks)")
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
dtype = getattr(torch, args.dtype)
torch.manual_seed(1234 + hvd.rank())         # different init per rank: broadcast must fix it
layers, width_in = [], 32
for _ in range(args.depth):
    layers += [nn.Linear(width_in, args.width), nn.Tanh()]
    width_in = args.width
model = nn.Sequential(*layers, nn.Linear(width_in, 1)).to(dtype)
opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=args.momentum)
compression = (TopKEF(ratio=args.ratio, min_numel=args.min_numel, sync_indices=args.sync_indices,
                      communication=args.communication, selection=args.selection,
                      named_parameters=model.named_parameters() if args.named else None)
               if args.compression == "topkef" else hvd.Compression.none)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                               op=hvd.Average if args.op == "average" else hvd.Sum,
                               backward_passes_per_step=args.bpps, groups=args.groups or None)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)

gen = torch.Generator().manual_seed(99 + hvd.rank())   # each rank its own data
w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7), dtype=dtype)
residual_before_nan = None
step_times, ef_records = [], []
for step in range(args.steps):
    if step == args.warmup:
        tx0 = loopback_bytes()[0]
    t0 = time.perf_counter()
    opt.zero_grad()                                     # torch 2.x default: grads set to None
    assert all(q.grad is None for q in model.parameters())
    if step == args.freeze_step:
        model[2].weight.requires_grad_(False)
    for _ in range(args.bpps):
        x = torch.randn(16, 32, generator=gen, dtype=dtype)
        loss = ((model(x) - x @ w_true) ** 2).mean()
        if step == args.nan_step and hvd.rank() == args.nan_rank:
            loss = loss * float("nan")
        if args.reverse_odd:
            # one backward pass per parameter: Horovod's hook for each fires (and compresses) in this order
            order = list(model.parameters())[::-1 if hvd.rank() % 2 else 1]
            for i, q in enumerate(order):
                loss.backward(inputs=[q], retain_graph=i < len(order) - 1)
        else:
            loss.backward()
    if step == 3 and hvd.rank() == args.crash_rank:
        raise SystemExit("injected failure")
    if step == args.nan_step and args.compression == "topkef":
        residual_before_nan = {k: None if v is None else v.clone()
                               for k, v in compression.memory.residuals.items()}
    if step < args.record_ef:
        names = dict(model.named_parameters())
        record = {"grad": {n: q.grad.detach().clone().reshape(-1) for n, q in names.items()},
                  "before": {k: None if v is None else v.clone() for k, v in compression.memory.residuals.items()}}
    opt.synchronize()
    if step < args.record_ef:
        record.update(aggregate={n: q.grad.detach().clone().reshape(-1) for n, q in names.items()},
                      after={k: None if v is None else v.clone() for k, v in compression.memory.residuals.items()})
        ef_records.append(record)
    finite = all(torch.isfinite(q.grad).all() for q in model.parameters())
    if step == args.nan_step:
        nan_step_grads_finite = finite
        residual_after_nan = (None if args.compression != "topkef" else
                              {k: None if v is None else v.clone()
                               for k, v in compression.memory.residuals.items()})
    with opt.skip_synchronize():
        if finite:
            opt.step()
    step_times.append(time.perf_counter() - t0)
hvd.allreduce(torch.zeros(1), name="barrier.end")
tx = loopback_bytes()[0] - tx0

result = {
    "params": {n: q.detach().clone() for n, q in model.named_parameters()},
    "num_params": sum(q.numel() for q in model.parameters()),
    "num_tensors": len(list(model.parameters())),
    "loopback_tx_bytes": tx, "measured_steps": args.steps - args.warmup,
    "step_times": step_times[args.warmup:],
}
if args.compression == "topkef":
    result["residuals"] = compression.memory.residuals
if args.record_ef:
    result["ef_records"] = ef_records
if args.nan_step >= 0:
    result.update(nan_step_grads_finite=nan_step_grads_finite,
                  residual_before_nan=residual_before_nan, residual_after_nan=residual_after_nan)
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
