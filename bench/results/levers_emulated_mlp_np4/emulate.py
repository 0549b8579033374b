"""Top-K's levers on the MLP at about equal bytes, 4 ranks emulated in one process: steps to dense final - 1 pt.

The study "Steps to a target" (docs/studies/2026-11-steps-to-target.md, run 16) asks which lever brings
global selection's 1.5-1.65x dense's steps on this MLP toward the issue's 1.3x without more bytes. The
emulation of run 15 (``bench/results/ef_variants_emulated_mlp_np4/emulate.py``, whose task, batches,
initial weights and evaluation this script reuses) reproduced the library's figures; here its classic
error feedback (split_reduce's global selection, float32) is the base, and each arm changes one thing:

- ``ef 0.01`` / ``ef 0.02``: the base at the default ratio and at twice it (the issue's "2% costs what
  1% cost with 8-byte entries");
- ``budget 2`` / ``budget 4 at 0.005``: split_reduce keeps the largest ``budget * k`` summed candidates
  (of at most ``ranks * k``), not k; at 0.005 and budget 4 about the bytes of budget 1 at 0.01;
- ``dgc 0.01``: DGC's momentum correction and factor masking (Lin et al., ICLR'18) with global
  selection: each rank accumulates its own velocity u = 0.9 u + grad into v, top-k's v, and zeroes u and
  v where it sent; the optimizer is SGD without momentum on the mean of what was sent;
- ``anneal``: the ratio falls geometrically from 0.04 to 0.01 over the first 60 steps, then stays
  (more bytes only at the start: a "denser start" priced in bytes);
- round 2 (``--arms`` of the four last names, ``--out`` its own folder): budget 4 at 0.0035 (the bytes
  of budget 1 at 0.01), budget 4 with the ratio annealed from 0.02 to 0.005, and the output layer
  (1024 x 10) sent dense, alone and with budget 4 at 0.005;
- round 3 (``--arms "ef 0.01" --trace``): the defaults' arithmetic with a per-step trace, to see what the
  stall of every Top-K arm at steps 60-80 is made of;
- round 4: the first weight, which that trace shows starved in the first 40 steps, selected alone with
  its own k (as the library sends a row-sparse tensor), the rest pooled: the same k in all;
- round 5: the optimizer's momentum, the same bytes as the base: 0.8 and 0.7 instead of the task's 0.9,
  and Nesterov's at 0.9 (``OPTIMIZER``); dense at 0.8 beside them;
- round 6: Nesterov's momentum for dense, and with budget 4 at 0.005 and the annealed ratio.

Each arm's bytes per rank per step are counted from the entries on split_reduce's two phases: a rank
sends the (ranks - 1) / ranks of its k nominations that other ranks own, and a ring allgather of the kept
sums sends (ranks - 1) / ranks of them per rank; 4 bytes an entry (the 16-bit value and its 2-byte
offset). Tensors under 1024 elements go dense in every arm and are left out of the count; a larger
tensor an arm sends dense counts 4 bytes an element on a ring allreduce's 2 (ranks - 1) / ranks.

    python -m bench.results.levers_emulated_mlp_np4.emulate --seeds 0,1,2 --jobs 2
    python -m bench.results.levers_emulated_mlp_np4.emulate --seeds 0,1,2 --jobs 2 --arms "ef 0.01" --trace \
        --out bench/results/levers_emulated_mlp_np4/round3       # round 4: "first layer alone", round4
    python -m bench.results.levers_emulated_mlp_np4.emulate --seeds 0,1,2 --jobs 2 --arms "ef 0.01 momentum 0.8,\
ef 0.01 momentum 0.7,ef 0.01 nesterov,dense momentum 0.8" --out bench/results/levers_emulated_mlp_np4/round5
    python -m bench.results.levers_emulated_mlp_np4.emulate --seeds 0,1,2 --jobs 2 --arms "dense nesterov,\
budget 4 at 0.005 nesterov,anneal nesterov" --out bench/results/levers_emulated_mlp_np4/round6
"""
import argparse
import itertools
import math
import os
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.results.ef_variants_emulated_mlp_np4.emulate import (BETA, EVERY, MIN_NUMEL, RANKS, STEPS, emulated_ranks,
                                                                rank_gradients, save, step_on, steps_to)
