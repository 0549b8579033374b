"""Error-feedback variants on the MLP, 4 ranks emulated in one process: steps to dense final - 1 pt.

The study "Steps to a target" (docs/studies/2026-11-steps-to-target.md, run 15) asks whether EF21-style
error feedback, which the library does not have, would take fewer steps than the classic error feedback
it has. Building it into both front doors first would be the wrong order, so this script emulates 4
ranks in one process (the same parameters on every rank, so one model serves all; each rank's gradient
from its own batch of bench/tasks.py's ``mlp`` task) and compares, at ratio 0.01:

- ``dense``: the mean gradient, SGD lr 0.05 with momentum 0.9 (the task's recipe);
- ``ef``: classic error feedback (acc = grad + residual) with split_reduce's global selection at
  budget 1: every rank nominates the top-k of its acc over all compressed tensors, the candidates are
  summed, the largest k sums are kept, a rank's sent entries are its nominations among them; the
  optimizer as dense's. This is what the library does (in float32: no 16-bit rounding);
- ``ef21``: EF21 (Richtarik et al., NeurIPS'21): each rank compresses grad - g_i, its estimate g_i grows
  by what it sent, and the optimizer (as dense's) steps on G = mean of the g_i, kept on every rank;
- ``ef21-sgdm``: EF21-SGDM (Fatkhullin et al., NeurIPS'23): as ef21 on each rank's moving average
  v_i = 0.9 v_i + 0.1 grad, with SGD without momentum at lr 0.05 / (1 - 0.9).

Tensors under 1024 elements go dense, as the library's default min_numel. Writes records.json (the
accuracy every 20 steps per seed and arm), table.md and manifest.json next to this file:

    python -m bench.results.ef_variants_emulated_mlp_np4.emulate --seeds 0,1,2 --jobs 2

(13 minutes on the idle 2-core Intel Xeon: ``--jobs`` runs of an arm and a seed at once).
"""
import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.manifest import write_manifest
from bench.tasks import Task
from hvd_topk.core.sparsify import k_for

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = ("dense", "ef", "ef21", "ef21-sgdm")
RANKS, STEPS, EVERY, RATIO, MIN_NUMEL, BETA = 4, 300, 20, 0.01, 1024, 0.9


def exchange(accs, dense_mask, k):
    """split_reduce's global selection at budget 1 over every rank's flat acc: (mean of what was
    kept, each rank's sent entries). Dense tensors' entries are sent whole."""
    n = accs[0].numel()
    sparse = [a.masked_fill(dense_mask, 0.0) for a in accs]
    nominated = [torch.topk(s.abs(), k).indices for s in sparse]
    candidates = torch.zeros(n)
    for s, idx in zip(sparse, nominated):
        candidates.index_add_(0, idx, s[idx])
    kept = torch.zeros(n, dtype=torch.bool)
    kept[torch.topk(candidates.abs(), k).indices] = True
    sent = []
    for a, s, idx in zip(accs, sparse, nominated):
        mine = torch.zeros(n)
        mine[idx] = s[idx]
        sent.append(torch.where(dense_mask, a, mine * kept))
    return sum(sent) / len(sent), sent


def emulated_ranks(seed):
    """(each rank's task, the one model, its parameters) of ``seed``, on one thread."""
    torch.set_num_threads(1)                # one core per (arm, seed): --jobs of them run at once
    tasks = [Task("mlp", r, RANKS, seed=seed, steps=STEPS) for r in range(RANKS)]
    torch.manual_seed(seed)                 # the harness's initial weights for this seed
    model = tasks[0].build()
    return tasks, model, list(model.parameters())


def rank_gradients(tasks, model, params, step):
    """Each emulated rank's flat gradient at ``step``, from its own batch (the ranks' parameters are one)."""
    grads = []
    for task in tasks:
        x, y = task.batch(step)
        model.zero_grad()
        task.loss(model(x), y).backward()
        grads.append(torch.cat([q.grad.reshape(-1) for q in params]))
    return grads


