"""A multi-rank job for hvd_topk.DistributedOptimizer tests (synthetic regression on an MLP).

Every rank writes ``<out>/rank<r>.pt``: final parameters, its local gradients per step (if asked), the
optimizer's per-rank state and stats, and where it ran (rank, local_rank, cross_rank, hostname). Data
depend only on (rank, step), so runs can be resumed. ``--mode topkef`` is the other front door: stock
hvd.DistributedOptimizer with compression=hvd_topk.TopKEF (its residuals saved as the checkpoint's
``compressor`` extra).
"""
import argparse
import os
import socket
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["hvd_topk", "stock", "topkef"], default="hvd_topk")
p.add_argument("--communication", default="artopk")
p.add_argument("--leader", default="star")
p.add_argument("--selection", default="layerwise")
p.add_argument("--ratio", type=float, default=0.01)
p.add_argument("--compress", choices=["gradient", "update"], default="gradient")
p.add_argument("--local-momentum", choices=["on", "off"], default="on")
p.add_argument("--second-moment", choices=["local", "frozen"], default="local")
p.add_argument("--min-numel", type=int, default=64)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--width", type=int, default=64)
p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
p.add_argument("--lr", type=float, default=0.001)
p.add_argument("--momentum", type=float, default=0.9)
p.add_argument("--nesterov", action="store_true")
p.add_argument("--weight-decay", type=float, default=0.0)
# auto: on wherever it applies (SGD with momentum, compress='gradient'), so the optimizer tests run
# DGC's path, which has more to go wrong; the library's default is off.
p.add_argument("--mc", choices=["auto", "on", "off"], default="auto")
p.add_argument("--warmup-steps", type=int, default=0)
p.add_argument("--dense-steps", type=int, default=0)
p.add_argument("--clip", type=float, default=None)
p.add_argument("--op", choices=["average", "sum"], default="average")
p.add_argument("--bpps", type=int, default=1)
p.add_argument("--groups", type=int, default=0, help="Horovod's groups (0: none)")
p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
p.add_argument("--value-dtype", choices=["none", "float16"], default="none")
p.add_argument("--record-grads", action="store_true")
p.add_argument("--save-at", type=int, default=-1, help="save a per-rank checkpoint after this step and exit")
p.add_argument("--save-path", default=None,
               help="checkpoint path (default <out>/ckpt.pt); {host} becomes this host's name, as for a "
                    "node-local disk")
p.add_argument("--continue-after-save", action="store_true", help="train on to --steps after saving")
p.add_argument("--resume", default=None, help="checkpoint path to resume from ({host}: as --save-path)")
p.add_argument("--amp", action="store_true", help="bf16 autocast + GradScaler")
p.add_argument("--overflow-rank", type=int, default=-1)
p.add_argument("--overflow-step", type=int, default=-1)
p.add_argument("--adaptive-ratio", action="store_true")
p.add_argument("--adaptive-weight", type=float, default=0.5)
p.add_argument("--auto-every", type=int, default=50)
p.add_argument("--skew-clock-rank", type=int, default=-1, help="this rank's step clock runs 5x fast")
p.add_argument("--overflow-one-tensor", action="store_true",
               help="make only one tensor's gradient non-finite (a hook), instead of the loss")
p.add_argument("--timeline", default=None,
               help="Horovod's timeline of this run alone, from hvd.init to the end (the launch needs "
                    "HOROVOD_TIMELINE=DYNAMIC)")
args = p.parse_args()
host = socket.gethostname()
save_path = (args.save_path or os.path.join(args.out, "ckpt.pt")).replace("{host}", host)
resume_path = args.resume and args.resume.replace("{host}", host)

hvd.init()
if args.timeline:
    hvd.start_timeline(args.timeline)
torch.set_num_threads(1)
dtype = getattr(torch, args.dtype)
torch.manual_seed(1234 + hvd.rank())           # different init per rank: broadcast must fix it
model = nn.Sequential(nn.Linear(32, args.width), nn.Tanh(), nn.Linear(args.width, args.width), nn.Tanh(),
                      nn.Linear(args.width, 1)).to(dtype)
if args.optimizer == "sgd":
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, nesterov=args.nesterov,
                           weight_decay=args.weight_decay)
else:
    base = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
op = hvd.Average if args.op == "average" else hvd.Sum
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if args.amp else None
compressor = None
if args.mode == "stock":
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=op,
                                   backward_passes_per_step=args.bpps, groups=args.groups or None)
elif args.mode == "topkef":
    compressor = hvd_topk.TopKEF(ratio=args.ratio, min_numel=args.min_numel,
                                 named_parameters=model.named_parameters())
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=op,
                                   compression=compressor, backward_passes_per_step=args.bpps,
                                   groups=args.groups or None)
