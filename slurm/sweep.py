#!/usr/bin/env python3
"""Submit a grid of runs as one Slurm job array, then collect their JSON results into one table.

    python slurm/sweep.py submit --out runs/sweep1 --grid compression=none,topkef,hvd_topk \\
        --grid ratio=0.01,0.001 -- examples/digits_cnn.py --epochs 20 --quiet
    python slurm/sweep.py submit --out runs/sweep2 --template slurm/train_gpu.sbatch \\
        --sbatch=--nodes=4 --grid communication=artopk,allgather --wait -- train.py --compression hvd_topk
    python slurm/sweep.py collect runs/sweep1          # -> runs/sweep1/results.csv and results.md

Each grid key becomes `--key value` on the script's command line; one array task per combination.
sbatch runs from the repository root, so give the script's path relative to it (or absolute).
Every task also gets `--json-out OUT/results/<task>.json` and `--checkpoint OUT/ckpt/<task>.pt`, so a
requeued task resumes (slurm/job_step.sh). The per-task arguments go through a tab-separated file
named by HVD_TOPK_ARGS_FILE, which the sbatch templates read; the templates' launcher, environment and
checkpoint/requeue handling apply to every task unchanged.
"""
import argparse
import csv
import itertools
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["test_accuracy", "bytes_per_rank_per_step", "wall_s", "params_identical", "resumed_from"]
_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


def parse_grid(specs):
    """Turn ``["ratio=0.01,0.001", "compression=none,topkef"]`` into ``[(key, [values...]), ...]``.

    Raises:
        ValueError: a spec without ``=``, a bad key, an empty or tab-containing value, a repeated key.
    """
    grid, seen = [], set()
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not _KEY.match(key):
            raise ValueError(f"--grid must look like key=v1,v2 (key: letters, digits, - or _), got {spec!r}")
        if key in seen:
            raise ValueError(f"--grid key {key!r} given twice; list all its values in one --grid")
        vals = [v.strip() for v in values.split(",")]
        if not all(vals) or any("\t" in v for v in vals):
            raise ValueError(f"--grid {key}: values must be non-empty and without tabs, got {values!r}")
        seen.add(key)
        grid.append((key, vals))
    if not grid:
        raise ValueError("give at least one --grid key=v1,v2")
    return grid


def expand(grid):
    """All combinations of the grid, in order: a list of ``{key: value}`` dicts (one per array task)."""
    keys = [k for k, _ in grid]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in grid))]


def task_args(point, out, task, result_arg="--json-out", checkpoint_arg="--checkpoint"):
    """The extra command-line arguments of one array task."""
    args = [a for key, value in point.items() for a in (f"--{key}", value)]
    if result_arg:
        args += [result_arg, os.path.join(out, "results", f"{task}.json")]
    if checkpoint_arg:
        args += [checkpoint_arg, os.path.join(out, "ckpt", f"{task}.pt")]
    return args


def submit(out, grid, command, template, sbatch_args=(), result_arg="--json-out",
           checkpoint_arg="--checkpoint", max_parallel=None):
    """Write ``OUT/grid.tsv`` and ``OUT/sweep.json``, submit the array, return its job id.

    Args:
        out: the sweep's directory (created; must not hold an earlier sweep).
        grid: from ``parse_grid``.
        command: the script and its fixed arguments (what follows ``sbatch TEMPLATE``).
        template: ``slurm/train_cpu.sbatch`` or ``slurm/train_gpu.sbatch`` (or your own).
        sbatch_args: extra sbatch options, e.g. ``["--nodes=2", "--partition=gpu"]``.
        result_arg, checkpoint_arg: the script's options for its JSON result and checkpoint path
            (empty: not passed).
        max_parallel: at most this many array tasks at once (``--array=0-N%M``).
    """
    if not command:
        raise ValueError("give the script to run after '--', e.g. -- examples/digits_cnn.py --epochs 5")
    if max_parallel is not None and max_parallel < 1:
        raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
    if not os.path.isfile(template):
        raise ValueError(f"template {template!r} is not a file")
    template, out = os.path.abspath(template), os.path.abspath(out)
    if os.path.exists(os.path.join(out, "sweep.json")):
        raise ValueError(f"{out} already holds a sweep; pick another --out")
    points = expand(grid)
    for sub in ("results", "ckpt", "logs"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    args_file = os.path.join(out, "grid.tsv")
    with open(args_file, "w") as f:
        for task, point in enumerate(points):
            f.write("\t".join(task_args(point, out, task, result_arg, checkpoint_arg)) + "\n")
    array = f"0-{len(points) - 1}" + (f"%{max_parallel}" if max_parallel else "")
    cmd = ["sbatch", "--parsable", f"--array={array}", f"--output={out}/logs/%a.out",
           f"--export=ALL,HVD_TOPK_ARGS_FILE={args_file}", *sbatch_args, template, *command]
    job_id = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    job_id = job_id.split(";")[0]             # --parsable prints "id" or "id;cluster"
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"job_id": job_id, "grid": grid, "points": points, "command": command,
                   "template": template, "sbatch": cmd}, f, indent=1)
    return job_id


