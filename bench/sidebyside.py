"""communication='auto' against the fixed modes, side by side in one job, step by step.

Separate jobs for each mode (``bench.evidence``) compare runs made minutes apart, and on a noisy host
one job's median step differs from the next one's by 10-20%: more than the 5% the auto target
allows. Here every mode trains its own copy of the wide digits CNN (6.33M parameters, same seed) in
one 2-rank horovodrun job (Gloo, ``HOROVOD_CYCLE_TIME=20``) inside a fresh network namespace whose
loopback is limited by tbf (or not). First each mode runs its warm-up alone, in turn: 5 steps, and
auto until its probe and its trial of plans are over. Then the modes take turns, ``--turn`` steps
each, in an order that rotates every round (so each mode follows every other equally often), for
``--rounds`` rounds: a slow spell of the host falls on all modes alike. With turns of one step, the
work that outlives a step (TopKEF's and AR-Topk's next index sets) finishes during another mode's
step; a job running one mode has no such gap. Turns of several steps, of which the first is not
recorded, measure each mode following itself, as in a job of its own.

Step time: rank 0's wall time from ``zero_grad()`` to the end of ``step()``; per mode the median over
the rounds (the mean and quartiles are given too). Link bytes: the loopback's tx counter read by
rank 0 around each step, every rank's traffic, divided by the ranks; a transfer that outlives its
step (TopKEF's and AR-Topk's index sets for the next step) lands in the next mode's window, so the
per-mode bytes are approximate (``bench.evidence`` measures each mode's bytes alone).

Targets (issue: ``auto``): on a tbf-limited link auto's median step within 5% of the fastest fixed
mode's; on the unlimited loopback within 5% of dense. The fixed modes are the transports auto chooses
from, each fixed (``bench.constants.FIXED_TRANSPORT_MODES``), of those the job runs: dense (stock
Horovod), hvd_topk allgather, hvd_topk artopk and, when --modes names it, hvd_topk split_reduce
(Ok-Topk's split-and-reduce, not in the default --modes). TopKEF under stock
Horovod is measured too and auto is compared with it, but it is not one of them: it runs no DGC
momentum correction (the hvd_topk modes here run it, as hvd_topk's default did when these results were
recorded; the mode ``hvd_topk artopk nomc``
is artopk without it, to measure what it costs), and it compresses 1-D tensors, which hvd_topk sends
dense.

    python -m bench.sidebyside --bandwidths 100mbit,1gbit,unlimited --rounds 60 --repeats 2 \\
        --out bench/results/sidebyside_auto
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

from bench.constants import AUTO_MODE as AUTO
from bench.constants import BANDWIDTHS, CYCLE_TIME_MS, RESULTS, ROOT, TBF_BURST
from bench.constants import FIXED_TRANSPORT_MODES as FIXED

MODES = ("dense", "topkef", "hvd_topk allgather", "hvd_topk artopk", AUTO)
# on request: artopk with momentum_correction=False; split_reduce, a fixed mode of the target
EXTRA_MODES = ("hvd_topk artopk nomc", "hvd_topk split_reduce")
TARGET = 0.05


# -- the job ------------------------------------------------------------------------------------------
def worker(a):
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import hvd_topk
    from hvd_topk import TopKEF
    from testbed.wire import loopback_bytes

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from data import load_dataset
    from digits_cnn import build_model

    hvd.init()
    torch.set_num_threads(1)
    x, y, _, _ = load_dataset("digits")
    arms = []
    for i, mode in enumerate(a.modes):
        torch.manual_seed(0)
        model = build_model("wide", x.shape[1])
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        named = [(f"m{i}.{n}", p) for n, p in model.named_parameters()]    # Horovod's names, per mode
        if mode.startswith("hvd_topk "):
            opt = hvd_topk.DistributedOptimizer(base, named_parameters=named, compression=TopKEF(ratio=a.ratio),
                                                communication=mode.split()[1],
                                                momentum_correction=not mode.endswith(" nomc"))
        else:
            compression = TopKEF(ratio=a.ratio, named_parameters=named) if mode == "topkef" else hvd.Compression.none
            opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        arms.append((mode, model, opt))

    per_rank = len(y) // hvd.size()
    batches = per_rank // a.batch_size
    if batches == 0:
        raise ValueError(f"--batch-size must be at most {per_rank} (training samples per rank), got {a.batch_size}")

    def step(model, opt, t):
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(t // batches))
        mine = perm[hvd.rank()::hvd.size()][(t % batches) * a.batch_size:][:a.batch_size]
        t0, tx0 = time.perf_counter(), loopback_bytes()[0]
        opt.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        return time.perf_counter() - t0, loopback_bytes()[0] - tx0

    out = {"ranks": hvd.size(), "ratio": a.ratio, "rounds": a.rounds, "turn": a.turn, "modes": {}}
    steps = {}
    for mode, model, opt in arms:                       # warm-up: each mode alone, in turn
        n = 0
        while n < a.warmup or (mode == AUTO and auto_busy(opt.auto_state())):
            if n >= a.max_warmup:
                raise RuntimeError(f"{mode}: still probing or in its trial after {n} steps (--max-warmup)")
            step(model, opt, n)
            n += 1
        steps[mode] = n
        out["modes"][mode] = {"warmup_steps": n, "step_s": [], "bytes": []}
    for r in range(a.rounds):                           # then --turn steps each, the order rotating
        for j in range(len(arms)):
            mode, model, opt = arms[(r + j) % len(arms)]
            for k in range(a.turn):
                s, b = step(model, opt, steps[mode])
                steps[mode] += 1
                if k or a.turn == 1:                    # a turn's first step follows another mode
                    out["modes"][mode]["step_s"].append(s)
                    out["modes"][mode]["bytes"].append(b / hvd.size())
    for mode, model, opt in arms:
        if mode == AUTO:
            state = opt.auto_state()
            out["auto"] = {"plan": state["plan"], "history": [list(h) for h in state["history"]],
                           "stats": {k: v for k, v in opt.stats().items() if k.startswith("auto_")}}
    if hvd.rank() == 0:
        with open(a.json_out, "w") as f:
            json.dump(out, f)


def auto_busy(state):
    """True while auto has not probed yet or its trial of plans is under way (identical on all ranks)."""
    return state["costs"] is None or "trial of" in state["history"][-1][3]


# -- analysis -----------------------------------------------------------------------------------------
def summarise(record, bandwidth):
    """Figures of one job: per mode the median, mean and quartiles of the step (ms) and the bytes per
    rank per step; auto against the fastest fixed mode (medians, and paired: the median over rounds
    of auto's step over that mode's step of the same round) and against dense; whether the target is
    met; auto against the fixed mode that runs the same transport, if any."""
    rows = {}
    for mode, m in record["modes"].items():
        q = statistics.quantiles(m["step_s"], n=4) if len(m["step_s"]) > 1 else [m["step_s"][0]] * 3
        rows[mode] = {"median_ms": 1e3 * statistics.median(m["step_s"]), "mean_ms": 1e3 * statistics.fmean(m["step_s"]),
                      "q1_ms": 1e3 * q[0], "q3_ms": 1e3 * q[2], "bytes": statistics.median(m["bytes"]),
                      "warmup_steps": m["warmup_steps"]}
    out = {"bandwidth": bandwidth, "modes": rows}
    fixed = {k: v for k, v in rows.items() if k in FIXED}
    if AUTO in rows and fixed:
        best = min(fixed, key=lambda k: fixed[k]["median_ms"])
        auto = rows[AUTO]["median_ms"]
        pairs = zip(record["modes"][AUTO]["step_s"], record["modes"][best]["step_s"])   # same round
        out.update(best=best, vs_best=auto / fixed[best]["median_ms"] - 1,
                   paired_vs_best=statistics.median(x / y for x, y in pairs) - 1,
                   vs_dense=auto / rows["dense"]["median_ms"] - 1 if "dense" in rows else None,
                   vs_topkef=auto / rows["topkef"]["median_ms"] - 1 if "topkef" in rows else None)
        key = "vs_dense" if bandwidth == "unlimited" else "vs_best"
        out["met"] = None if out[key] is None else out[key] <= TARGET
        plan = (record.get("auto") or {}).get("stats") or {}
        out["auto_plan"] = ", ".join(f"{v} {k[5:]}" for k, v in plan.items() if v)
        trials = [h[3] for h in (record.get("auto") or {}).get("history", []) if str(h[3]).startswith("trial")]
        if trials:
            out["auto_trial"] = trials[-1]
        used = [k[5:] for k, v in plan.items() if v]
        same = {"dense": "dense"}.get(used[0], f"hvd_topk {used[0]}") if len(used) == 1 else None
        if same in rows:        # the same transport as a fixed mode: the spread of two equal configurations
            out["vs_same"] = (same, auto / rows[same]["median_ms"] - 1)
    return out


def pooled(records, bandwidth):
    """``summarise`` of all the rounds of several jobs on one link together."""
    merged = {"modes": {}, "auto": {"stats": {}}}
    for rec in records:
        for mode, m in rec["modes"].items():
            into = merged["modes"].setdefault(mode, {"step_s": [], "bytes": [], "warmup_steps": m["warmup_steps"]})
            into["step_s"] += m["step_s"]
            into["bytes"] += m["bytes"]
    out = summarise(merged, bandwidth)
    out["auto_plan"] = "; ".join(summarise(rec, bandwidth).get("auto_plan", "-") for rec in records)
    out.pop("vs_same", None)            # auto's plan may differ from job to job
    return out


def _verdict(met):
    return "no data" if met is None else "met" if met else "not met"


def report(results, command, pooled_results=()):
    """Markdown: one table per link and repeat, then the target per job."""
    L = ["# communication='auto' against the fixed modes, side by side in one job", "",
         "Every mode trains its own copy of the wide digits CNN in the same job; after each mode's "
         "warm-up the modes take turns (of one step or more; with more, a turn's first step, which follows "
         "another mode, is not recorded), the order rotating every round. Step times in ms "
         "(rank 0, zero_grad to the end of step); bytes per rank per step from the loopback counters, "
         "approximate per mode (see `bench/sidebyside.py`). Targets: on a tbf link auto within 5% of the "
         "fastest fixed mode, on the unlimited loopback within 5% of dense.", "",
         f"Command: `{command}`", ""]
    for s in results:
        turn = s.get("turn", 1)
        L += [f"## {s['bandwidth']}, repeat {s['repeat']} ({s['rounds']} rounds, turns of {turn} step"
              f"{'s' if turn > 1 else ''})", "",
              "| mode | median | mean | quartiles | bytes/rank/step | warm-up steps |", "|---|---:|---:|---|---:|---:|"]
        for mode, r in s["modes"].items():
            L.append(f"| {mode} | {r['median_ms']:,.1f} | {r['mean_ms']:,.1f} | {r['q1_ms']:,.1f}-{r['q3_ms']:,.1f} | "
                     f"{r['bytes']:,.0f} | {r['warmup_steps']} |")
        L += ["", f"auto's trial: {s['auto_trial']}", ""] if "auto_trial" in s else [""]
    L += ["## Target", "",
          "Per job, and (repeat 'all', when a link ran more than one job) every job of a link pooled: all their "
          "rounds together. Paired: the median over rounds of auto's step over the fastest fixed mode's step in "
          "the same round.", "",
          "Same plan: auto against the fixed mode that runs the transport auto chose, in the same job (the "
          "spread between two equal configurations).", "",
          f"Fixed modes: {', '.join(FIXED)} (of those the job ran), the transports auto chooses from. TopKEF "
          "(no momentum correction; 1-D tensors compressed) is not one of them; auto against it is given apart.", "",
          "| link | repeat | auto chose | auto vs fastest fixed | paired | auto vs dense | same plan | target "
          "| auto vs TopKEF |",
          "|---|---|---|---|---:|---:|---|---|---:|"]
    for s in list(results) + list(pooled_results):
        if "best" in s:
            dense = "-" if s["vs_dense"] is None else f"{100 * s['vs_dense']:+.1f}%"
            topkef = "-" if s.get("vs_topkef") is None else f"{100 * s['vs_topkef']:+.1f}%"
            paired = f"{100 * s['paired_vs_best']:+.1f}%" if "paired_vs_best" in s else "-"
            same = f"{100 * s['vs_same'][1]:+.1f}% ({s['vs_same'][0]})" if "vs_same" in s else "-"
            goal = "vs dense" if s["bandwidth"] == "unlimited" else "vs fastest fixed"
            L.append(f"| {s['bandwidth']} | {s['repeat']} | {s['auto_plan']} | {100 * s['vs_best']:+.1f}% "
                     f"({s['best']}) | {paired} | {dense} | {same} | **{_verdict(s['met'])}** "
                     f"({goal} <= +5%) | {topkef} |")
    return "\n".join(L) + "\n"


def driver(a):
    from testbed.launch import run_job
    from bench.manifest import write_manifest
    from bench.job import namespace

    # the command that makes the jobs (with --report-only pass the flags the jobs ran with: the report quotes it)
    command = "python -m bench.sidebyside " + shlex.join(x for x in sys.argv[1:] if x != "--report-only")
    os.makedirs(a.out, exist_ok=True)
    if not a.report_only:
        write_manifest(a.out, command)
    results, records = [], {}
    for rep in range(1, a.repeats + 1):
        for bw in a.bandwidths:
            saved = os.path.join(a.out, f"{bw}-rep{rep}.json")
            if a.report_only:
                if os.path.exists(saved):
                    with open(saved) as f:
                        records.setdefault(bw, []).append(json.load(f))
                    results.append(dict(summarise(records[bw][-1], bw), repeat=rep, rounds=records[bw][-1]["rounds"],
                                            turn=records[bw][-1].get("turn", 1)))
                continue
            with tempfile.TemporaryDirectory() as tmp:
                js = os.path.join(tmp, "r.json")
                argv = [sys.executable, "-m", "bench.sidebyside", "--worker", "--json-out", js,
                        "--modes", ",".join(a.modes), "--ratio", str(a.ratio), "--rounds", str(a.rounds),
                        "--warmup", str(a.warmup), "--max-warmup", str(a.max_warmup), "--batch-size", str(a.batch_size),
                        "--turn", str(a.turn)]
                t0 = time.perf_counter()
                with namespace(BANDWIDTHS[bw], TBF_BURST) as ns:
                    run_job(a.np, argv, timeout=a.timeout, prefix=ns.prefix, env={"HOROVOD_CYCLE_TIME": a.cycle_ms},
                            cwd=ROOT)
                with open(js) as f:
                    record = json.load(f)
            record["command"] = command
            with open(saved, "w") as f:
                json.dump(record, f)
            records.setdefault(bw, []).append(record)
            s = dict(summarise(record, bw), repeat=rep, rounds=a.rounds, turn=a.turn)
            results.append(s)
            print(f"{bw} repeat {rep}: {time.perf_counter() - t0:.0f} s; "
                  + ", ".join(f"{m} {r['median_ms']:.1f} ms" for m, r in s["modes"].items())
                  + (f"; auto vs fastest fixed {100 * s['vs_best']:+.1f}%" if "best" in s else ""), flush=True)
    together = [dict(pooled(recs, bw), repeat="all", rounds=sum(r["rounds"] for r in recs))
                for bw, recs in records.items() if len(recs) > 1]
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"jobs": results, "pooled": together}, f, indent=1)
    text = report(results, command, together)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(text)
    print(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidths", default="100mbit,1gbit,unlimited", help=f"comma-separated, of {list(BANDWIDTHS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES + EXTRA_MODES)}")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=60, help="turns of every mode after the warm-up")
    p.add_argument("--turn", type=int, default=1, help="steps of one mode in a row; with more than one, the first "
                                                       "of each turn is not recorded")
    p.add_argument("--warmup", type=int, default=5, help="steps of every mode alone before the rounds")
    p.add_argument("--max-warmup", type=int, default=300, help="auto: steps allowed for its probe and trial")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--repeats", type=int, default=1, help="jobs per link")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--cycle-ms", default=CYCLE_TIME_MS, help="HOROVOD_CYCLE_TIME of the job (Horovod's default: 1)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per job")
    p.add_argument("--out", default=os.path.join(RESULTS, "sidebyside_auto"))
    p.add_argument("--report-only", action="store_true", help="rebuild summary and report from <out>/*-rep*.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.bandwidths = [b for b in a.bandwidths.split(",") if b]
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [b for b in a.bandwidths if b not in BANDWIDTHS] + [m for m in a.modes if m not in MODES + EXTRA_MODES]
    if bad or not a.modes or len(set(a.modes)) != len(a.modes):
        p.error(f"--bandwidths take {list(BANDWIDTHS)}, --modes {list(MODES + EXTRA_MODES)}, each once; "
                f"got {bad or a.modes}")
    for name in ("rounds", "turn", "warmup", "max_warmup", "batch_size", "repeats", "np", "timeout"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if not 0 < a.ratio <= 1:
        p.error(f"--ratio must be in (0, 1], got {a.ratio}")
    return a


if __name__ == "__main__":
    args = parse_args()
    worker(args) if args.worker else driver(args)
