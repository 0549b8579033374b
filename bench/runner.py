"""The runner: the chosen arms trained side by side in ONE job (each seed in turn), and the driver
that launches it.

In every rank (``python -m bench.runner SPEC.json``, started by ``drive``): every arm gets its own copy
of the task's model (same seed, so the same weights) and sees the same batches. First each arm runs
``warmup`` steps alone (PowerSGD's dense steps among them; ``hvd_topk auto`` until its probe and its
trial of plans are over, at most ``max_warmup`` steps). Then the arms take turns of ``turn`` steps, the
order rotating every round, until each has made ``steps - warmup`` steps in turns (``steps`` in all;
auto, after its longer warm-up, as many in turns): a slow spell of the machine falls on all arms alike.
Per arm:

- step time: rank 0's wall time from ``zero_grad()`` to the end of ``step()``; the median is over the
  steps of the turns, less each turn's first step when turns are longer than one step (it follows
  another arm's step, not one of its own);
- bytes per rank per step: the interface counters summed over the hosts at each turn's start and end
  (both a collective, so a turn's bytes are its own, the counters' few hundred bytes included);
- the evaluation curve: after every ``eval_every``-th step and the last, rank 0 evaluates, untimed,
  and a barrier follows: [steps, training seconds (sum of the step times so far), accuracy, loss];
- ``stats()`` after each step (numbers only), as they are reported: hvd_topk's optimizer's, or, in stock
  Horovod's optimizer, its TopKEF's or PowerSGD's;
- whether the parameters are identical on every rank at the end.

Horovod (``hvd.init``) runs when an arm uses it, torch.distributed's Gloo group when a DDP arm does;
the runner's own collectives go through torch.distributed when it is there, else Horovod.
"""
import datetime
import json
import os
import sys
import tempfile
import time

import horovod
import horovod.torch as hvd
import torch
import torch.distributed as dist

from bench.arms import START_POWERSGD_ITER, build_arm, needs_host_sets, parse_arm
from bench.links import iface_tx, launcher_env, run_ranks
from bench.tasks import Task

__all__ = ["drive", "main", "job_env"]


class Group:
    """The runner's own collectives, over torch.distributed when a DDP arm made its group, else Horovod."""

    def __init__(self, torch_group):
        self.torch_group = torch_group

    def sum(self, value):
        t = torch.tensor([float(value)], dtype=torch.float64)
        if self.torch_group:
            dist.all_reduce(t)
            return t.item()
        return hvd.allreduce(t, op=hvd.Sum, name="bench.sum").item()

    def host_tx(self, iface, local_rank):
        """``iface``'s tx counter summed over the hosts (each host's first rank reads it)."""
        return self.sum(iface_tx(iface) if local_rank == 0 else 0)

    def identical(self, model):
        """True on every rank when ``model``'s parameters are bitwise rank 0's on every rank."""
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        if self.torch_group:
            ref = flat.clone()
            dist.broadcast(ref, 0)
        else:
            ref = hvd.broadcast(flat, root_rank=0, name="bench.params")
        return self.sum(0.0 if torch.equal(flat, ref) else 1.0) == 0.0


def auto_busy(arm):
    """True while ``hvd_topk auto`` has not probed yet or its trial of plans is under way."""
    state = arm.opt.auto_state() if hasattr(arm.opt, "auto_state") else None
    if state is None or "auto" not in arm.name:
        return False
    return state["costs"] is None or "trial of" in str(state["history"][-1][3])


