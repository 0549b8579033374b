"""Low rank through every door in one job (float64, a small CNN on synthetic data): tests/test_powersgd.py.

Each rank trains copies of one model side by side, on the same data, one per ``--doors`` entry:

- ``opt``: ``hvd_topk.DistributedOptimizer(compression=hvd_topk.PowerSGD(rank=...))``;
- ``stock``: stock ``hvd.DistributedOptimizer(compression=hvd_topk.PowerSGD(rank, named_parameters=...))``
  (``--stock-form positional``: without names; ``class``: ``compression=hvd_topk.PowerSGD``, rank 4);
- ``dense``: stock ``hvd.DistributedOptimizer`` without compression.

``--dense-steps`` gives both doors' PowerSGD its first dense steps. ``--nan-rank`` makes that rank's loss NaN at ``--nan-step`` (every door skips the step on every rank).
``--save-at`` writes a per-rank checkpoint per door after that step and stops; ``--resume`` reads them
(the stock door's PowerSGD state as the checkpoint's extra). ``--set`` trains within that process set
(registered at ``hvd.init``); ``--set-given no`` does not give it to the stock door's PowerSGD (the
mistake: every rank of the set must raise, naming process_set, and the job end). Every rank writes
``<out>/rank<r>.pt``: per door its final parameters, what the NaN step did, its residuals, the warnings
and the error it saw.
"""
import argparse
import os
import time
import warnings

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--doors", default="opt,stock")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--op", choices=["average", "sum"], default="average")
p.add_argument("--communication", default="lowrank")
p.add_argument("--dense-steps", type=int, default=0, help="PowerSGD's dense_steps, in both doors")
p.add_argument("--stock-form", choices=["named", "positional", "class"], default="named")
p.add_argument("--nan-rank", type=int, default=-1)
p.add_argument("--nan-step", type=int, default=-1)
p.add_argument("--save-at", type=int, default=-1)
p.add_argument("--resume", default=None, help="the opt.pt that a --save-at job wrote (its folder holds every door's)")
p.add_argument("--set", default="", help="comma-separated ranks of the process set the optimizers reduce in")
p.add_argument("--set-given", choices=["yes", "no"], default="yes")
args = p.parse_args()

pset = hvd.ProcessSet([int(r) for r in args.set.split(",")]) if args.set else None
hvd.init(process_sets=[pset] if pset else None)
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
ps = pset or hvd.global_process_set
op = hvd.Average if args.op == "average" else hvd.Sum


def build(door):
    """(model, optimizer, the stock door's compressor or None) of one door."""
    torch.manual_seed(1234 + hvd.rank())             # different per rank: the broadcast must fix it
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32), nn.Tanh(),
                          nn.Linear(32, 10))
    named = list(model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    compressor = None
    if door == "opt":
        opt = hvd_topk.DistributedOptimizer(base, named_parameters=named, op=op, process_set=ps,
                                            compression=hvd_topk.PowerSGD(rank=args.rank,
                                                                          communication=args.communication,
                                                                          dense_steps=args.dense_steps))
    elif door == "dense":
        opt = hvd.DistributedOptimizer(base, named_parameters=named, op=op, process_set=ps)
    else:
        given = {"process_set": ps} if args.set_given == "yes" else {}
        given["dense_steps"] = args.dense_steps
        compressor = {"named": lambda: hvd_topk.PowerSGD(args.rank, named_parameters=named,
                                                         communication=args.communication, **given),
                      "positional": lambda: hvd_topk.PowerSGD(args.rank, communication=args.communication, **given),
                      "class": lambda: hvd_topk.PowerSGD}[args.stock_form]()
        opt = hvd.DistributedOptimizer(base, named_parameters=named, op=op, process_set=ps, compression=compressor)
    return model, opt, compressor


def residuals(door, opt, compressor):
    if door == "opt":
        return dict(opt._hvd_topk.residuals.residuals)
    if door == "dense":
        return {}
    return dict((compressor if compressor is not hvd_topk.PowerSGD else compressor.default()).memory.residuals)


warnings.simplefilter("always")
doors = args.doors.split(",")
result = {"ranks": ps.ranks or list(range(hvd.size())), "error": None}
with warnings.catch_warnings(record=True) as seen:
    built = {door: build(door) for door in doors}
    start = 0
    for door, (model, opt, compressor) in built.items():
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if args.resume:
            path = os.path.join(os.path.dirname(args.resume), f"{door}.pt")
            extra = hvd_topk.load_checkpoint(path, model, opt)
            start = extra["next_step"]
            if compressor is not None:
                compressor.load_state_dict(extra["compressor"])
    records = {door: {"skipped": None} for door in doors}
    try:
        for step in range(start, args.steps):
            gen = torch.Generator().manual_seed(100_000 * hvd.rank() + step)
            x, y = torch.randn(16, 3, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
            for door, (model, opt, compressor) in built.items():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                if step == args.nan_step and hvd.rank() == args.nan_rank:
                    loss = loss * float("nan")
                loss.backward()
                before = {n: q.detach().clone() for n, q in model.named_parameters()}
                kept = {k: None if v is None else v.clone() for k, v in residuals(door, opt, compressor).items()}
                if door == "opt":
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")    # it says that it skips a non-finite step
                        opt.step()
                else:                                      # stock: the user's isfinite check skips step()
                    opt.synchronize()
                    if all(bool(torch.isfinite(q.grad).all()) for q in model.parameters()):
                        with opt.skip_synchronize():
                            opt.step()
                if step == args.nan_step:
                    now = residuals(door, opt, compressor)
                    records[door]["skipped"] = {
                        "params_unchanged": all(torch.equal(before[n], q) for n, q in model.named_parameters()),
                        "residuals_unchanged": now.keys() == kept.keys() and all(
                            (v is None and kept[k] is None) or torch.equal(v, kept[k]) for k, v in now.items()),
                        "had_residuals": any(v is not None for v in kept.values()),
                        "grads_nan": all(bool(torch.isnan(q.grad).all()) for q in model.parameters())}
            if step == args.save_at:
                for door, (model, opt, compressor) in built.items():
                    extra = {} if compressor is None else {"compressor": compressor.state_dict()}
                    hvd_topk.save_checkpoint(os.path.join(args.out, f"{door}.pt"), model, opt, next_step=step + 1,
                                             **extra)
                break
        hvd.allreduce(torch.zeros(1), name="powersgd.after_training")     # a global collective, as a test's check
    except Exception as caught:
        result["error"] = f"{type(caught).__name__}: {caught}"
        print(f"rank {hvd.rank()} failed at {time.time():.3f}: {result['error']}", flush=True)
    hvd.barrier()                                  # every rank reaches its end before any shuts Horovod down
for door, (model, opt, compressor) in built.items():
    result[door] = dict(records[door], params={n: q.detach().clone() for n, q in model.named_parameters()},
                        residuals=residuals(door, opt, compressor))
    if door != "dense":                            # the last step's figures, as each door reports them
        result[door]["stats"] = opt.stats() if door == "opt" else compressor.stats()
    if door == "opt":
        result[door]["transports"] = sorted(opt._hvd_topk.transports)
        result[door]["q"] = {name: t.state_dict() for name, t in opt._hvd_topk.transports.items()
                             if hasattr(t, "state_dict")}
result["warnings"] = [str(w.message) for w in seen]
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
