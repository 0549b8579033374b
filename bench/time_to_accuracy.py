"""Time to accuracy: PyTorch DDP's hooks and the Horovod / hvd_topk modes, side by side in one job.

Every mode trains its own copy of the same model (same seed, same batches, the wide digits CNN of
examples/digits_cnn.py, SGD lr 0.05 momentum 0.9, 16 per rank) in ONE horovodrun job (Gloo,
``HOROVOD_CYCLE_TIME=20``) inside a fresh network namespace whose loopback is limited by tbf:

- ``ddp``, ``ddp fp16``, ``ddp powersgd r4``: torch DDP over torch.distributed on Gloo, as
  bench/ddp_hooks.py runs them (PowerSGD: torch's hook, the model in one bucket, 2 dense steps first);
- ``horovod dense``: ``hvd.DistributedOptimizer``, no compression;
- ``topkef``: stock ``hvd.DistributedOptimizer`` with ``compression=hvd_topk.TopKEF(ratio=0.01)`` (its
  default transport, split_reduce); ``topkef artopk``: the same with ``communication='artopk'``;
- ``hvd_topk``: ``hvd_topk.DistributedOptimizer`` with its defaults, ratio 0.01; on request
  ``hvd_topk warmup`` (DGC's warm-up: the density falls from ratio ** (1/(W+1)) to the ratio over
  ``--warmup-steps`` W steps) and ``hvd_topk dgc`` (that warm-up and DGC's momentum correction);
- on request across emulated hosts (``--hosts 2``, eth0 limited by tbf, the job with
  ``HOROVOD_DYNAMIC_PROCESS_SETS=1``): ``topkef hierarchical`` and ``hvd_topk hierarchical``.

Horovod and torch.distributed run in the same processes (``hvd.init()``, then torch.distributed's
Gloo group as bench/ddp_hooks.py makes it); each Horovod optimizer names its parameters with a
prefix of its own (``m<i>.``), so no two modes' collectives share a name.

Protocol: ``--warmup`` steps of each mode alone, then turns of ``--turn`` steps per mode, the order
rotating every round, until every mode has made ``--steps`` steps. Each turn starts and ends with an
allreduce of the interface counters (bytes per turn, as bench/ddp_hooks.py). After every
``--eval-every``-th step of a mode (and its last) rank 0 evaluates that mode's test accuracy, untimed,
and a barrier follows (the parameters are identical on every rank, so one evaluation is enough, and
no rank runs ahead into the next collective). Training time of a mode: the sum of rank 0's step
times (``zero_grad()`` to the end of ``step()``), warm-up included; time to a target: the training
time at the first evaluation at or above it.

    python -m bench.time_to_accuracy --bandwidth 100mbit --steps 200 --eval-every 10 --turn 5 \\
        --out bench/results/time_to_accuracy_digits_100mbit
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
import types

from bench import ddp_hooks
from bench.constants import CYCLE_TIME_MS, ROOT

DDP_MODES = ("ddp", "ddp fp16", "ddp powersgd r4")
HVD_MODES = ("horovod dense", "topkef", "topkef artopk", "hvd_topk")
# on request: the levers of Top-K's accuracy per step in the first epochs
EXTRA_MODES = ("hvd_topk warmup", "hvd_topk dgc", "topkef hierarchical", "hvd_topk hierarchical")
MODES = DDP_MODES + HVD_MODES
RATIO = 0.01
DENSE = "horovod dense"          # the reference of "dense final - 1 pt"


# -- the job ------------------------------------------------------------------------------------------
def build_arm(i, mode, task, a):
    """Mode ``mode``'s own model copy (seed 0) and its optimizer; ``forward`` is what the batch goes through."""
    import horovod.torch as hvd
    import torch

    import hvd_topk

    torch.manual_seed(0)
    model = task.build()
    arm = types.SimpleNamespace(mode=mode, model=model, forward=model, steps=0, step_s=[], bytes=[], curve=[])
    if mode in DDP_MODES:
        arm.forward, _, _ = ddp_hooks.wrap(model, mode, a)
        arm.opt = task.make_opt(arm.forward)
        return arm
    named = [(f"m{i}.{n}", p) for n, p in model.named_parameters()]       # Horovod's names, per mode
    base = task.make_opt(model)
    if mode.startswith("hvd_topk"):
        levers = {"hvd_topk warmup": dict(warmup_steps=a.warmup_steps),
                  "hvd_topk dgc": dict(warmup_steps=a.warmup_steps, momentum_correction=True)}.get(mode, {})
        if mode == "hvd_topk hierarchical":
            levers = dict(communication="hierarchical")
        arm.opt = hvd_topk.DistributedOptimizer(base, named_parameters=named,
                                                compression=hvd_topk.TopKEF(ratio=a.ratio), **levers)
    else:
        compression = hvd.Compression.none
        if mode.startswith("topkef"):
            compression = hvd_topk.TopKEF(ratio=a.ratio, named_parameters=named,
                                          communication=mode.split()[1] if " " in mode else "split_reduce")
        arm.opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return arm


