"""The evidence grid's command line: real horovodrun jobs behind tbf-limited links; CSV, PNG plots and a report.

Every job (``testbed.launch.run_job``, Gloo) runs inside a fresh network namespace of its own
(``testbed.wire.Namespace``) whose loopback is limited by ``tc tbf`` to 100 Mbit/s or 1 Gbit/s, or
left unlimited (MTU 9000; tbf burst 1mb and latency 100ms by default). Rank 0 of the example reads the
loopback's kernel counters at every step boundary, so the link bytes are every rank's traffic together,
headers included. Every job gets the same HOROVOD_CYCLE_TIME (20 ms by default), dense included. Parts:

- ``steps``: step time and link bytes of every mode (``bench.constants.MODES``) at every ratio, 2 and 4 ranks, every
  bandwidth, on the wide digits CNN (~6.3M parameters, little compute); beside the measured bytes, the
  bytes the scheme must send (``bench.linkbytes.theoretical_bytes``) and Horovod's control plane,
  measured by a probe job per link (``bench.job.control_plane``).
- ``tta``: time to accuracy: 4 ranks, ratio 0.01, each mode trained for the same wall-clock budget;
  test accuracy (CNN) or test loss (LM) against training wall clock (evaluation excluded).
- ``accuracy``: final accuracy of the digits CNN and final loss of the byte-level LM on the unlimited
  link after a fixed length, ratio 0.01 against dense, IID and ``--non-iid``.
- ``cycle`` (not in the default): the same step measurement at several HOROVOD_CYCLE_TIME values, what
  the control plane costs in bytes and what a longer cycle costs in step time.

``--repeats N`` runs the steps part's grid N times in turn (every mode once, then every mode again, so a
slow spell of the host falls on every mode): steps_runs.csv has every run, steps.csv, the tables and
the plots the median of the N per cell, and the report a table of each run's step time and how auto
did against the best fixed mode in every repeat.

    python -m bench.evidence                      # the full grid; prints its plan and time estimate
    python -m bench.evidence --dry-run            # the planned runs and the estimate only
    python -m bench.evidence --quick --out /tmp/ev   # the CI preset (~2 min)
    python -m bench.evidence --part steps --ranks 4 --bandwidths 100mbit --modes dense,topkef
    python -m bench.evidence --part cycle         # control plane against HOROVOD_CYCLE_TIME
    python -m bench.evidence --part steps --ranks 2 --repeats 3   # every cell 3 times, interleaved
    python -m bench.evidence --report-only        # CSV, plots and report.md again from <out>/raw/
The full grid is 154 jobs: about an hour and a half on an idle 2-core machine, a third of it job startup
(~12-16 s a job) and much of the rest the 100 Mbit/s links' dense steps and parameter broadcasts;
``--dry-run`` prints the estimate by part. A steps part run at several rank counts (``--ranks 2,4,8``)
adds a table of link bytes against the rank count to report.md. Needs root, ``ip`` and ``tc``
(iproute2): otherwise it exits with status 2 naming what is missing. Writes into ``--out`` (default bench/results/evidence/): steps.csv, cycle.csv,
control_plane.csv, tta.csv, tta_curves.csv, accuracy.csv, bytes_per_step.png, speedup.png,
tta_<example>.png, report.md, and raw/ (each run's and probe's record and the options: --report-only
rebuilds everything from all of raw/, so parts run separately into one --out merge there), and
manifest.json (commit, command, date, machine).
The work is split by job: bench/grid.py plans the runs, bench/job.py runs one, bench/linkbytes.py
reads link bytes and the theoretical payload, bench/rows.py and bench/report.py make the tables and
report.md, bench/plots.py the plots; shared constants live in bench/constants.py.
(Run bench scripts as modules from the repository root: bench/select.py would shadow the standard
library's ``select`` module if bench/ were on sys.path.)
"""
import argparse
import glob
import json
import os
import shlex
import shutil
import signal
import sys
import time