else:
    opt = hvd_topk.DistributedOptimizer(
        base, named_parameters=model.named_parameters(),
        compression=hvd_topk.TopKEF(ratio=args.ratio, min_numel=args.min_numel), op=op,
        backward_passes_per_step=args.bpps, groups=args.groups or None, communication=args.communication,
        grad_scaler=scaler, settings=hvd_topk.OptimizerSettings(
            leader=args.leader, selection=args.selection,
            momentum_correction={"auto": args.optimizer == "sgd" and args.momentum > 0 and args.compress == "gradient",
                                 "on": True, "off": False}[args.mc],
            warmup_steps=args.warmup_steps, dense_steps=args.dense_steps, clip_grad_norm=args.clip,
            value_dtype=None if args.value_dtype == "none" else torch.float16,
            adaptive_ratio=True if args.adaptive_ratio else None, adaptive_weight=args.adaptive_weight,
            auto_every=args.auto_every, compress=args.compress, local_momentum=args.local_momentum == "on",
            second_moment=args.second_moment))
    if hvd.rank() == args.skew_clock_rank:      # decisions must not depend on one rank's timings
        opt._hvd_topk.clock = lambda: 5.0 * time.perf_counter()
start = 0
if resume_path and args.compress == "gradient":
    extra = hvd_topk.load_checkpoint(resume_path, model, opt)
    start = extra["next_step"]
    if compressor is not None:
        compressor.load_state_dict(extra["compressor"])
# After a resume too: broadcasting must not overwrite the per-rank residuals just loaded (the resume
# test would see it, since every rank's residuals differ).
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
if resume_path and args.compress == "update":
    # compress='update': the wrapped optimizer's state is per rank too, and Horovod's broadcast would
    # overwrite it with rank 0's: load after broadcasting (as the examples always do).
    start = hvd_topk.load_checkpoint(resume_path, model, opt)["next_step"]
initial = {n: q.detach().clone() for n, q in model.named_parameters()}

def inner_state(o):
    """The wrapped optimizer's own per-parameter state (momentum buffers, Adam's moments and step)."""
    names = {q: n for n, q in model.named_parameters()}
    return {("opt", names[q], k): v.clone() for q, st in o.state.items() for k, v in st.items()
            if torch.is_tensor(v)}


initial_inner = inner_state(opt)   # Horovod's broadcast_optimizer_state may have started SGD's buffers
current = {"step": -1}
model[2].weight.register_hook(
    lambda g: g * float("nan") if (args.overflow_one_tensor and current["step"] == args.overflow_step
                                    and hvd.rank() == args.overflow_rank) else g)
w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7), dtype=dtype)
grads, stats, skipped = [], [], []
for step in range(start, args.steps):
    current["step"] = step
    opt.zero_grad(set_to_none=True) if args.mode == "hvd_topk" else opt.zero_grad()  # stock rejects the keyword
    gen = torch.Generator().manual_seed(100_000 * hvd.rank() + step)
    local = None
    for _ in range(args.bpps):
        x = torch.randn(16, 32, generator=gen, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            loss = ((model(x).to(dtype) - x @ w_true) ** 2).mean()
        if step == args.overflow_step and hvd.rank() == args.overflow_rank and not args.overflow_one_tensor:
            loss = loss * float("inf")
        if args.record_grads:
            g = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            local = g if local is None else [a + b for a, b in zip(local, g)]
        (scaler.scale(loss) if scaler else loss).backward()
    if args.record_grads:
        grads.append({n: t.detach().clone() for (n, _), t in zip(model.named_parameters(), local)})
    before = {n: q.detach().clone() for n, q in model.named_parameters()}
    if args.mode == "hvd_topk":
        snapshot = {k: None if v is None else v.clone() for k, v in opt._hvd_topk.residuals.residuals.items()}
        snapshot.update({("u", k): v.clone() for k, v in opt._hvd_topk.momentum.velocities.items()})
        snapshot.update(inner_state(opt))
    if scaler is not None:
        opt.synchronize()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    if step == args.overflow_step:
        now = {k: None if v is None else v.clone() for k, v in opt._hvd_topk.residuals.residuals.items()}
        now.update({("u", k): v.clone() for k, v in opt._hvd_topk.momentum.velocities.items()})
        now.update(inner_state(opt))
        skipped.append({
            "params_unchanged": all(torch.equal(before[n], q) for n, q in model.named_parameters()),
            "state_unchanged": now.keys() == snapshot.keys() and all(
                (v is None and snapshot[k] is None) or torch.equal(v, snapshot[k]) for k, v in now.items()),
            "had_residuals": len(snapshot) > 0, "scale": scaler.get_scale() if scaler else None})
    if args.mode == "hvd_topk":
        stats.append(opt.stats())
    if step == args.save_at:
        extra = {} if compressor is None else {"compressor": compressor.state_dict()}
        os.makedirs(os.path.dirname(save_path), exist_ok=True)
        hvd_topk.save_checkpoint(save_path, model, opt, next_step=step + 1, **extra)
        if not args.continue_after_save:
            break

if args.timeline:
    hvd.stop_timeline()
result = {"params": {n: q.detach().clone() for n, q in model.named_parameters()}, "initial": initial,
          "initial_inner": initial_inner,
          "grads": grads, "stats": stats, "skipped": skipped,
          "where": {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
                    "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
                    "cross_size": hvd.cross_size(), "hostname": host}}
result["inner"] = inner_state(opt)
if args.mode == "hvd_topk":
    result["state"] = opt.state_dict()["hvd_topk"]
    result["auto"] = opt.auto_state()
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