def train_step(arm, task):
    """One timed step of ``arm``: rank 0's wall time, zero_grad to the end of step; added to its totals."""
    x, target = task.batch(arm.steps)
    t0 = time.perf_counter()
    arm.opt.zero_grad()
    task.loss(arm.forward(x), target).backward()
    arm.opt.step()
    arm.step_s.append(time.perf_counter() - t0)
    arm.steps += 1


def maybe_evaluate(arm, task, a, rank):
    """After every --eval-every-th step and the last: rank 0 adds (steps, training s, accuracy, loss) to
    the curve, untimed; then a barrier, so the other ranks wait here and not inside a timed step."""
    import torch.distributed as dist

    if arm.steps % a.eval_every and arm.steps != a.steps:
        return
    if rank == 0:
        m = arm.metrics(arm.model)
        arm.curve.append([arm.steps, sum(arm.step_s), m["test_accuracy"], m["test_loss"]])
    dist.barrier()


def worker(a):
    import horovod
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    hvd.init()
    rank, size, local_rank = ddp_hooks.init_group(a)
    torch.set_num_threads(1)
    task = ddp_hooks.digits_task(rank, size, a.batch_size, a.model)
    arms = [build_arm(i, mode, task, a) for i, mode in enumerate(a.modes)]
    for arm in arms:
        arm.metrics = task.metrics
        for _ in range(a.warmup):                 # each mode alone (PowerSGD's dense steps)
            train_step(arm, task)
            maybe_evaluate(arm, task, a, rank)
    r = 0
    while any(arm.steps < a.steps for arm in arms):
        for j in range(len(arms)):                # --turn steps each, the order rotating
            arm = arms[(r + j) % len(arms)]
            n = min(a.turn, a.steps - arm.steps)
            if n <= 0:
                continue
            tx0 = ddp_hooks.host_tx(a.iface, local_rank)
            for _ in range(n):
                train_step(arm, task)
                maybe_evaluate(arm, task, a, rank)
            arm.bytes.append((ddp_hooks.host_tx(a.iface, local_rank) - tx0) / n / size)
        r += 1
    out = {"example": "digits", "model": task.model, "ranks": size, "iface": a.iface, "warmup": a.warmup,
           "turn": a.turn, "steps": a.steps, "eval_every": a.eval_every, "batch_size": a.batch_size,
           "ratio": a.ratio, "rounds": r, "torch": torch.__version__, "horovod": horovod.__version__, "modes": {}}
    for arm in arms:
        out["modes"][arm.mode] = {"steps": arm.steps, "step_s": arm.step_s, "bytes": arm.bytes, "curve": arm.curve,
                                  "num_params": sum(p.numel() for p in arm.model.parameters()),
                                  "params_identical": ddp_hooks.params_identical(arm.model)}
    if rank == 0:
        with open(a.json_out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
    hvd.shutdown()


# -- analysis -----------------------------------------------------------------------------------------
def time_to(curve, target):
    """(training seconds, steps) at the first evaluation whose accuracy is at least ``target``; None when
    no evaluation reached it. ``curve``: [steps, training s, accuracy, loss] in the order evaluated."""
    for steps, train_s, acc, _ in curve:
        if acc >= target - 1e-9:
            return train_s, steps
    return None


def targets_of(record, targets):
    """[(name, accuracy)]: the fixed targets, then each reference's final accuracy less one point."""
    out = [(f"{t:.2f}", t) for t in targets]
    for ref in (DENSE, "ddp"):
        if ref in record["modes"] and record["modes"][ref]["curve"]:
            final = record["modes"][ref]["curve"][-1][2]
            out.append((f"{ref} final - 1 pt ({final - 0.01:.4f})", final - 0.01))
    return out


def rows_of(record, targets, bandwidth):
    """One row per mode: final accuracy, median step, bytes per rank per step, and per target the
    (training s, steps) at which the mode first reached it (None: not reached)."""
    rows = []
    for mode, m in record["modes"].items():
        final = m["curve"][-1] if m["curve"] else [m["steps"], sum(m["step_s"]), None, None]
        rows.append({"label": mode, "bandwidth": bandwidth, "ranks": record["ranks"], "model": record["model"],
                     "steps": m["steps"], "train_s": sum(m["step_s"]), "step_s": statistics.median(m["step_s"]),
                     "link_bytes": statistics.median(m["bytes"]) if m["bytes"] else None,
                     "final_accuracy": final[2], "final_loss": final[3], "params_identical": m["params_identical"],
                     "reached": {name: time_to(m["curve"], t) for name, t in targets_of(record, targets)}})
    return rows


def winners(rows):
    """Per target: the mode that reached it in the least training time (None when none did)."""
    out = {}
    for name in rows[0]["reached"] if rows else ():
        done = [(r["reached"][name][0], r["label"]) for r in rows if r["reached"][name]]
        out[name] = min(done)[1] if done else None
    return out


def _reached(hit):
    return "not reached" if hit is None else f"{hit[0]:,.1f} s ({hit[1]})"


def report(rows, record, command):
    L = ["# Time to accuracy, side by side in one job", "",
         (f"{record['hosts']} emulated hosts x {record['ranks'] // record['hosts']} ranks (bytes: the hosts' eth0)"
          if record.get("hosts") else f"{record['ranks']} ranks") +
         f", {rows[0]['bandwidth'] if rows else '-'} link, the {record['model']} digits CNN, "
         f"{record['steps']} steps per mode (warm-up {record['warmup']} alone, then turns of {record['turn']}), "
         f"test accuracy every {record['eval_every']} steps. Training time: the sum of rank 0's step times "
         "(zero_grad to the end of step), evaluation not included. Bytes: interface tx per step over the ranks "
         "(median of the turns). See `bench/time_to_accuracy.py`.", "", f"Command: `{command}`", ""]
    load = record.get("load_avg") or {}
    if load.get("samples"):
        L += [f"Load average (1 min) during the job: median {statistics.median(load['samples']):.1f}, "
              f"min {min(load['samples']):.1f}, max {max(load['samples']):.1f} ({len(load['samples'])} samples, "
              f"{os.cpu_count()} cores); job {record.get('job_s', '-')} s.", ""]
    names = list(rows[0]["reached"]) if rows else []
    L += ["Training seconds (steps) at which each mode first reached the target:", "",
          "| mode | " + " | ".join(names) + " | final acc | step ms (median) | bytes/rank/step | train s | same params |",
          "|---|" + "---:|" * len(names) + "---:|---:|---:|---:|---|"]
    for r in rows:
        acc = "-" if r["final_accuracy"] is None else f"{r['final_accuracy']:.4f}"
        nbytes = "-" if r["link_bytes"] is None else f"{r['link_bytes']:,.0f}"
        L.append(f"| {r['label']} | " + " | ".join(_reached(r["reached"][n]) for n in names)
                 + f" | {acc} | {1e3 * r['step_s']:,.1f} | {nbytes} | {r['train_s']:,.1f} | "
                 f"{'yes' if r['params_identical'] else 'NO'} |")
    L += ["", "Fastest to each target:", ""]
    L += [f"- {n}: {w or 'no mode reached it'}" for n, w in winners(rows).items()]
    L += ["", "Accuracy curves (steps: accuracy):", ""]
    for mode, m in record["modes"].items():
        L.append(f"- {mode}: " + ", ".join(f"{c[0]}: {c[2]:.3f}" for c in m["curve"]))
    return "\n".join(L) + "\n"


# -- the driver ---------------------------------------------------------------------------------------
def worker_argv(a, json_out, iface):
    return [sys.executable, "-m", "bench.time_to_accuracy", "--worker", "--json-out", json_out, "--iface", iface,
            "--model", a.model, "--modes", ",".join(a.modes), "--warmup", str(a.warmup), "--steps", str(a.steps),
            "--turn", str(a.turn), "--eval-every", str(a.eval_every), "--batch-size", str(a.batch_size),
            "--ratio", str(a.ratio), "--master-port", str(a.master_port), "--gloo-timeout", str(a.gloo_timeout),
            "--warmup-steps", str(a.warmup_steps)]


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``every`` seconds while the job runs (the machine is shared)."""

    def __init__(self, every=15.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.done = every, [], threading.Event()

    def run(self):
        while True:
            self.samples.append(round(os.getloadavg()[0], 2))
            if self.done.wait(self.every):
                return


def driver(a):
    from bench.manifest import write_manifest

    command = "python -m bench.time_to_accuracy " + shlex.join(sys.argv[1:])
    os.makedirs(a.out, exist_ok=True)
    write_manifest(a.out, command)
    load = LoadSampler()
    load.start()
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "r.json")
        t0 = time.perf_counter()
        try:
            sets = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"} if a.hosts else {}      # hierarchical's host sets
            # Horovod's Gloo waits --gloo-timeout too, as torch.distributed's does: at its default 30 s,
            # three jobs across the loaded hosts aborted (bench/results/time_to_accuracy_digits_100mbit_2hosts)
            env = {"HOROVOD_CYCLE_TIME": a.cycle_ms, "HOROVOD_GLOO_TIMEOUT_SECONDS": str(a.gloo_timeout), **sets}
            ddp_hooks.run(a, js, argv_of=worker_argv, env=env)
        finally:
            load.done.set()
        with open(js) as f:
            record = json.load(f)
    record.update(command=command, job_s=round(time.perf_counter() - t0, 1), bandwidth=a.bandwidth, hosts=a.hosts,
                  targets=a.targets, load_avg={"every_s": load.every, "samples": load.samples})
    with open(os.path.join(a.out, "record.json"), "w") as f:
        json.dump(record, f)
    rows = rows_of(record, a.targets, a.bandwidth)
    with open(os.path.join(a.out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    text = report(rows, record, command)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("wide", "cnn"), default="wide",
                   help="the wide digits CNN (6.3M parameters) or the small one (0.15M, for tests)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES + EXTRA_MODES)}")
    p.add_argument("--warmup-steps", type=int, default=45,
                   help="the warm-up modes' W (45: one epoch of the digits at 2 ranks x 16)")
    ddp_hooks.add_job_args(p, master_port=29527, gloo_timeout=300, timeout=3600)
    p.add_argument("--steps", type=int, default=200, help="steps per mode (warm-up included)")
    p.add_argument("--warmup", type=int, default=3, help="steps of every mode alone first (> 2: PowerSGD's dense steps)")
    p.add_argument("--turn", type=int, default=5, help="steps of one mode in a row")
    p.add_argument("--eval-every", type=int, default=10, help="test accuracy after every N-th step of a mode")
    p.add_argument("--targets", default="0.90,0.95,0.97", help="test accuracies, comma-separated")
    p.add_argument("--ratio", type=float, default=RATIO, help="Top-K ratio of the TopKEF / hvd_topk modes")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--cycle-ms", default=CYCLE_TIME_MS, help="HOROVOD_CYCLE_TIME of the job")
    p.add_argument("--out", default=None, help="results folder (default bench/results/time_to_accuracy_digits_<link>)")
    a = p.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    if [m for m in a.modes if m not in MODES + EXTRA_MODES] or not a.modes or len(set(a.modes)) != len(a.modes):
        p.error(f"--modes takes {list(MODES + EXTRA_MODES)}, each once; got {a.modes}")
    ddp_hooks.check_job_args(p, a)
    for name in ("steps", "turn", "eval_every", "batch_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if not ddp_hooks.START_POWERSGD_ITER < a.warmup < a.steps:
        p.error(f"--warmup must be more than {ddp_hooks.START_POWERSGD_ITER} and less than --steps, got {a.warmup}")
    try:
        a.targets = sorted(float(t) for t in a.targets.split(",") if t)
    except ValueError:
        p.error(f"--targets takes accuracies such as 0.90,0.95, got {a.targets!r}")
    a.powersgd_layout = "one-bucket"        # for bench.ddp_hooks' wrap()
    if not a.worker and a.out is None:
        a.out = os.path.join(ROOT, "bench", "results", f"time_to_accuracy_digits_{a.bandwidth}"
                             + (f"_{a.hosts}hosts" if a.hosts else ""))
    return a


if __name__ == "__main__":
    args = parse_args()
    worker(args) if args.worker else driver(args)
