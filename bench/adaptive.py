"""The adaptive ratio against fixed ratios and dense: final accuracy and total link bytes.

Each run trains the digits CNN to the end (``--epochs``) under ``horovodrun --gloo`` in a fresh network
namespace (``bench.job.namespace``). The compressed runs go through a ``tc tbf`` link
(``--bandwidth``), so the adaptive ratio's cost model sees a slow network; dense, whose accuracy and
bytes do not depend on the link, runs on an unlimited loopback (at 100 Mbit/s its steps would take
seconds each). Link bytes are the loopback's kernel counters, read by rank 0 of the example. Writes
``adaptive.csv`` and ``adaptive.md`` (per-run rows, the mean per mode, the ratio decisions) into --out.

``--calibrate`` measures where the objective's weight w comes from instead: the small digits CNN
trained at fixed ratios and dense (2 ranks, unlimited loopback, test loss every 15 steps); for each
test-loss threshold, the progress per step of ratio c relative to dense, P(c) = steps_dense /
steps_c to reach it (3-evaluation running mean), against the compression gain G(c) the run reported;
w is the least-squares slope of log P(c) on log G(c) through the origin (P = G**w). Writes
``calibration.csv`` and ``calibration.md``.

    python -m bench.adaptive --out bench/results/adaptive
    python -m bench.adaptive --ranks 2 --bandwidth 1gbit --model cnn --seeds 0 --epochs 5 --out /tmp/ad
    python -m bench.adaptive --calibrate --out bench/results/adaptive

Needs root, ``ip`` and ``tc``, as the evidence grid does.
"""
import argparse
import csv
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time

from hvd_topk.auto import DEFAULT_RATIOS

from bench.constants import BANDWIDTHS, CYCLE_TIME_MS, RESULTS, ROOT, TBF_BURST
from bench.manifest import write_manifest
from bench.job import job_env, namespace, preflight, recorded_command

# label -> (the example's arguments, link): "limited" is --bandwidth, "unlimited" the bare loopback
MODES = {
    "dense": (["--compression", "none"], "unlimited"),
    "fixed 0.01": (["--compression", "hvd_topk", "--communication", "artopk", "--ratio", "0.01"], "limited"),
    "fixed 0.001": (["--compression", "hvd_topk", "--communication", "artopk", "--ratio", "0.001"], "limited"),
    "adaptive": (["--compression", "hvd_topk", "--communication", "artopk",
                  "--ratio", "0.01", "--adaptive-ratio"], "limited"),
}
COLUMNS = ["mode", "seed", "bandwidth", "test_acc", "link_bytes", "steps", "wall_s", "ratio_final",
           "ratios_used", "params_identical", "command"]


def run_one(label, seed, o):
    """One training run; returns its CSV row."""
    from testbed.launch import run_job

    args, link = MODES[label]
    bandwidth = o.bandwidth if link == "limited" else "unlimited"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        argv = [sys.executable, "examples/digits_cnn.py", "--model", o.model, "--epochs", str(o.epochs),
                "--seed", str(seed), "--quiet", "--json-out", out, *args]
        if label == "adaptive":
            argv += ["--auto-every", str(o.auto_every)]
        env = job_env(o.cycle_ms)
        with namespace(BANDWIDTHS[bandwidth], TBF_BURST) as ns:
            command = recorded_command(env, ns.prefix, o.ranks, argv)
            run_job(o.ranks, argv, timeout=3600, prefix=ns.prefix, env=env, cwd=ROOT)
        with open(out) as f:
            rec = json.load(f)
    auto = rec.get("hvd_topk_auto") or {}
    history = auto.get("history") or []
    return {"mode": label, "seed": seed, "bandwidth": bandwidth, "test_acc": rec["test_accuracy"],
            "link_bytes": rec["loopback_tx_bytes"], "steps": rec["steps"], "wall_s": round(rec["wall_s"], 1),
            "ratio_final": (rec.get("hvd_topk_stats") or {}).get("ratio", "") if label != "dense" else "",
            "ratios_used": " ".join(f"{h[0]}:{h[1]:g}" for h in history) if history else "",
            "params_identical": rec["params_identical"], "command": command}


CALIBRATION_RATIOS = DEFAULT_RATIOS          # the adaptive ratio's candidates
THRESHOLDS = (0.3, 0.2, 0.15, 0.1)


def steps_to(curve, threshold, window=3):
    """First step whose running mean of ``window`` test losses is <= threshold, or None."""
    losses = [c["test_loss"] for c in curve]
    for i in range(len(losses) - window + 1):
        if sum(losses[i:i + window]) / window <= threshold:
            return curve[i]["step"]
    return None


def fit_weight(points):
    """Least-squares w of log P = w log G through the origin; points: [(G, P)], 0 < G, P."""
    num = sum(math.log(g) * math.log(p) for g, p in points)
    den = sum(math.log(g) ** 2 for g, _ in points)
    return num / den if den > 0 else float("nan")


