"""communication='hierarchical' through both front doors in one job (float64, synthetic regression).

Each rank trains two copies of one MLP side by side: ``opt`` (hvd_topk.DistributedOptimizer) and
``stock`` (hvd.DistributedOptimizer with TopKEF, op ``--stock-op``). Every step it records, per front door, its local
gradients, the aggregate every rank received (p.grad after synchronize) and its residuals after the
step; ``--nan-rank`` makes one rank's loss non-finite at ``--nan-step``. Every rank writes
``<out>/rank<r>.pt`` with those, its final parameters, where it ran and the warnings it saw (the flat
fallback announces itself there).
"""
import argparse
import os
import socket
import time
import warnings

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--ratio", type=float, default=0.05)
p.add_argument("--nan-rank", type=int, default=-1)
p.add_argument("--nan-step", type=int, default=-1)
p.add_argument("--stock-op", choices=["average", "sum"], default="average", help="the stock door's op")
p.add_argument("--register-sets", action="store_true",
               help="hvd.init(process_sets=hvd_topk.host_process_sets()); without it, none (the fallbacks need "
                    "none; tests/workers/unregistered_host_sets.py checks what happens otherwise)")
p.add_argument("--lowrank-steps", type=int, default=0,
               help="then this many steps of low rank across the hosts through both doors (PowerSGD(rank=2, "
                    "communication='hierarchical')), rank --nan-rank's loss NaN at step 1")
p.add_argument("--fp16-steps", type=int, default=0,
               help="then this many steps of hvd_topk's dense_fp16 (pinned, communication='hierarchical', float32) "
                    "through the hosts, rank --nan-rank's loss NaN at step 1")
p.add_argument("--auto-steps", type=int, default=0,
               help="then this many steps of communication='auto': the probe of both links, the model's plan, "
                    "then a short trial of flat split_reduce against hierarchical")
args = p.parse_args()


warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    hvd.init(process_sets=hvd_topk.host_process_sets() if args.register_sets else None)
    start = time.monotonic()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))

    def build(front_door):
        """Layer-wise selection: the checks follow each tensor's shards (global selection's bucket is
        the fused tests' and the steps test's)."""
        torch.manual_seed(1234 + hvd.rank())        # different per rank: the broadcast must fix it
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if front_door == "opt":
            opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                                compression=hvd_topk.TopKEF(ratio=args.ratio, min_numel=64,
                                                                            selection="layerwise"),
                                                communication="hierarchical")
            residuals, transport = opt._hvd_topk.residuals.residuals, opt._hvd_topk.transports["hierarchical"]
        else:
            comp = hvd_topk.TopKEF(ratio=args.ratio, min_numel=64, named_parameters=model.named_parameters(),
                                   communication="hierarchical", selection="layerwise")
            opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp,
                                           op=hvd.Sum if args.stock_op == "sum" else hvd.Average)
            residuals, transport = comp.memory.residuals, comp.transports.own["hierarchical"]
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, opt, residuals, transport

    doors = {door: build(door) for door in ("opt", "stock")}
    record = {door: {"grads": [], "aggregates": [], "residuals": []} for door in doors}
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(100_000 * hvd.rank() + step)
        x = torch.randn(16, 32, generator=gen)
        for door, (model, opt, residuals, _) in doors.items():
            opt.zero_grad()
            loss = ((model(x) - x @ w_true) ** 2).mean()
            if step == args.nan_step and hvd.rank() == args.nan_rank:
                loss = loss * float("nan")
            grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            loss.backward()
            opt.synchronize()
            names = [n for n, _ in model.named_parameters()]
            record[door]["grads"].append({n: g.clone() for n, g in zip(names, grads)})
            record[door]["aggregates"].append({n: q.grad.clone() for n, q in model.named_parameters()})
            with opt.skip_synchronize(), warnings.catch_warnings():
                warnings.simplefilter("ignore")       # the skipped step's own warning
                if all(torch.isfinite(q.grad).all() for q in model.parameters()):
                    opt.step()
            record[door]["residuals"].append({k: None if v is None else v.clone() for k, v in residuals.items()})
    elapsed = time.monotonic() - start

    def ratio_one(door):
        """--steps steps of hvd_topk's hierarchical at ratio 1.0 ("ratio1") or dense stock Horovod ("dense"),
        each with its own parameter names; the two must agree."""
        torch.manual_seed(1234 + hvd.rank())
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
        named = [(f"{door}.{n}", q) for n, q in model.named_parameters()]
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvd_topk.DistributedOptimizer(base, named_parameters=named, communication="hierarchical",
                                            compression=hvd_topk.TopKEF(ratio=1.0, min_numel=64)) \
            if door == "ratio1" else hvd.DistributedOptimizer(base, named_parameters=named)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for step in range(args.steps):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100_000 * hvd.rank() + step))
            opt.zero_grad()
            ((model(x) - x @ w_true) ** 2).mean().backward()
            opt.step()
        return {n: q.detach().clone() for n, q in model.named_parameters()}

    ratio_one_params = {door: ratio_one(door) for door in ("ratio1", "dense")}

    def auto_door(steps):
        """hvd_topk.DistributedOptimizer(communication='auto'): its probe and plan after step 0, then a
        trial of all split_reduce, all hierarchical and a mixed plan (the second layer hierarchical, the first
        low rank, the rest dense_fp16: three transports in one step across the hosts), 2 steps a turn, 3
        counted rounds."""
        torch.manual_seed(1234 + hvd.rank())
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        named = [(f"auto.{n}", q) for n, q in model.named_parameters()]
        # lr 0.02, not 0.05: at 0.05 with momentum 0.9 this MLP trains with dense alone, but a trial's
        # switches between Top-K and dense or low rank (each a few steps of delayed, then released,
        # gradient) tip it into divergence; the transports' sums stay exact (test_auto.py's invariant)
        opt = hvd_topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                            named_parameters=named, communication="auto",
                                            compression=hvd_topk.TopKEF(ratio=args.ratio, min_numel=64))
        tuner = opt._hvd_topk.tuner
        tuner.trial_steps, tuner.trial_rounds, tuner.trial_max_rounds = 2, 3, 3
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        out = {"modes": []}
        for step in range(steps):
            if step == 2:                       # the probe ran at the end of step 1 (step 0 is not timed)
                out["probed"], out["model_plan"] = list(tuner.history), dict(tuner.plan)
                mixed = {n: "hierarchical" if n == "auto.2.weight" else "lowrank" if n == "auto.0.weight"
                         else "dense_fp16" for n in tuner.plan}
                tuner.start_trial([{n: mode for n in tuner.plan} for mode in ("split_reduce", "hierarchical")]
                                  + [mixed])
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100_000 * hvd.rank() + step))
            opt.zero_grad()
            ((model(x) - x @ w_true) ** 2).mean().backward()
            opt.step()
            out["modes"].append(sorted(set(tuner.plan.values())))
        out.update(history=list(tuner.history), costs=tuner.costs, figures=opt.stats(),
                   params={n: q.detach().clone() for n, q in model.named_parameters()})
        return out

    auto = auto_door(args.auto_steps) if args.auto_steps else None

    def lowrank_doors(steps):
        """PowerSGD across the hosts, both doors side by side (Average each): per door the transport's
        hosts, whether the NaN step left every parameter and residual as it was, the final parameters."""
        out = {}
        models = {}
        for door in ("opt", "stock"):
            torch.manual_seed(1234 + hvd.rank())
            model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
            named = [(f"lowrank.{n}", q) for n, q in model.named_parameters()]      # the same keys: the same Q's
            base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            if door == "opt":
                opt = hvd_topk.DistributedOptimizer(base, named_parameters=named, compression=hvd_topk.PowerSGD(
                    rank=2, communication="hierarchical"))
                transport, residuals = opt._hvd_topk.transports["hierarchical"], opt._hvd_topk.residuals.residuals
            else:
                comp = hvd_topk.PowerSGD(rank=2, named_parameters=named, communication="hierarchical")
                opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=comp)
                transport, residuals = None, comp.memory.residuals
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            models[door] = (model, opt, residuals, comp if door == "stock" else None)
            out[door] = {"transport": transport}
        for step in range(steps):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100_000 * hvd.rank() + step))
            for door, (model, opt, residuals, comp) in models.items():
                opt.zero_grad()
                loss = ((model(x) - x @ w_true) ** 2).mean()
                if step == 1 and hvd.rank() == args.nan_rank:
                    loss = loss * float("nan")
                loss.backward()
                before = [q.detach().clone() for q in model.parameters()]
                kept = {k: None if v is None else v.clone() for k, v in residuals.items()}
                opt.synchronize()
                with opt.skip_synchronize(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if all(torch.isfinite(q.grad).all() for q in model.parameters()):
                        opt.step()
                if step == 1:
                    out[door]["skipped"] = all(torch.equal(a, q) for a, q in zip(before, model.parameters())) and \
                        all((v is None and kept[k] is None) or torch.equal(v, kept[k]) for k, v in residuals.items())
        out["stock"]["transport"] = models["stock"][3].transport      # built at its first compress
        for door, (model, *_) in models.items():
            t = out[door]["transport"]
            out[door] = dict(skipped=out[door].get("skipped"), params=[q.detach().clone() for q in model.parameters()],
                             hosts=None if t.hosts is None else (t.hosts.host.ranks, t.hosts.cross.ranks),
                             launches=list(t.launches))
        return out

    lowrank = lowrank_doors(args.lowrank_steps) if args.lowrank_steps else None

    def dense_fp16(steps):
        """hvd_topk's dense_fp16 pinned for the matrices, communication='hierarchical', in float32: per step
        the gradients, the aggregate and the residuals; the last step's stats, the final parameters."""
        torch.manual_seed(1234 + hvd.rank())
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).float()
        named = [(f"fp16.{n}", q) for n, q in model.named_parameters()]
        opt = hvd_topk.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), named_parameters=named,
            compression=hvd_topk.TopKEF(ratio=args.ratio, min_numel=64), communication="hierarchical",
            settings=hvd_topk.OptimizerSettings(pin={n: "dense_fp16" for n, q in named if q.dim() > 1}))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        out = {"grads": [], "aggregates": [], "residuals": []}
        for step in range(steps):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100_000 * hvd.rank() + step)).float()
            opt.zero_grad()
            loss = ((model(x) - x @ w_true.float()) ** 2).mean()
            if step == 1 and hvd.rank() == args.nan_rank:
                loss = loss * float("nan")
            grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            loss.backward()
            opt.synchronize()
            out["grads"].append({n: g.clone() for (n, _), g in zip(named, grads)})
            out["aggregates"].append({n: q.grad.clone() for n, q in named})
            with opt.skip_synchronize(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if all(torch.isfinite(q.grad).all() for q in model.parameters()):
                    opt.step()
            out["residuals"].append({k: None if v is None else v.clone()
                                     for k, v in opt._hvd_topk.residuals.residuals.items()})
        out.update(stats=opt.stats(), params={n: q.detach().clone() for n, q in named})
        return out

    fp16 = dense_fp16(args.fp16_steps) if args.fp16_steps else None

result = {"params": {door: {n: q.detach().clone() for n, q in m.named_parameters()} for door, (m, *_) in doors.items()},
          "record": record, "elapsed_s": elapsed, "ratio_one": ratio_one_params, "auto": auto,
          "lowrank": lowrank, "fp16": fp16,
          "warnings": [str(w.message) for w in seen],
          "transports": {door: type(t).__name__ for door, (*_, t) in doors.items()},
          "sets": {door: None if not hasattr(t, "sets") else (t.sets.host.ranks, t.sets.cross.ranks, t.sets.position)
                   for door, (*_, t) in doors.items()},
          "where": {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
                    "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
                    "cross_size": hvd.cross_size(), "hostname": socket.gethostname()}}
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