from bench.constants import BANDWIDTHS, CYCLE_TIME_MS, MODES, RESULTS, TBF_BURST
from bench.grid import EXAMPLES, FULL, QUICK, estimate_text, plan
from bench.manifest import write_manifest
from bench.job import Interrupted, control_plane, execute, idle_worker, on_sigterm, preflight
from bench.report import build_outputs, fmt_number

DEFAULT_OUT = os.path.join(RESULTS, "evidence")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--part", help="comma-separated: steps, tta, accuracy, and the optional cycle (a sweep "
                   "of HOROVOD_CYCLE_TIME: what the control plane costs and what raising the cycle time costs)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--ranks", help="steps part: comma-separated rank counts")
    p.add_argument("--bandwidths", help=f"comma-separated, of {list(BANDWIDTHS)}")
    p.add_argument("--modes", help=f"comma-separated labels, of {list(MODES)}")
    p.add_argument("--ratios", help="comma-separated ratios of the Top-K modes")
    p.add_argument("--steps-example", help=f"steps part's example, of {list(EXAMPLES)}")
    p.add_argument("--warmup", type=int, help="steps skipped before measuring")
    p.add_argument("--min-measured", type=int, help="measured steps, at least")
    p.add_argument("--max-measured", type=int, help="measured steps, at most")
    p.add_argument("--repeats", type=int, default=1,
                   help="steps part: run the grid this many times in turn; tables show each cell's median")
    p.add_argument("--step-seconds", type=float, help="measured stepping time a run aims at (estimate)")
    p.add_argument("--idle-seconds", type=float, help="control-plane probe: seconds idle")
    p.add_argument("--cycle-times", help="cycle part: HOROVOD_CYCLE_TIME values (ms), comma-separated")
    p.add_argument("--cycle-modes", help="cycle part: mode labels")
    p.add_argument("--cycle-ranks", type=int)
    p.add_argument("--cycle-bandwidth")
    p.add_argument("--cycle-ratio", type=float)
    p.add_argument("--tta-examples", help="comma-separated examples of the TTA part")
    p.add_argument("--tta-ranks", type=int)
    p.add_argument("--tta-ratio", type=float)
    p.add_argument("--tta-budget", type=float, help="seconds of training per TTA run")
    p.add_argument("--tta-points", type=int, help="evaluations per TTA run (aimed at)")
    p.add_argument("--tta-modes")
    p.add_argument("--tta-target", default="cnn-wide=0.5,cnn=0.9,lm=2.5",
                   help="example=accuracy (CNN) or loss (LM) the time to target is measured to")
    p.add_argument("--accuracy-examples")
    p.add_argument("--accuracy-ranks", type=int)
    p.add_argument("--accuracy-ratio", type=float)
    p.add_argument("--accuracy-modes")
    p.add_argument("--accuracy-length", help="example=epochs (CNN) or steps (LM)")
    p.add_argument("--non-iid", help="comma-separated: iid, non-iid")
    p.add_argument("--burst", default=TBF_BURST, help="tbf burst (>= 1mb at MTU 9000)")
    p.add_argument("--cycle-time-ms", default=CYCLE_TIME_MS, help="HOROVOD_CYCLE_TIME of every job")
    p.add_argument("--quick", action="store_true", help="the CI preset: 2 ranks, 1gbit, 5 modes, short")
    p.add_argument("--dry-run", action="store_true", help="print the planned runs and the estimate only")
    p.add_argument("--report-only", action="store_true", help="rebuild CSV, plots and report from <out>/raw")
    p.add_argument("--idle-worker", type=float, help=argparse.SUPPRESS)   # probe job's ranks; --out: JSON
    o = p.parse_args(argv)
    if o.idle_worker is not None:
        return o
    preset = QUICK if o.quick else FULL
    for key, value in preset.items():
        if getattr(o, key, None) is None:
            setattr(o, key, value)
    o.part = _names(o.part, ("steps", "cycle", "tta", "accuracy"), "--part")
    o.cycle_times = [x.strip() for x in o.cycle_times.split(",")]
    o.cycle_modes = _names(o.cycle_modes, MODES, "--cycle-modes")
    _names(o.cycle_bandwidth, BANDWIDTHS, "--cycle-bandwidth")
    o.ranks = [int(x) for x in o.ranks.split(",")]
    o.bandwidths = _names(o.bandwidths, BANDWIDTHS, "--bandwidths")
    o.modes = _names(o.modes, MODES, "--modes")
    o.tta_modes = _names(o.tta_modes, MODES, "--tta-modes")
    o.accuracy_modes = _names(o.accuracy_modes, MODES, "--accuracy-modes")
    o.ratios = [float(x) for x in o.ratios.split(",")]
    o.tta_examples = _names(o.tta_examples, EXAMPLES, "--tta-examples")
    o.accuracy_examples = _names(o.accuracy_examples, EXAMPLES, "--accuracy-examples")
    _names(o.steps_example, EXAMPLES, "--steps-example")
    o.non_iid = [x == "non-iid" for x in _names(o.non_iid, ("iid", "non-iid"), "--non-iid")]
    o.accuracy_length = {k: int(v) for k, v in (kv.split("=") for kv in o.accuracy_length.split(","))}
    o.tta_target = {k: float(v) for k, v in (kv.split("=") for kv in o.tta_target.split(","))}
    for ex in o.accuracy_examples:
        if ex not in o.accuracy_length:
            p.error(f"--accuracy-length has no entry for {ex}")
    for ex in o.tta_examples:
        if ex not in o.tta_target:
            p.error(f"--tta-target has no entry for {ex}")
    if o.repeats < 1:
        p.error(f"--repeats must be at least 1, got {o.repeats}")
    if o.warmup < 0 or o.min_measured < 1 or o.max_measured < o.min_measured:
        p.error("need --warmup >= 0 and 1 <= --min-measured <= --max-measured")
    if min(o.ranks + [o.tta_ranks, o.accuracy_ranks, o.cycle_ranks]) < 2:
        p.error("rank counts must be >= 2 (one rank sends nothing)")
    if not all(0 < r <= 1 for r in o.ratios + [o.tta_ratio, o.accuracy_ratio, o.cycle_ratio]):
        p.error("ratios must be in (0, 1]")
    return o