def train_step(arm, task, spec, group, rank):
    """One step of ``arm``, timed on this rank; then its stats and, when due, its evaluation."""
    x, target = task.batch(arm.steps)
    if "warmup" in task.recipe:
        for g in arm.opt.param_groups:
            g["lr"] = task.lr_at(arm.steps)
    if hasattr(arm.opt, "set_epoch"):
        arm.opt.set_epoch(arm.steps // task.steps_per_epoch)
    t0 = time.perf_counter()
    arm.opt.zero_grad()
    task.loss(arm.forward(x), target).backward()
    if task.clip and arm.kind == "horovod":          # the averaged gradient, as Horovod's docs clip it
        arm.opt.synchronize()
        torch.nn.utils.clip_grad_norm_(arm.model.parameters(), task.clip)
        with arm.opt.skip_synchronize():
            arm.opt.step()
    else:
        if task.clip:                                # DDP: the gradients are averaged after backward
            torch.nn.utils.clip_grad_norm_(arm.model.parameters(), task.clip)
        arm.opt.step()
    elapsed = time.perf_counter() - t0
    arm.step_s.append(elapsed)
    arm.steps += 1
    if arm.reporter is not None:
        arm.stats.append({k: v for k, v in arm.reporter.stats().items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)})
    if arm.steps % spec["eval_every"] == 0 or arm.steps == arm.last_step:
        if rank == 0:
            m = task.evaluate(arm.model)
            arm.curve.append([arm.steps, sum(arm.step_s), m["accuracy"], m["loss"]])
        group.sum(0)                                 # the other ranks wait here, not in a timed step
    return elapsed


def train(arms, task, spec, group, rank, local_rank, size):
    """The warm-up of each arm alone, then the rotating turns until every arm has made ``steps -
    warmup`` steps in turns (an arm whose warm-up ran longer, auto's, makes as many); returns the rounds."""
    for arm in arms:
        arm.last_step = spec["steps"]
        while arm.steps < spec["warmup"] or auto_busy(arm):
            if arm.steps >= spec["max_warmup"]:
                raise RuntimeError(f"{arm.name}: still probing or in its trial after {arm.steps} steps (max_warmup)")
            train_step(arm, task, spec, group, rank)
        arm.last_step = arm.steps + spec["steps"] - spec["warmup"]
    rounds = 0
    while any(arm.steps < arm.last_step for arm in arms):
        for j in range(len(arms)):
            arm = arms[(rounds + j) % len(arms)]
            n = min(spec["turn"], arm.last_step - arm.steps)
            if n <= 0:
                continue
            tx0 = group.host_tx(spec["iface"], local_rank)
            for k in range(n):
                elapsed = train_step(arm, task, spec, group, rank)
                if k or spec["turn"] == 1:
                    arm.measured_s.append(elapsed)
            arm.bytes.append((group.host_tx(spec["iface"], local_rank) - tx0) / n / size)
        rounds += 1
    return rounds