from hvd_topk.core.sparsify import k_for

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (ratio at step 0, ratio from step 60, budget, momentum correction, dense below this many elements[,
# the index of a parameter selected alone with its own k])
ARMS = {
    "dense": None,
    "ef 0.01": (0.01, 0.01, 1, False, MIN_NUMEL),
    "ef 0.02": (0.02, 0.02, 1, False, MIN_NUMEL),
    "budget 2": (0.01, 0.01, 2, False, MIN_NUMEL),
    "budget 4 at 0.005": (0.005, 0.005, 4, False, MIN_NUMEL),
    "dgc 0.01": (0.01, 0.01, 1, True, MIN_NUMEL),
    "anneal": (0.04, 0.01, 1, False, MIN_NUMEL),
    # round 2: the two that took 1.40x, together and at equal bytes; the output layer (10,240) dense
    "budget 4 at 0.0035": (0.0035, 0.0035, 4, False, MIN_NUMEL),
    "budget 4 anneal 0.02-0.005": (0.02, 0.005, 4, False, MIN_NUMEL),
    "ef 0.01 output dense": (0.01, 0.01, 1, False, 16384),
    "budget 4 at 0.005 output dense": (0.005, 0.005, 4, False, 16384),
    # round 4: the first weight (64 x 1024, starved early in round 3's trace) selected alone with its own k
    "first layer alone": (0.01, 0.01, 1, False, MIN_NUMEL, 0),
    # round 5: the optimizer's momentum (``OPTIMIZER``), Top-K's and dense's alike
    "ef 0.01 momentum 0.8": (0.01, 0.01, 1, False, MIN_NUMEL),
    "ef 0.01 momentum 0.7": (0.01, 0.01, 1, False, MIN_NUMEL),
    "ef 0.01 nesterov": (0.01, 0.01, 1, False, MIN_NUMEL),
    "dense momentum 0.8": None,
    # round 6: Nesterov's momentum, which round 5 found ahead, for dense too and with the two levers of 1.40x
    "dense nesterov": None,
    "budget 4 at 0.005 nesterov": (0.005, 0.005, 4, False, MIN_NUMEL),
    "anneal nesterov": (0.04, 0.01, 1, False, MIN_NUMEL),
}
# round 5: the SGD arguments an arm changes (the task's recipe: momentum 0.9). Error feedback delays an
# entry until it is sent, and delays act as momentum of their own (Mitliagkas et al., "Asynchrony begets
# momentum", 2016): does less explicit momentum, or Nesterov's, take Top-K to the target sooner?
OPTIMIZER = {"ef 0.01 momentum 0.8": {"momentum": 0.8}, "ef 0.01 momentum 0.7": {"momentum": 0.7},
             "ef 0.01 nesterov": {"nesterov": True}, "dense momentum 0.8": {"momentum": 0.8},
             "dense nesterov": {"nesterov": True}, "budget 4 at 0.005 nesterov": {"nesterov": True},
             "anneal nesterov": {"nesterov": True}}
ANNEAL_STEPS = 60


def ratio_at(step, first, last):
    """Geometric from ``first`` to ``last`` over ANNEAL_STEPS steps, then ``last``."""
    if step >= ANNEAL_STEPS or first == last:
        return last
    return first * math.exp(math.log(last / first) * step / ANNEAL_STEPS)


def exchange(accs, dense_mask, k, budget):
    """split_reduce's global selection over every rank's flat acc, the largest ``budget * k`` sums kept:
    (mean of what was kept, each rank's sent entries, entries a rank puts on the wire)."""
    n = accs[0].numel()
    sparse = [a.masked_fill(dense_mask, 0.0) for a in accs]
    nominated = [torch.topk(s.abs(), k).indices for s in sparse]
    candidates = torch.zeros(n)
    nominated_anywhere = torch.zeros(n, dtype=torch.bool)
    for s, idx in zip(sparse, nominated):
        candidates.index_add_(0, idx, s[idx])
        nominated_anywhere[idx] = True
    keep = min(budget * k, int(nominated_anywhere.sum()))
    kept = torch.zeros(n, dtype=torch.bool)
    kept[torch.topk(candidates.abs().masked_fill(~nominated_anywhere, -1.0), keep).indices] = True
    sent = []
    for a, s, idx in zip(accs, sparse, nominated):
        mine = torch.zeros(n)
        mine[idx] = s[idx]
        sent.append(torch.where(dense_mask, a, mine * kept))
    share = (RANKS - 1) / RANKS
    return sum(sent) / len(sent), sent, share * k + share * keep


def _traced_step(grads, residual, kept, weights):
    """One step's trace: each weight's share of the ``kept`` sparse entries, the ranks' mean residual's
    norm over their mean gradient's, and the cosine of the two."""
    mean_grad, mean_residual = sum(grads) / RANKS, sum(residual) / RANKS
    return {"share": [round(int(kept[a:b].sum()) / max(1, int(kept.sum())), 4) for a, b in weights],
            "residual_over_grad": round(float(mean_residual.norm() / mean_grad.norm()), 4),
            "cosine": round(float(torch.cosine_similarity(mean_residual, mean_grad, 0)), 4)}


def train(arm, seed, traced=False):
    """(accuracy after every EVERY-th step, mean bytes per rank per step, trace) of one arm and seed.
    The trace (``traced``, compressed arms, every step): each weight's share of the aggregate's sparse entries, the
    ranks' mean residual's norm over their mean gradient's, and the cosine of the two (round 3)."""
    tasks, model, params = emulated_ranks(seed)
    sizes = [q.numel() for q in params]
    lr, setting = tasks[0].recipe["lr"], ARMS[arm]
    dense_below = MIN_NUMEL if setting is None else setting[4]
    dense_mask = torch.cat([torch.full((n,), n < dense_below) for n in sizes])
    n, compressed = dense_mask.numel(), int((~dense_mask).sum())
    correction = setting is not None and setting[3]
    opt = (torch.optim.SGD(params, lr=lr) if correction
           else torch.optim.SGD(params, lr=lr, **{"momentum": BETA, **OPTIMIZER.get(arm, {})}))
    residual = [torch.zeros(n) for _ in range(RANKS)]     # each rank's v (DGC) or acc - sent (EF)
    velocity = [torch.zeros(n) for _ in range(RANKS)]     # DGC: each rank's u
    # dense tensors above the common MIN_NUMEL are counted: a ring allreduce sends 2 (ranks - 1) / ranks of them
    curve, entries = [], 2 * (RANKS - 1) / RANKS * sum(q for q in sizes if MIN_NUMEL <= q < dense_below) * STEPS
    weights_of = [(o, o + q) for o, q in zip([0] + list(itertools.accumulate(sizes)), sizes)]
    trace, weights = [], [(a, b) for a, b in weights_of if b - a >= dense_below]
    alone = None                              # the parameter selected alone with its own k, as a mask
    if setting is not None and len(setting) > 5:
        alone = torch.zeros(n, dtype=torch.bool)
        alone[slice(*weights_of[setting[5]])] = True
    for step in range(STEPS):
        grads = rank_gradients(tasks, model, params, step)
        if setting is None:
            update = sum(grads) / RANKS
        else:
            first, last, budget = setting[:3]
            if correction:
                velocity = [BETA * u + g for u, g in zip(velocity, grads)]
                accs = [r + u for r, u in zip(residual, velocity)]
            else:
                accs = [g + r for g, r in zip(grads, residual)]
            ratio = ratio_at(step, first, last)
            if alone is not None:     # one parameter alone: two exchanges, each with its own k
                size = int(alone.sum())
                pooled_update, pooled_sent, wire = exchange(accs, dense_mask | alone,
                                                            k_for(compressed - size, ratio), budget)
                alone_update, alone_sent, alone_wire = exchange(accs, dense_mask | ~alone, k_for(size, ratio), budget)
                update, wire = torch.where(alone, alone_update, pooled_update), wire + alone_wire
                sent = [torch.where(alone, x, y) for x, y in zip(alone_sent, pooled_sent)]
            else:
                update, sent, wire = exchange(accs, dense_mask, k_for(compressed, ratio), budget)
            entries += wire
            residual = [a - s for a, s in zip(accs, sent)]
            if traced:
                trace.append(_traced_step(grads, residual, (update != 0) & ~dense_mask, weights))
            if correction:    # factor masking: no velocity left where the entry was sent
                velocity = [u.masked_fill((s != 0) & ~dense_mask, 0.0) for u, s in zip(velocity, sent)]
        step_on(opt, params, update)
        if (step + 1) % EVERY == 0:
            curve.append(tasks[0].evaluate(model)["accuracy"])
    return curve, 4 * entries / STEPS, trace


def table(records):
    """Markdown: steps to each seed's dense final - 1 pt, per arm, and the bytes."""
    seeds = sorted({r["seed"] for r in records})
    runs = {(r["arm"], r["seed"]): r for r in records}
    lines = ["| arm | steps to dense final - 1 pt (seeds " + ", ".join(map(str, seeds)) + ") | mean | vs dense "
             "| final accuracy (mean) | bytes per rank per step (compressed tensors) |",
             "|---|---|---:|---:|---:|---:|"]
    base = None
    for arm in dict.fromkeys(r["arm"] for r in records):
        steps = [steps_to(runs[arm, s]["accuracy"], runs["dense", s]["accuracy"][-1] - 0.01) for s in seeds]
        mean = None if None in steps else sum(steps) / len(steps)
        base = mean if arm == "dense" else base
        ratio = "-" if mean is None or base is None else f"{mean / base:.2f}x"
        final = sum(runs[arm, s]["accuracy"][-1] for s in seeds) / len(seeds)
        wire = sum(runs[arm, s]["bytes"] for s in seeds) / len(seeds)
        lines.append(f"| {arm} | " + ", ".join("n.r." if s is None else str(s) for s in steps)
                     + f" | {'n.r.' if mean is None else f'{mean:.0f}'} | {ratio} | {final:.4f} | "
                     + ("-" if arm == "dense" else f"{wire:,.0f}") + " |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated names from ARMS (dense always runs)")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--out", default=HERE)
    p.add_argument("--trace", action="store_true", help="keep each compressed arm's per-step trace in records.json")
    args = p.parse_args()
    arms = ["dense"] + [a for a in args.arms.split(",") if a != "dense"]
    runs = [(arm, int(seed)) for seed in args.seeds.split(",") for arm in arms]
    with ProcessPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(train, *zip(*runs), [args.trace] * len(runs)))
    records = [{"arm": arm, "seed": seed, "accuracy": curve, "bytes": wire, **({"trace": trace} if args.trace else {})}
               for (arm, seed), (curve, wire, trace) in zip(runs, outcomes)]
    save(args.out, records, table(records))


if __name__ == "__main__":
    main()
