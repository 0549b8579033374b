"""A multi-rank job that misbehaves on purpose: one rank SIGKILLs itself mid-step, or is a straggler.

Every rank writes ``<out>/pid<r>`` (its process id) at start. With ``--kill-rank``, that rank writes
``<out>/killed_at`` (time.time()) between its backward pass and ``step()`` of ``--kill-step`` (the
other ranks are then inside the step's collectives) and SIGKILLs itself. With ``--slow-rank``, every
rank simulates ``--work`` seconds of computation per step and that rank ``--slow-factor`` times as
much. Ranks that finish write ``<out>/rank<r>.pt``: final parameters, per-step wall times, residual and
gradient norms. Data depend only on (rank, step).
"""
import argparse
import os
import signal
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["hvd_topk", "topkef"], default="hvd_topk",
               help="hvd_topk.DistributedOptimizer, or TopKEF in stock hvd.DistributedOptimizer")
p.add_argument("--ratio", type=float, default=0.01)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--slow-rank", type=int, default=-1)
p.add_argument("--slow-factor", type=float, default=10.0)
p.add_argument("--work", type=float, default=0.0, help="simulated compute seconds per step")
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
with open(os.path.join(args.out, f"pid{hvd.rank()}"), "w") as f:
    f.write(str(os.getpid()))

torch.manual_seed(1234)
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
if args.mode == "hvd_topk":
    opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=hvd_topk.TopKEF(ratio=args.ratio, min_numel=64))
    residual_norm = lambda: opt.stats()["residual_norm"]         # noqa: E731
else:
    compressor = hvd_topk.TopKEF(ratio=args.ratio, min_numel=64, named_parameters=model.named_parameters())
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compressor)
    residual_norm = lambda: compressor.memory.norm()             # noqa: E731
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
work = args.work * (args.slow_factor if hvd.rank() == args.slow_rank else 1.0)
step_s, residual_norms, grad_norms = [], [], []
for step in range(args.steps):
    t0 = time.perf_counter()
    opt.zero_grad()
    gen = torch.Generator().manual_seed(100_000 * hvd.rank() + step)
    x = torch.randn(16, 32, generator=gen)
    loss = ((model(x) - x @ w_true) ** 2).mean()
    loss.backward()                   # the gradients' allreduces start here (Horovod's hooks)
    if work:
        time.sleep(work)
    if hvd.rank() == args.kill_rank and step == args.kill_step:
        with open(os.path.join(args.out, "killed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    grad_norms.append(float(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).norm()))
    opt.step()
    step_s.append(time.perf_counter() - t0)
    residual_norms.append(residual_norm())

torch.save({"params": {n: q.detach().clone() for n, q in model.named_parameters()}, "step_s": step_s,
            "residual_norms": residual_norms, "grad_norms": grad_norms, "work_s": work},
           os.path.join(args.out, f"rank{hvd.rank()}.pt"))
