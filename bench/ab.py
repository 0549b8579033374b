"""A/B timer of two whole commands: interleaved repeats, min/median/max of each and their ratio.

Each command runs through ``sh -c`` (so it may set variables and redirect its output), A and B in
turn, the order swapped every round (A B, B A, A B, ...) so that neither always runs on a machine
just warmed or loaded by the other; ``warmup`` rounds first, not counted. Per run: wall seconds, and
CPU seconds of the command and its children (user + system, from the kernel's accounting of waited-for
children). The ratio A/B is taken per round (the A and B of the same round), then its min, median and
max.

    python -m bench ab "HVD_TOPK_SPIN_WAIT=1 python -m bench run ..." "python -m bench run ..." \\
        --repeats 3 --warmup 1 --out bench/results/ab_spin_vs_poll
"""
import json
import os
import resource
import statistics
import subprocess
import time

from bench.manifest import write_manifest

__all__ = ["time_once", "compare", "table", "main"]


def time_once(command, timeout):
    """(wall s, cpu s, exit status) of ``command`` run by ``sh -c``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        status = subprocess.run(["sh", "-c", command], timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        status = 124
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), status


def spread(values):
    """{"min", "median", "max"} of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def compare(a, b, repeats=3, warmup=1, timeout=3600, timer=time_once):
    """Run ``a`` and ``b`` in alternating order, ``warmup`` + ``repeats`` rounds; returns the runs and
    the figures of the counted rounds. RuntimeError naming the command when one fails."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    runs = []
    for r in range(warmup + repeats):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        got = {}
        for which in order:
            wall, cpu, status = timer(a if which == "A" else b, timeout)
            if status != 0:
                raise RuntimeError(f"command {which} exited with {status} in round {r + 1}: {a if which == 'A' else b}")
            got[which] = {"wall_s": wall, "cpu_s": cpu}
        runs.append({"round": r + 1, "counted": r >= warmup, "first": order[0], **got})
    counted = [r for r in runs if r["counted"]]
    figures = {f"{w} {k}": spread([r[w][k] for r in counted]) for w in ("A", "B") for k in ("wall_s", "cpu_s")}
    figures["A/B wall"] = spread([r["A"]["wall_s"] / r["B"]["wall_s"] for r in counted])
    figures["A/B cpu"] = spread([r["A"]["cpu_s"] / r["B"]["cpu_s"] for r in counted if r["B"]["cpu_s"] > 0] or [0.0])
    return runs, figures


def table(a, b, figures, repeats, warmup):
    """The markdown table of ``compare``'s figures."""
    lines = [f"A: `{a}`", "", f"B: `{b}`", "",
             f"{repeats} counted rounds after {warmup} warm-up round(s), the order swapped every round.", "",
             "| | min | median | max |", "|---|---:|---:|---:|"]
    for name, s in figures.items():
        digits = ".3f" if "/" in name else ".1f"
        lines.append(f"| {name} | {s['min']:{digits}} | **{s['median']:{digits}}** | {s['max']:{digits}} |")
    return "\n".join(lines) + "\n"


def main(args):
    """The CLI's ``ab``: prints the table; with ``args.out`` also writes ab.json, table.md and the
    manifest there. Returns 0, or 1 when a command failed."""
    try:
        runs, figures = compare(args.a, args.b, args.repeats, args.warmup, args.timeout)
    except RuntimeError as e:
        print(f"bench ab: {e}")
        return 1
    text = table(args.a, args.b, figures, args.repeats, args.warmup)
    print(text)
    if args.out:
        write_manifest(args.out, args.command)
        with open(os.path.join(args.out, "ab.json"), "w") as f:
            json.dump({"a": args.a, "b": args.b, "runs": runs, "figures": figures}, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text)
    return 0
