"""Step time and link bytes of TopKEF and hvd_topk.DistributedOptimizer against dense Horovod, side by
side in one run.

A deep MLP (default 31 Linear layers = 62 parameter tensors) on 2 ranks (horovodrun, Gloo) in a
private network namespace with an unlimited loopback. Modes: dense; TopKEF in stock Horovod with the
one-step-stale index sets (default: one asynchronous allgather per step) and with a blocking index
broadcast per tensor;
hvd_topk.DistributedOptimizer (momentum correction on) with artopk layerwise, artopk global, allgather,
and at density 1 (ratio 1.0, the path of dense_steps and of auto's all-dense plan; and
communication='dense'); and with Horovod's ``groups=1`` (modes ending in "grouped").

    python -m bench.steptime                    # prints a table; --json-out to save it
    python -m bench.steptime --depth 60 --width 512 --ratio 0.001
    python -m bench.steptime --modes "hvd_topk ratio 1.0,hvd_topk dense"   # the density-1 paths
(Run bench scripts as modules from the repository root: bench/select.py would shadow the standard
library's ``select`` module if bench/ were on sys.path.)
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"dense": [], "topkef (stale indices)": ["--topkef"],
         "topkef (sync indices)": ["--topkef", "--sync-indices"],
         "hvd_topk artopk layerwise": ["--hvd-topk", "artopk", "layerwise"],
         "hvd_topk artopk global": ["--hvd-topk", "artopk", "global"],
         "hvd_topk allgather layerwise": ["--hvd-topk", "allgather", "layerwise"],
         # density 1: the path of dense_steps, ratio=1.0 and auto's all-dense plan (the last --ratio wins)
         "hvd_topk ratio 1.0": ["--hvd-topk", "artopk", "layerwise", "--ratio", "1.0"],
         "hvd_topk dense": ["--hvd-topk", "dense", "layerwise"],
         # Horovod's groups=1: every gradient in one grouped collective (per kind), once all are ready
         "topkef grouped": ["--topkef", "--groups", "1"],
         "hvd_topk artopk grouped": ["--hvd-topk", "artopk", "layerwise", "--groups", "1"],
         "hvd_topk allgather grouped": ["--hvd-topk", "allgather", "layerwise", "--groups", "1"]}


def worker(args):
    import horovod.torch as hvd
    import torch
    import torch.nn as nn

    import hvd_topk
    from hvd_topk import TopKEF
    from testbed.wire import loopback_bytes

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width) for _ in range(args.depth)] + [nn.Linear(args.width, 1)]
    model = nn.Sequential(*layers)
    base = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if args.hvd_topk:
        communication, selection = args.hvd_topk
        opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                            compression=TopKEF(ratio=args.ratio), communication=communication,
                                            selection=selection, groups=args.groups or None)
    else:
        named = list(model.named_parameters())
        compression = (TopKEF(ratio=args.ratio, sync_indices=args.sync_indices, named_parameters=named)
                       if args.topkef else hvd.Compression.none)
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression,
                                       groups=args.groups or None)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(32, args.width), torch.randn(32, 1)
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            hvd.allreduce(torch.zeros(1), name="barrier")
            tx0 = loopback_bytes()[0]
        t0 = time.perf_counter()
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    hvd.allreduce(torch.zeros(1), name="barrier.end")
    tx = loopback_bytes()[0] - tx0
    if hvd.rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump({"median_step_s": statistics.median(times[args.warmup:]),
                       "bytes_per_rank_per_step": tx / hvd.size() / args.steps,
                       "tensors": len(list(model.parameters())),
                       "params": sum(p.numel() for p in model.parameters())}, f)


def driver(args):
    from testbed.launch import run_job
    from testbed.wire import Namespace, can_make_namespace

    modes = {m: MODES[m] for m in ["dense"] + [m for m in args.modes.split(",") if m and m != "dense"]}
    rows = {}
    for rep in range(args.repeats):                 # interleaved repeats: the machine is noisy
        for mode, flags in modes.items():
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "r.json")
                argv = [sys.executable, "-m", "bench.steptime", "--worker", "--json-out", out,
                        "--depth", str(args.depth), "--width", str(args.width), "--ratio", str(args.ratio),
                        "--steps", str(args.steps), "--warmup", str(args.warmup), *flags]
                ns = Namespace() if can_make_namespace() else contextlib.nullcontext()
                with ns:
                    run_job(args.np, argv, timeout=900, prefix=getattr(ns, "prefix", ()), cwd=ROOT)
                with open(out) as f:
                    rows.setdefault(mode, []).append(json.load(f))
    first = rows["dense"][0]
    print(f"{args.np} ranks, {first['tensors']} parameter tensors, {first['params']:,} parameters, "
          f"ratio {args.ratio}, unlimited loopback, median of {args.steps} steps x {args.repeats} runs")
    dense_t = statistics.median(r["median_step_s"] for r in rows["dense"])
    dense_b = statistics.median(r["bytes_per_rank_per_step"] for r in rows["dense"])
    print(f"| {'mode':<24} | {'step ms':>8} | {'vs dense':>8} | {'bytes/rank/step':>15} | {'bytes vs dense':>14} |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 10}|{'-' * 17}|{'-' * 16}|")
    table = {}
    for mode, rs in rows.items():
        t = statistics.median(r["median_step_s"] for r in rs)
        b = statistics.median(r["bytes_per_rank_per_step"] for r in rs)
        table[mode] = {"step_ms": t * 1e3, "step_vs_dense": t / dense_t, "bytes": b, "bytes_vs_dense": b / dense_b}
        print(f"| {mode:<24} | {t * 1e3:8.2f} | {t / dense_t:7.2f}x | {b:15,.0f} | {b / dense_b:13.4f}x |")
    if args.json_out:
        from bench.manifest import manifest
        with open(args.json_out, "w") as f:
            json.dump({**table, "manifest": manifest()}, f, indent=1)


def _modes(text):
    unknown = [m for m in text.split(",") if m and m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    return text


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--depth", type=int, default=30)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json-out", default=None)
    p.add_argument("--modes", default=",".join(MODES), type=_modes,
                   help="comma-separated subset of: " + ", ".join(MODES) + " (dense always runs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--topkef", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync-indices", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--groups", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--hvd-topk", nargs=2, metavar=("COMMUNICATION", "SELECTION"), help=argparse.SUPPRESS)
    a = p.parse_args()
    worker(a) if a.worker else driver(a)