def main(spec_path):
    """One rank of the job ``spec_path`` describes: each of its seeds in turn, in one ``hvd.init()``;
    rank 0 writes the records, one per seed, to its ``json_out``."""
    with open(spec_path) as f:
        spec = json.load(f)
    rank, size, local_rank = launcher_env()
    kinds = {"ddp" if parse_arm(n)[0].startswith("ddp") else "horovod" for n in spec["arms"]}
    if "horovod" in kinds:
        # Dynamic sets, added by the arms that need them: auto removes them when no plan of its holds
        # hierarchical, and with them Horovod's own allreduce (the Horovod arms) took twice as long
        # across the emulated hosts (hvd_topk/transports/host_sets.py)
        hvd.init(process_sets="dynamic" if spec["hosts"] > 1 and needs_host_sets(spec["arms"]) else None)
    if "ddp" in kinds:
        os.environ["GLOO_SOCKET_IFNAME"] = spec["iface"]
        dist.init_process_group("gloo", init_method=f"tcp://{spec['master_addr']}:{spec['master_port']}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=spec["gloo_timeout"]))
    group = Group("ddp" in kinds)
    torch.set_num_threads(1)
    records = [run_seed(dict(spec, seed=seed), group, rank, local_rank, size) for seed in spec["seeds"]]
    if rank == 0:
        with open(spec["json_out"], "w") as f:
            json.dump(records, f)
    if "ddp" in kinds:
        dist.destroy_process_group()
    if "horovod" in kinds:
        hvd.shutdown()


def run_seed(spec, group, rank, local_rank, size):
    """Every arm of ``spec`` trained from ``spec["seed"]``; returns the seed's record (rank 0's is
    the one kept), with ``seed_s``: its seconds in the job."""
    t0 = time.perf_counter()
    task = Task(spec["task"], rank, size, seed=spec["seed"], batch_size=spec["batch_size"], steps=spec["steps"],
                non_iid=spec["non_iid"], optimizer=spec["optimizer"], lr=spec["lr"])
    arms = []
    for i, name in enumerate(spec["arms"]):
        torch.manual_seed(spec["seed"])              # every arm's copy starts from the same weights
        arms.append(build_arm(name, i, task, spec["ratio"], spec["min_numel"]))
    rounds = train(arms, task, spec, group, rank, local_rank, size)
    record = {**{k: v for k, v in spec.items() if k != "seeds"}, "ranks": size, "rounds": rounds,
              "torch": torch.__version__, "horovod": horovod.__version__, "batch_size": task.batch_size,
              "steps_per_epoch": task.steps_per_epoch, "recipe": task.recipe, "arms": {}}
    for arm in arms:
        stats = {k: [s.get(k) for s in arm.stats] for k in dict.fromkeys(k for s in arm.stats for k in s)}
        record["arms"][arm.name] = {
            "kind": arm.kind, "steps": arm.steps, "step_s": arm.step_s, "measured_s": arm.measured_s,
            "bytes": arm.bytes, "curve": arm.curve, "stats": stats, "params_identical": group.identical(arm.model),
            "num_params": sum(p.numel() for p in arm.model.parameters()),
            "tensors": [[n, p.numel(), p.dim()] for n, p in arm.model.named_parameters()],
            "auto": arm.opt.auto_state() if hasattr(arm.opt, "auto_state") else None,
            "powersgd_compression_rate": arm.powersgd_state.compression_stats()[0] if arm.powersgd_state else None}
    record["seed_s"] = round(time.perf_counter() - t0, 1)
    return record


# -- the driver ---------------------------------------------------------------------------------------
def job_env(cycle_ms, gloo_timeout, extra=()):
    """The ranks' environment: the cycle time when set (else Horovod's own), Horovod's Gloo timeout as
    torch.distributed's, and ``extra`` (KEY=VALUE, e.g. HOROVOD_HIERARCHICAL_ALLREDUCE=1)."""
    env = {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
           "HOROVOD_GLOO_TIMEOUT_SECONDS": str(gloo_timeout)}
    if cycle_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{cycle_ms:g}"
    return {**env, **dict(kv.split("=", 1) for kv in extra)}


def drive(spec, seeds, placement, env, timeout, launcher="gloo", out=None):
    """One job on ``placement`` that trains every seed in turn (one launch: on a small machine a launch
    costs seconds); returns the records, in the order of ``seeds``. ``spec``: what ``main`` reads, less
    the seeds and the file names, which this fills in. ``timeout``: seconds per seed."""
    if spec["warmup"] <= START_POWERSGD_ITER and any("powersgd" in a for a in spec["arms"]):
        raise ValueError(f"warmup must be more than {START_POWERSGD_ITER} (PowerSGD's dense steps), got {spec['warmup']}")
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(spec, seeds=list(seeds), json_out=os.path.join(tmp, "records.json"), iface=placement.iface,
                   master_addr=placement.master_addr)
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as f:
            json.dump(job, f)
        run_ranks(placement, [sys.executable, "-m", "bench.runner", path], env, timeout * len(seeds), launcher,
                  failed_log=os.path.join(out, "job_failed.log") if out else None)
        with open(job["json_out"]) as f:
            return json.load(f)


if __name__ == "__main__":
    main(sys.argv[1])