def wait(job_id, timeout, poll=5.0):
    """Block until no task of the job is pending or running; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%i"], capture_output=True,
                              text=True, check=True).stdout.split()
        if not left:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still has {len(left)} task(s) queued or running after {timeout}s")
        time.sleep(poll)


def collect(out, fields=FIELDS):
    """Read every task's JSON result; write ``OUT/results.csv`` and ``OUT/results.md``; return the rows.

    A task without a result (still running, failed) gets status ``missing`` and its log's last line.
    """
    with open(os.path.join(out, "sweep.json")) as f:
        sweep = json.load(f)
    keys = [k for k, _ in sweep["grid"]]
    rows = []
    for task, point in enumerate(sweep["points"]):
        row = {"task": task, **point}
        path = os.path.join(out, "results", f"{task}.json")
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            row.update({k: result.get(k) for k in fields}, status="ok")
        else:
            row.update({k: None for k in fields}, status="missing", note=_last_line(out, task))
        rows.append(row)
    columns = ["task", *keys, "status", *fields] + (["note"] if any("note" in r for r in rows) else [])
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows([{c: _cell(r.get(c)) for c in columns} for r in rows])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return rows


def _cell(value):
    """One table cell: floats to 4 significant digits, dicts as JSON, None as empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _last_line(out, task):
    """Last non-empty line of a task's log, to say why it has no result."""
    try:
        with open(os.path.join(out, "logs", f"{task}.out"), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        return "no log yet"
    return lines[-1][:200].replace("|", "/") if lines else "empty log"


def main(argv=None):
    """Command line: ``submit`` and ``collect`` (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="write the grid and submit it as a job array")
    s.add_argument("--out", required=True, help="directory for the grid, logs, results, checkpoints")
    s.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="repeat per key")
    s.add_argument("--template", default=os.path.join(ROOT, "slurm", "train_cpu.sbatch"))
    s.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="extra sbatch option, e.g. --sbatch=--nodes=2 (repeatable)")
    s.add_argument("--result-arg", default="--json-out", help="the script's JSON result option ('' = none)")
    s.add_argument("--checkpoint-arg", default="--checkpoint", help="the script's checkpoint option ('' = none)")
    s.add_argument("--max-parallel", type=int, default=None, help="array tasks running at once")
    s.add_argument("--wait", action="store_true", help="wait for the array, then collect")
    s.add_argument("--timeout", type=float, default=24 * 3600, help="seconds --wait waits at most")
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    c = sub.add_parser("collect", help="gather OUT/results/*.json into OUT/results.{csv,md}")
    c.add_argument("out")
    args = p.parse_args(argv)
    try:
        if args.cmd == "collect":
            rows = collect(args.out)
        else:
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            job_id = submit(args.out, parse_grid(args.grid), command, args.template, args.sbatch,
                            args.result_arg, args.checkpoint_arg, args.max_parallel)
            print(f"submitted job array {job_id} ({len(expand(parse_grid(args.grid)))} tasks) -> {args.out}")
            if not args.wait:
                return 0
            wait(job_id, args.timeout)
            rows = collect(args.out)
    except (ValueError, TimeoutError) as e:
        p.error(str(e))
    with open(os.path.join(args.out, "results.md")) as f:
        print(f.read(), end="")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