def _names(text, allowed, flag):
    """Comma-separated names, each in ``allowed``; SystemExit(2) naming the bad one otherwise."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad:
        print(f"evidence: {flag}: unknown {bad}; choose from {list(allowed)}", file=sys.stderr)
        sys.exit(2)
    return names


def _probe_key(probe):
    ranks, bandwidth, cycle_ms = probe
    return ranks, list(BANDWIDTHS).index(bandwidth), float(cycle_ms)


# Options the report reads; saved with the raw records so that --report-only reproduces the report.
REPORT_OPTIONS = ("burst", "cycle_time_ms", "warmup", "min_measured", "max_measured", "tta_budget", "tta_target")


def main(argv=None, euid=None, which=shutil.which):
    """Run the grid (see the module docstring); returns the process exit status."""
    o = parse_args(sys.argv[1:] if argv is None else argv)
    if o.idle_worker is not None:
        idle_worker(o.idle_worker, o.out)
        return 0
    command = shlex.join(["python", "-m", "bench.evidence", *(sys.argv[1:] if argv is None else argv)])
    if o.report_only:
        return rebuild_report(o)
    runs = plan(o)
    probes = sorted({(r.ranks, r.bandwidth, r.cycle_ms) for r in runs if r.part in ("steps", "cycle")},
                    key=_probe_key)
    print(estimate_text(runs, probes, o), flush=True)
    if o.dry_run:
        for r in runs:
            unit = "epochs" if r.part == "accuracy" and EXAMPLES[r.example].epoch_steps else "steps"
            what = f"{r.steps} {unit}" if r.part != "tta" else f"{r.budget_s:g} s, eval every {r.eval_every}"
            print(f"  {r.run_id:<60} {what:<24} ~{r.est_s:5.0f} s")
        return 0
    missing = preflight(euid, which)
    if missing:
        print("evidence: cannot run: missing " + "; ".join(missing), file=sys.stderr)
        return 2
    return run_grid(o, runs, probes, command)


def rebuild_report(o):
    """--report-only: CSV, plots and report.md again from <out>/raw, with the settings and command of the
    run that wrote it."""
    raw = os.path.join(o.out, "raw")
    if not os.path.exists(os.path.join(raw, "options.json")):
        print(f"evidence: --report-only: no {os.path.join(raw, 'options.json')} (run the grid first)",
              file=sys.stderr)
        return 2
    with open(os.path.join(raw, "options.json")) as f:
        saved = json.load(f)
    command = saved.pop("command")
    for key, value in saved.items():
        setattr(o, key, value)
    results, cp = [], []
    for path in glob.glob(os.path.join(raw, "*.json")):
        with open(path) as f:
            saved = json.load(f)
        if "row" in saved:
            results.append((saved["row"], saved["record"]))
        elif "probe" in saved:
            cp.append(saved["probe"])
    results.sort(key=lambda x: x[0]["seq"])
    cp.sort(key=lambda r: _probe_key((r["ranks"], r["bandwidth"], r["cycle_ms"])))
    print("\n".join(build_outputs(o, results, cp, command)))
    return 0


def run_grid(o, runs, probes, command):
    """The control-plane probes, then every planned job, each record saved under <out>/raw as it comes;
    the outputs and the manifest are written even when interrupted. Returns the exit status."""
    raw = os.path.join(o.out, "raw")
    os.makedirs(raw, exist_ok=True)
    write_manifest(o.out, command)
    with open(os.path.join(raw, "options.json"), "w") as f:
        json.dump({"command": command, **{k: getattr(o, k) for k in REPORT_OPTIONS}}, f)
    old = signal.signal(signal.SIGTERM, on_sigterm)
    results, cp, unsupported, status = [], [], {}, 0
    t_start = time.perf_counter()
    try:
        for ranks, bw, cycle_ms in probes:
            row = control_plane(ranks, bw, cycle_ms, o)
            cp.append(row)
            with open(os.path.join(raw, f"probe-n{ranks}-{bw}-c{cycle_ms}.json"), "w") as f:
                json.dump({"probe": row}, f)
            print(f"[control plane] {ranks} ranks, {bw}, cycle {cycle_ms} ms: "
                  f"{fmt_number(row.get('bytes_per_s'))} B/s idle {row['error'][:200]}", flush=True)
        for i, run in enumerate(runs, 1):
            row, record = execute(run, o, unsupported)
            row["seq"] = i
            results.append((row, record))
            with open(os.path.join(raw, run.run_id + ".json"), "w") as f:
                json.dump({"row": row, "record": record}, f)
            summary = row["error"][:300] if row["status"] != "ok" else \
                f"{len(record['step_times_s'])} steps, {record['wall_s']:.1f} s training"
            print(f"[{i}/{len(runs)} {time.perf_counter() - t_start:6.0f}s] {run.run_id}: {row['status']} "
                  f"({row.get('job_s', 0):.0f} s) {summary}", flush=True)
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"evidence: interrupted ({e or 'Ctrl-C'}); jobs killed, namespaces deleted; writing what was "
              "measured", file=sys.stderr)
        status = 143 if isinstance(e, Interrupted) else 130
    finally:
        signal.signal(signal.SIGTERM, old)
        if results or cp:
            for name in build_outputs(o, results, cp, command):
                print(os.path.join(o.out, name))
    return status


if __name__ == "__main__":
    sys.exit(main())