def calibrate(o):
    from testbed.launch import run_job

    records = {}
    for c in (1.0,) + CALIBRATION_RATIOS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "run.json")
            args = ["--compression", "none"] if c == 1.0 else ["--compression", "hvd_topk", "--communication", "artopk",
                    "--ratio", str(c)]
            argv = [sys.executable, "examples/digits_cnn.py", "--model", "cnn", "--epochs", "20", "--seed", "0",
                    "--eval-every", "15", "--quiet", "--json-out", out, *args]
            with namespace(None, "1mb") as ns:
                run_job(2, argv, timeout=1800, prefix=ns.prefix, env=job_env(o.cycle_ms), cwd=ROOT)
            with open(out) as f:
                records[c] = json.load(f)
        print(f"ratio {c:g}: test accuracy {records[c]['test_accuracy']:.4f}", flush=True)
    rows, lines = [], ["| test-loss threshold | dense steps | " + " | ".join(f"P({c:g})" for c in CALIBRATION_RATIOS)
                       + " | fitted w |", "|---" * (len(CALIBRATION_RATIOS) + 3) + "|"]
    gains = {c: records[c]["hvd_topk_stats"]["compression_gain"] for c in CALIBRATION_RATIOS}
    fits = []
    for thr in THRESHOLDS:
        d = steps_to(records[1.0]["curve"], thr)
        cells, points = [], []
        for c in CALIBRATION_RATIOS:
            s = steps_to(records[c]["curve"], thr)
            p = d / s if d and s else None
            cells.append("not reached" if p is None else f"{p:.2f}")
            if p is not None and p < 1:
                points.append((gains[c], p))
            rows.append({"threshold": thr, "ratio": c, "gain": gains[c], "steps": s, "dense_steps": d,
                         "progress": p})
        w = fit_weight(points) if points else float("nan")
        fits.append(w)
        lines.append(f"| {thr} | {d} | " + " | ".join(cells) + f" | {w:.2f} |")
    with open(os.path.join(o.out, "calibration.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    text = ["# Calibration of the adaptive ratio's weight w", "",
            "`python -m bench.adaptive --calibrate`: digits CNN (0.15M parameters), 2 ranks, 20 epochs, seed 0, "
            "SGD with momentum correction, artopk. P(c) = steps dense needs / steps ratio c needs to reach the "
            "test loss (running mean of 3 evaluations, every 15 steps); gains (last step): "
            + ", ".join(f"G({c:g}) = {gains[c]:.3f}" for c in CALIBRATION_RATIOS) + ".", "",
            *lines, "", "Final test accuracy: " + ", ".join(
                f"{'dense' if c == 1.0 else c}: {r['test_accuracy']:.4f}" for c, r in records.items()) + "."]
    with open(os.path.join(o.out, "calibration.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    print("\n".join(lines))
    return fits


def summary(rows):
    """Mean accuracy and link bytes per mode, each against dense and fixed 0.01."""
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    mean = {m: (statistics.fmean(r["test_acc"] for r in rows if r["mode"] == m),
                statistics.fmean(r["link_bytes"] for r in rows if r["mode"] == m)) for m in modes}
    lines = ["| mode | runs | mean test accuracy | vs dense (points) | mean link bytes per run | vs fixed 0.01 |",
             "|---|---|---|---|---|---|"]
    for m in modes:
        acc, nbytes = mean[m]
        d = f"{100 * (acc - mean['dense'][0]):+.2f}" if "dense" in mean else ""
        f = f"{nbytes / mean['fixed 0.01'][1]:.2f}x" if "fixed 0.01" in mean else ""
        n = sum(1 for r in rows if r["mode"] == m)
        lines.append(f"| {m} | {n} | {acc:.4f} | {d} | {nbytes:,.0f} | {f} |")
    return mean, lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(RESULTS, "adaptive"))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--bandwidth", choices=[b for b in BANDWIDTHS if b != "unlimited"], default="100mbit")
    p.add_argument("--model", choices=["cnn", "wide"], default="wide")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seeds", default="0,1", help="comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    p.add_argument("--auto-every", type=int, default=25, help="steps between the adaptive ratio's checks")
    p.add_argument("--cycle-ms", default=CYCLE_TIME_MS, help="HOROVOD_CYCLE_TIME of every job")
    p.add_argument("--calibrate", action="store_true", help="fit the objective's weight w instead (see above)")
    o = p.parse_args(argv)
    modes = [m.strip() for m in o.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    seeds = [int(s) for s in o.seeds.split(",")]
    missing = preflight()
    if missing:
        print(f"bench.adaptive: {missing}", file=sys.stderr)
        return 2
    os.makedirs(o.out, exist_ok=True)
    write_manifest(o.out, shlex.join(["python", "-m", "bench.adaptive", *(argv if argv is not None else sys.argv[1:])]))
    if o.calibrate:
        calibrate(o)
        return 0
    rows = []
    for seed in seeds:
        for label in modes:
            t0 = time.perf_counter()
            rows.append(run_one(label, seed, o))
            r = rows[-1]
            print(f"{label:12s} seed {seed}: acc {r['test_acc']:.4f}, {r['link_bytes']:,} link bytes, "
                  f"ratios {r['ratios_used'] or '-'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    with open(os.path.join(o.out, "adaptive.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    _, lines = summary(rows)
    text = ["# Adaptive ratio against fixed ratios and dense", "",
            f"`python -m bench.adaptive {shlex.join(argv if argv is not None else sys.argv[1:])}`", "",
            f"digits CNN (`--model {o.model}`), {o.ranks} ranks, {o.epochs} epochs, seeds {o.seeds}; "
            f"compressed runs through a {o.bandwidth} tbf link, dense on an unlimited loopback; link bytes "
            "are the loopback's counters over the whole run (every rank, headers included).", "",
            *lines, "", "Ratio decisions of the adaptive runs (step:ratio):", ""]
    text += [f"- seed {r['seed']}: {r['ratios_used'] or 'none'}" for r in rows if r["mode"] == "adaptive"]
    text += ["", "Commands:", ""] + [f"- `{r['command']}`" for r in rows]
    with open(os.path.join(o.out, "adaptive.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