def step_on(opt, params, update):
    """The optimizer's step with the flat ``update`` as every parameter's gradient."""
    offset = 0
    for q in params:
        q.grad = update[offset:offset + q.numel()].view_as(q).clone()
        offset += q.numel()
    opt.step()


def train(arm, seed):
    """Accuracy after every EVERY-th step of one arm and seed."""
    tasks, model, params = emulated_ranks(seed)
    sizes = [q.numel() for q in params]
    dense_mask = torch.cat([torch.full((n,), n < MIN_NUMEL) for n in sizes])
    n, k = dense_mask.numel(), k_for(int((~dense_mask).sum()), RATIO)
    lr = tasks[0].recipe["lr"]
    opt = (torch.optim.SGD(params, lr=lr / (1 - BETA)) if arm == "ef21-sgdm"
           else torch.optim.SGD(params, lr=lr, momentum=BETA))
    residual = [torch.zeros(n) for _ in range(RANKS)]     # ef: each rank's residual
    estimate = [torch.zeros(n) for _ in range(RANKS)]     # ef21: each rank's g_i
    average = [torch.zeros(n) for _ in range(RANKS)]      # ef21-sgdm: each rank's v_i
    global_estimate = torch.zeros(n)                      # ef21: G, the same on every rank
    curve = []
    for step in range(STEPS):
        grads = rank_gradients(tasks, model, params, step)
        if arm == "dense":
            update = sum(grads) / RANKS
        elif arm == "ef":
            accs = [g + r for g, r in zip(grads, residual)]
            update, sent = exchange(accs, dense_mask, k)
            residual = [a - s for a, s in zip(accs, sent)]
        else:
            if arm == "ef21-sgdm":
                average = [BETA * v + (1 - BETA) * g for v, g in zip(average, grads)]
                grads = average
            delta, sent = exchange([g - e for g, e in zip(grads, estimate)], dense_mask, k)
            estimate = [e + s for e, s in zip(estimate, sent)]
            global_estimate = global_estimate + delta
            update = global_estimate
        step_on(opt, params, update)
        if (step + 1) % EVERY == 0:
            curve.append(tasks[0].evaluate(model)["accuracy"])
    return curve


def steps_to(curve, target):
    return next(((i + 1) * EVERY for i, acc in enumerate(curve) if acc >= target), None)


def table(records):
    """Markdown: steps to each seed's dense final - 1 pt, per arm."""
    seeds = sorted({r["seed"] for r in records})
    curves = {(r["arm"], r["seed"]): r["accuracy"] for r in records}
    lines = ["| arm | steps to dense final - 1 pt (seeds " + ", ".join(map(str, seeds)) + ") | mean | vs dense | final accuracy (mean) |",
             "|---|---|---:|---:|---:|"]
    base = None
    for arm in ARMS:
        steps = [steps_to(curves[arm, s], curves["dense", s][-1] - 0.01) for s in seeds]
        mean = None if None in steps else sum(steps) / len(steps)
        base = mean if arm == "dense" else base
        ratio = "-" if mean is None or base is None else f"{mean / base:.2f}x"
        final = sum(curves[arm, s][-1] for s in seeds) / len(seeds)
        lines.append(f"| {arm} | " + ", ".join("n.r." if s is None else str(s) for s in steps)
                     + f" | {'n.r.' if mean is None else f'{mean:.0f}'} | {ratio} | {final:.4f} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--out", default=HERE)
    args = p.parse_args()
    runs = [(arm, int(seed)) for seed in args.seeds.split(",") for arm in ARMS]
    with ProcessPoolExecutor(args.jobs) as pool:
        curves = list(pool.map(train, *zip(*runs)))
    records = [{"arm": arm, "seed": seed, "accuracy": curve} for (arm, seed), curve in zip(runs, curves)]
    save(args.out, records, table(records))


def save(out, records, markdown):
    """records.json, table.md (``markdown``) and manifest.json in ``out`` (made if new); the table printed."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "records.json"), "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(markdown)
    write_manifest(out)
    print(markdown)


if __name__ == "__main__":
    main()
