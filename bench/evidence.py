"""The evidence grid: real horovodrun jobs behind tbf-limited links; CSV, PNG plots and a report.

Every job (``bench.infra.launch.run_job``, Gloo) runs inside a fresh network namespace of its own
(``bench.infra.wire.Namespace``) whose loopback is limited by ``tc tbf`` to 100 Mbit/s or 1 Gbit/s, or
left unlimited (MTU 9000; tbf burst 1mb and latency 100ms by default). Rank 0 of the example reads the
loopback's kernel counters at every step boundary, so the link bytes are every rank's traffic together,
headers included. Every job gets the same HOROVOD_CYCLE_TIME (20 ms by default), dense included. Parts:

- ``steps``: step time and link bytes of every mode (``MODES``) at every ratio, 2 and 4 ranks, every
  bandwidth, on the wide digits CNN (~6.3M parameters, little compute); beside the measured bytes, the
  bytes the scheme must send (``theoretical_bytes``) and Horovod's control plane, measured by a probe
  job per link (``control_plane``).
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
The full grid is 118 jobs: about an hour on an idle 2-core machine, half of it job startup (~12-16 s a
job) and the 100 Mbit/s links' dense steps and parameter broadcasts; ``--dry-run`` prints the estimate
by part. Needs root, ``ip`` and ``tc`` (iproute2): otherwise it exits with status 2 naming what is
missing. Writes into ``--out`` (default bench/results/evidence/): steps.csv, cycle.csv,
control_plane.csv, tta.csv, tta_curves.csv, accuracy.csv, bytes_per_step.png, speedup.png,
tta_<example>.png, report.md, and raw/ (each run's and probe's record and the options: --report-only
rebuilds everything from all of raw/, so parts run separately into one --out merge there).
(Run bench scripts as modules from the repository root: bench/select.py would shadow the standard
library's ``select`` module if bench/ were on sys.path.)
"""
import argparse
import csv
import glob
import itertools
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from hvd_topk.sparsify import k_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "bench", "results", "evidence")

# -- the grid's vocabulary: one line adds a mode, a link or an example ---------------------------------
# Mode label -> the example's arguments. Modes whose --compression is topkef or hvd_topk run at every
# ratio; the scheme behind the theoretical bytes is read back from the run's JSON (``scheme_of``).
MODES = {
    "dense": ["--compression", "none"],
    "fp16": ["--compression", "fp16"],
    "topkef": ["--compression", "topkef"],
    "hvd_topk allgather": ["--compression", "hvd_topk", "--communication", "allgather"],
    "hvd_topk artopk": ["--compression", "hvd_topk", "--communication", "artopk"],
    "hvd_topk auto": ["--compression", "hvd_topk", "--communication", "auto"],
    # Horovod's groups=1: all gradients in one grouped collective per kind (not in the default grid)
    "topkef grouped": ["--compression", "topkef", "--groups", "1"],
    "hvd_topk artopk grouped": ["--compression", "hvd_topk", "--communication", "artopk", "--groups", "1"],
    "hvd_topk allgather grouped": ["--compression", "hvd_topk", "--communication", "allgather", "--groups", "1"],
    "hvd_topk allgather fp16": ["--compression", "hvd_topk", "--communication", "allgather", "--value-dtype",
                                "float16"],
}
# Warm-up steps (at least) a mode needs before its steps are representative: auto probes the
# link after step 1 and then measures up to 4 plans in turns of 4 steps, for 5 to 21 rounds
# (hvd_topk/auto.py); a longer trial is skipped as well (``measure``), from the record's history.
MODE_WARMUP = {"hvd_topk auto": 2 + 3 * 4 * 8}
SPARSE_COMPRESSIONS = ("topkef", "hvd_topk")
RATIOS = (0.1, 0.01, 0.001)
# Link name -> tbf rate (None: no qdisc, the loopback's own speed).
BANDWIDTHS = {"100mbit": "100mbit", "1gbit": "1gbit", "unlimited": None}
RATE_BYTES_PER_S = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8, "unlimited": None}


@dataclass(frozen=True)
class Example:
    """An example script and how the grid drives it; ``{n}``, ``{t}``, ``{e}`` are filled in per run."""
    script: str
    args: tuple                       # always passed (model, dataset)
    steps_args: tuple                 # run exactly {n} optimizer steps, no evaluation on the way
    length_args: tuple                # the accuracy part's fixed length
    budget_args: tuple                # train {t} seconds of wall clock, evaluate every {e} steps
    metric: str                       # "test_acc" (higher is better) or "test_loss" (lower is better)
    params: float                     # parameters, for the time estimate only
    compute_s: float                  # seconds per step per rank-per-core, for the time estimate only
    epoch_steps: int = 0              # 16-sample batches in the training set: length_args count epochs;
                                      # 0: they count steps

NEVER = 10 ** 9    # an --eval-every / --epochs / --steps that a run never reaches
EXAMPLES = {
    "cnn-wide": Example("examples/digits_cnn.py", ("--model", "wide", "--dataset", "digits"),
                        ("--max-steps", "{n}", "--epochs", str(NEVER), "--eval-every", str(NEVER)),
                        ("--epochs", "{n}"),
                        ("--time-budget", "{t}", "--epochs", str(NEVER), "--eval-every", "{e}"),
                        "test_acc", 6.3e6, 0.05, 1437 // 16),
    "cnn": Example("examples/digits_cnn.py", ("--model", "cnn", "--dataset", "digits"),
                   ("--max-steps", "{n}", "--epochs", str(NEVER), "--eval-every", str(NEVER)),
                   ("--epochs", "{n}"),
                   ("--time-budget", "{t}", "--epochs", str(NEVER), "--eval-every", "{e}"),
                   "test_acc", 0.15e6, 0.006, 1437 // 16),
    "lm": Example("examples/char_lm.py", (),
                  ("--steps", "{n}", "--eval-every", str(NEVER)),
                  ("--steps", "{n}"),
                  ("--time-budget", "{t}", "--steps", str(NEVER), "--schedule", "constant", "--eval-every", "{e}"),
                  "test_loss", 0.85e6, 0.20),
}

# -- defaults: the full grid ------------------------------------------------------------------------
FULL = dict(part="steps,tta,accuracy", ranks="2,4", bandwidths=",".join(BANDWIDTHS),
            modes=",".join(m for m in MODES if not m.endswith(" grouped")),
            ratios=",".join(map(str, RATIOS)), steps_example="cnn-wide", warmup=5, min_measured=6,
            max_measured=15, step_seconds=4.0, idle_seconds=4.0,
            cycle_times="1,5,20,50", cycle_modes="dense,topkef,hvd_topk artopk,hvd_topk allgather", cycle_ranks=4,
            cycle_bandwidth="1gbit", cycle_ratio=0.001,
            tta_examples="cnn-wide", tta_ranks=4, tta_ratio=0.01, tta_budget=30.0, tta_points=12,
            tta_modes="dense,fp16,topkef,hvd_topk allgather,hvd_topk artopk,hvd_topk auto",
            accuracy_examples="cnn,lm", accuracy_ranks=2, accuracy_ratio=0.01,
            accuracy_modes="dense,topkef,hvd_topk allgather,hvd_topk artopk",
            accuracy_length="cnn=15,cnn-wide=15,lm=150", non_iid="iid,non-iid")
# --quick: the CI preset: one 2-rank job per mode through a 1 Gbit/s link, one short TTA run, no accuracy
# (7 jobs; about 2.5 minutes on an idle 2-core machine, most of it job startup).
QUICK = dict(FULL, part="steps,tta", ranks="2", bandwidths="1gbit",
             modes="dense,topkef,hvd_topk artopk,hvd_topk allgather,hvd_topk allgather fp16",
             ratios="0.01", warmup=3, min_measured=5,
             max_measured=5, idle_seconds=1.5, tta_ranks=2, tta_budget=3.0, tta_points=3,
             tta_modes="hvd_topk artopk")
# Seconds of a job outside its steps on an otherwise idle 2-core machine: launch, imports, rendezvous,
# first collectives, final evaluation (measured here: 12-13 s for 2 ranks, 16-20 s for 4 ranks).
STARTUP_S, STARTUP_PER_RANK_S = 8.0, 2.0
CYCLE_TIME_MS = "20"  # HOROVOD_CYCLE_TIME for every job, dense included (see the report's notes)


# -- theoretical bytes ------------------------------------------------------------------------------
SCHEMES = ("dense", "fp16", "topkef", "artopk", "allgather")


def theoretical_bytes(scheme, tensors, min_numel, ratio, ranks, value_bytes=4):
    """Bytes per rank per step that ``scheme`` must put on the link (payload only: no headers, no
    control plane), from the gradients' shapes.

    Verified against Horovod 0.28.1 and its bundled Gloo (third_party/gloo):

    - Allreduce: ``GlooAlgorithms::Allreduce`` calls ``gloo::allreduce`` without choosing an algorithm,
      which runs ``ring`` (gloo/allreduce.cc): reduce-scatter then allgather over ``numSegments``
      segments (a multiple of N, at least 2N); each rank sends ``numSegments - numSegmentsPerRank``
      segments per phase, i.e. (N-1)/N of the buffer, and segments past the end are not sent. So B
      bytes cost 2(N-1)/N * B per rank (2(N-1) * B on the link in all). Horovod fuses the tensors of
      one cycle back to back into one buffer (``AllreduceOp::MemcpyInFusionBuffer``, no padding on
      CPU): fusion changes the number of messages, not the payload.
    - Broadcast (AR-Topk's index set): ``gloo::broadcast`` (gloo/broadcast.cc) is a binomial tree from
      the root, not root-to-all: every other rank receives the buffer exactly once, some from a rank
      that forwards it. The link carries (N-1) * B in all whoever sends, so (N-1)/N * B per rank on
      average.
    - Allgather: ``GlooAllgather`` calls ``gloo::allgatherv`` (gloo/allgatherv.cc), a ring of N-1
      rounds in which each rank forwards one rank's block; with equal blocks of B bytes a rank sends
      (N-1) * B. The block sizes come from the controller's response (``AllgatherOp::AllocateOutput``
      reads ``response.tensor_sizes()``), so no size exchange rides on the data plane.

    Per tensor of ``numel`` elements (fp32 gradients), k = max(1, ceil(ratio * numel)):

    ===========  ======================================================  ==============================
    scheme       bytes per rank per step                                 sent dense (ring, 4 B/value)
    ===========  ======================================================  ==============================
    dense        2(N-1)/N * 4 * numel                                    every tensor
    fp16         2(N-1)/N * 2 * numel (Horovod's fp16 compressor)        every tensor
    topkef       2(N-1)/N * 4(k+1) + (N-1)/N * 4k  (k values + 1 flag    numel < min_numel (TopKEF
                 allreduced; the leader's int32 index set broadcast;     looks at numel only: 1-D
                 no broadcast when k = numel)                            tensors are compressed)
    artopk       as topkef (hvd_topk.DistributedOptimizer, AR-Topk)      numel < min_numel or ndim <= 1
    allgather    (N-1) * (4(k+1) + 4(k+1)): two allgathers, the k        numel < min_numel or ndim <= 1
                 values + flag and the k int32 indices + flag slot
    ===========  ======================================================  ==============================

    With ``value_bytes`` = 2 (``value_dtype=torch.float16``) the compressed tensors' values and flag
    take 2 bytes instead of 4; indices stay int32 and tensors sent dense keep their own dtype.

    Args:
        scheme: one of ``SCHEMES``.
        tensors: the run's ``tensors`` list of ``[name, numel, ndim]``.
        min_numel: tensors with fewer elements go dense.
        ratio: fraction kept (ignored by dense and fp16).
        ranks: N.
        value_bytes: bytes per value of a compressed tensor on the wire (4, or 2 for float16).

    Returns:
        float bytes per rank per step (0 at N = 1).

    Example:
        >>> theoretical_bytes("dense", [["w", 1000, 2]], 1024, 0.01, 2)     # 2(N-1)/N * 4000
        4000.0
        >>> theoretical_bytes("allgather", [["w", 10000, 2]], 1024, 0.01, 4) # 3 * 8 * 101
        2424.0
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    n = int(ranks)
    if n < 2:
        return 0.0
    ring = 2.0 * (n - 1) / n
    total = 0.0
    for _, numel, ndim in tensors:
        numel, ndim = int(numel), int(ndim)
        dense = (scheme in ("dense", "fp16") or numel < min_numel
                 or (scheme in ("artopk", "allgather") and ndim <= 1))
        if dense:
            total += ring * numel * (2 if scheme == "fp16" else 4)
            continue
        k = k_for(numel, ratio)
        if scheme == "allgather":
            total += (n - 1) * (value_bytes + 4) * (k + 1)
        else:
            total += ring * value_bytes * (k + 1) + ((n - 1) / n * 4 * k if k < numel else 0.0)
    return total


def scheme_of(record):
    """The theoretical-bytes scheme of a run's JSON record, or None when it cannot be known.

    ``communication='auto'`` reports in ``hvd_topk_stats`` how many tensors (of those it may compress)
    use each transport at the end (``auto_dense``, ``auto_artopk``, ``auto_allgather``): when they
    all use one, that is the scheme; a mix (the per-tensor plan is not in the record) gives None."""
    compression = record.get("compression")
    if compression in ("none", "fp16", "topkef"):
        return {"none": "dense", "fp16": "fp16", "topkef": "topkef"}[compression]
    comm = record.get("communication")
    if comm == "auto":
        stats = record.get("hvd_topk_stats") or {}
        used = [t for t in ("dense", "artopk", "allgather") if stats.get(f"auto_{t}")]
        comm = used[0] if len(used) == 1 else None
    return comm if comm in ("artopk", "allgather", "dense") else None


def settled_step(record):
    """The first step after auto's last trial of plans and the switch that follows it (0: no trial)."""
    history = (record.get("hvd_topk_auto") or {}).get("history") or []
    ends = [h[0] for h in history if str(h[3]).startswith("trial,")]
    return ends[-1] + 2 if ends else 0


def measure(record, warmup, min_measured):
    """Step time and link bytes of one run after ``warmup`` steps, and after auto's trial of plans;
    ValueError if too few remain.

    Returns:
        dict: measured_steps, step_s (median), step_s_p10, step_s_p90,
        link_bytes (sum of link_tx_bytes over the measured steps / steps / ranks).
    """
    warmup = max(warmup, settled_step(record))
    times, tx = record["step_times_s"][warmup:], record["link_tx_bytes"][warmup:]
    if len(times) < min_measured:
        raise ValueError(f"{len(record['step_times_s'])} steps, {warmup} warm-up: fewer than "
                         f"{min_measured} measured steps")
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return {"measured_steps": len(times), "step_s": statistics.median(times), "step_s_p10": q[0],
            "step_s_p90": q[-1], "link_bytes": sum(tx) / len(tx) / record["ranks"]}


# -- planning -------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One planned job: where it runs, what it runs, and how long it may take."""
    part: str
    example: str
    label: str
    ranks: int
    bandwidth: str
    ratio: float = None
    non_iid: bool = False
    steps: int = 0                 # steps part: warm-up + measured; accuracy part: the fixed length
    warmup: int = 0                # steps part: steps left out of the measurement
    budget_s: float = 0.0          # tta: training wall-clock budget
    eval_every: int = 0            # tta: steps between evaluations
    cycle_ms: str = ""             # HOROVOD_CYCLE_TIME of this job (the cycle part varies it)
    repeat: int = 0                # steps part with --repeats N > 1: which pass over the grid (1..N)
    est_s: float = 0.0             # estimated duration of the job, startup included

    @property
    def run_id(self):
        slug = re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")
        ratio = "" if self.ratio is None else f"-r{self.ratio:g}"
        return (f"{self.part}-{self.example}-{slug}{ratio}-n{self.ranks}-{self.bandwidth}"
                + ("-noniid" if self.non_iid else "") + (f"-c{self.cycle_ms}" if self.part == "cycle" else "")
                + (f"-rep{self.repeat}" if self.repeat else ""))

    def argv(self, json_out):
        ex = EXAMPLES[self.example]
        fill = {"n": self.steps, "t": f"{self.budget_s:g}", "e": self.eval_every}
        template = {"steps": ex.steps_args, "cycle": ex.steps_args, "tta": ex.budget_args,
                    "accuracy": ex.length_args}[self.part]
        args = [sys.executable, os.path.join(ROOT, ex.script), *ex.args, *MODES[self.label],
                *[a.format(**fill) for a in template], "--quiet", "--json-out", json_out]
        if self.ratio is not None:
            args += ["--ratio", f"{self.ratio:g}"]
        if self.non_iid:
            args.append("--non-iid")
        return args


def is_sparse(label):
    """True when the mode compresses with Top-K (so it runs at every ratio)."""
    args = MODES[label]
    return args[args.index("--compression") + 1] in SPARSE_COMPRESSIONS


SELECT_S_PER_PARAM = 1.2e-8   # selection and error-feedback passes per parameter (measured: ~1.7e-8 loaded)


def estimate_step_s(example, label, ranks, bandwidth, ratio, cycle_ms):
    """Rough seconds per step, for budgets and the time estimate only: compute and Top-K work (ranks
    share the cores), a cycle of waiting, and the theoretical bytes of the whole job through the one
    limited loopback."""
    ex = EXAMPLES[example]
    work = ex.compute_s + (SELECT_S_PER_PARAM * ex.params if is_sparse(label) else 0.0)
    compute = work * max(1.0, ranks / (os.cpu_count() or 1)) + float(cycle_ms) / 1e3
    rate = RATE_BYTES_PER_S[bandwidth]
    if rate is None or ranks < 2:
        return compute
    compression = MODES[label][MODES[label].index("--compression") + 1]
    comm = MODES[label][MODES[label].index("--communication") + 1] if "--communication" in MODES[label] else None
    scheme = scheme_of({"compression": compression, "communication": comm}) or "artopk"
    theo = theoretical_bytes(scheme, [["all", int(ex.params), 2]], 0, ratio or 1.0, ranks)
    return compute + 1.1 * theo * ranks / rate


def job_overhead_s(example, ranks, bandwidth):
    """Estimated seconds of a job outside its steps: startup, and the broadcasts of the parameters
    and optimizer state at the start and the identity check at the end (3 x (N-1) x 4 x params bytes)."""
    rate = RATE_BYTES_PER_S[bandwidth]
    return (STARTUP_S + STARTUP_PER_RANK_S * ranks
            + (0.0 if rate is None else 3 * (ranks - 1) * 4 * EXAMPLES[example].params / rate))


def plan(o):
    """The list of ``Run`` the options ask for, with step counts, budgets and estimates filled in."""
    runs = []
    parts = o.part

    def timed(part, ranks, bw, label, ratio, cycle_ms, repeat=0):
        est = estimate_step_s(o.steps_example, label, ranks, bw, ratio, cycle_ms)
        measured = min(o.max_measured, max(o.min_measured, round(o.step_seconds / est)))
        warmup = max(o.warmup, MODE_WARMUP.get(label, 0))
        return Run(part, o.steps_example, label, ranks, bw, ratio, steps=warmup + measured, warmup=warmup,
                   cycle_ms=cycle_ms, repeat=repeat,
                   est_s=job_overhead_s(o.steps_example, ranks, bw) + (warmup + measured) * est)

    if "steps" in parts:
        for repeat in (range(1, o.repeats + 1) if o.repeats > 1 else [0]):   # the whole grid, in turn
            for ranks in o.ranks:
                for bw in o.bandwidths:
                    for label in o.modes:
                        for ratio in (o.ratios if is_sparse(label) else [None]):
                            runs.append(timed("steps", ranks, bw, label, ratio, o.cycle_time_ms, repeat))
    if "cycle" in parts:
        for label in o.cycle_modes:           # cycle times side by side: the machine's load drifts
            for cycle_ms in o.cycle_times:
                runs.append(timed("cycle", o.cycle_ranks, o.cycle_bandwidth, label,
                                  o.cycle_ratio if is_sparse(label) else None, cycle_ms))
    if "tta" in parts:
        for example in o.tta_examples:
            for bw in o.bandwidths:
                for label in o.tta_modes:
                    ratio = o.tta_ratio if is_sparse(label) else None
                    est = estimate_step_s(example, label, o.tta_ranks, bw, ratio, o.cycle_time_ms)
                    every = max(1, round(o.tta_budget / est / o.tta_points))
                    runs.append(Run("tta", example, label, o.tta_ranks, bw, ratio, budget_s=o.tta_budget,
                                    eval_every=every, cycle_ms=o.cycle_time_ms,
                                    est_s=job_overhead_s(example, o.tta_ranks, bw) + o.tta_budget + 2 * est))
    if "accuracy" in parts:
        for example in o.accuracy_examples:
            length = o.accuracy_length[example]
            for non_iid in o.non_iid:
                for label in o.accuracy_modes:
                    ratio = o.accuracy_ratio if is_sparse(label) else None
                    est = estimate_step_s(example, label, o.accuracy_ranks, "unlimited", ratio, o.cycle_time_ms)
                    epoch_steps = EXAMPLES[example].epoch_steps
                    steps = length * epoch_steps // o.accuracy_ranks if epoch_steps else length
                    runs.append(Run("accuracy", example, label, o.accuracy_ranks, "unlimited", ratio,
                                    non_iid=non_iid, steps=length, cycle_ms=o.cycle_time_ms,
                                    est_s=job_overhead_s(example, o.accuracy_ranks, "unlimited") + steps * est))
    return runs


# -- running ------------------------------------------------------------------------------------------
class Interrupted(BaseException):
    """SIGTERM: unwind like Ctrl-C so that every job is killed and every namespace deleted."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)     # a second one must not cut the clean-up short
    raise Interrupted(f"signal {signum}")


_NAMESPACES = itertools.count()


def namespace(rate, burst):
    """A fresh namespace named after this process (``hvdtopk-ev<pid>-<n>``), so leftovers are traceable."""
    from bench.infra.wire import Namespace
    return Namespace(rate=rate, burst=burst, name=f"hvdtopk-ev{os.getpid()}-{next(_NAMESPACES)}")


def job_env(cycle_ms):
    """Environment of a job: the same Horovod settings for every mode, dense included."""
    return {"HOROVOD_CYCLE_TIME": str(cycle_ms)}


def execute(run, o, unsupported):
    """Run one job in a fresh namespace; returns its row (status ok / failed / skipped) and record.

    ``unsupported`` maps a mode label to the reason it was skipped; a job failing with a ValueError
    (or an argparse error) that names one of its mode's options adds its label there."""
    from bench.infra.launch import JobFailed, run_job

    row = {**asdict(run), "run_id": run.run_id, "burst": o.burst, "status": "ok", "error": ""}
    if run.label in unsupported:
        row.update(status="skipped", error=unsupported[run.label])
        return row, None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        argv = run.argv(out)
        rate = BANDWIDTHS[run.bandwidth]
        t0 = time.perf_counter()
        try:
            with namespace(rate, o.burst) as ns:
                env = job_env(run.cycle_ms)
                row["command"] = recorded_command(env, ns.prefix, run.ranks, argv)
                run_job(run.ranks, argv, timeout=max(300, int(6 * run.est_s)), prefix=ns.prefix, env=env, cwd=ROOT)
            with open(out) as f:
                record = json.load(f)
        except JobFailed as e:
            reason = _unsupported_reason(e.output, MODES[run.label])
            if reason:
                unsupported[run.label] = f"unsupported option: {reason}"
                row.update(status="skipped", error=unsupported[run.label])
            else:
                row.update(status="failed", error=_tail(str(e)))
            return row, None
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            row.update(status="failed", error=_tail(f"{type(e).__name__}: {e}"))
            return row, None
        finally:
            row["job_s"] = round(time.perf_counter() - t0, 1)
    return row, record


def relative(command):
    """A recorded command with this checkout's absolute path taken out (run from the repository root)."""
    return command.replace(ROOT + os.sep, "")


def recorded_command(env, prefix, ranks, argv):
    """The command line of a job as a report records it: environment, namespace prefix, launcher."""
    from bench.infra.launch import launch_command

    return relative(shlex.join([*(f"{k}={v}" for k, v in env.items()), *prefix, *launch_command(ranks, argv)]))


def _unsupported_reason(output, mode_args):
    """The ValueError / argparse error line of a job's output if it names one of the mode's options."""
    words = {a.lstrip("-") for a in mode_args} - {"compression", "none", "fp16", "topkef", "hvd_topk"}
    for line in output.splitlines():
        text = re.sub(r"^\[\d+\]<std\w+>:", "", line).strip()
        if (text.startswith("ValueError:") or "invalid choice" in text or "unrecognized arguments" in text) \
                and any(w and w in text for w in words):
            return text[:300]
    return None


def _tail(text, n=1500):
    """The last ``n`` characters on one line (CSV-friendly)."""
    return " | ".join(line for line in text[-n:].splitlines() if line.strip())


def control_plane(ranks, bandwidth, cycle_ms, o):
    """Loopback bytes per second of a job whose ranks sit idle between two barriers (Horovod's
    background loop coordinating every HOROVOD_CYCLE_TIME with a small allreduce), all ranks together."""
    from bench.infra.launch import run_job

    row = {"ranks": ranks, "bandwidth": bandwidth, "cycle_ms": cycle_ms, "idle_s": o.idle_seconds,
           "status": "ok", "error": ""}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "idle.json")
        try:
            with namespace(BANDWIDTHS[bandwidth], o.burst) as ns:
                run_job(ranks, [sys.executable, "-m", "bench.evidence", "--idle-worker", str(o.idle_seconds),
                                "--out", out], timeout=180, prefix=ns.prefix, env=job_env(cycle_ms), cwd=ROOT)
            with open(out) as f:
                row.update(json.load(f))
        except Exception as e:   # noqa: BLE001  (any failure is recorded; the grid goes on)
            row.update(status="failed", error=_tail(str(e)))
    return row


def idle_worker(seconds, out, ops=30):
    """The probe job's rank body: the ranks sit idle between two barriers (the control plane's rate),
    then run ``ops`` one-element allreduces and then broadcasts, one at a time (the fixed bytes of one
    small collective: its messages' headers, Gloo's notifications, its cycle; the idle rate over the
    same time is subtracted). Rank 0 writes ``out``."""
    import horovod.torch as hvd
    import torch

    from bench.infra.wire import loopback_bytes

    hvd.init()
    hvd.allreduce(torch.zeros(1), name="idle.start")
    tx0, t0 = loopback_bytes()[0], time.perf_counter()
    time.sleep(seconds)
    tx1, t1 = loopback_bytes()[0], time.perf_counter()
    rate = (tx1 - tx0) / (t1 - t0)
    result = {"measured_s": t1 - t0, "tx_bytes": tx1 - tx0, "bytes_per_s": rate,
              "bytes_per_s_per_rank": rate / hvd.size()}
    for op in ("allreduce", "broadcast"):
        x = torch.zeros(1)
        hvd.allreduce(x, name=f"idle.{op}.before")
        tx0, t0 = loopback_bytes()[0], time.perf_counter()
        for _ in range(ops):
            if op == "allreduce":
                hvd.allreduce(x, name="idle.op")
            else:
                hvd.broadcast(x, root_rank=0, name="idle.op.bcast")
        tx1, t1 = loopback_bytes()[0], time.perf_counter()
        result[f"{op}_op_bytes"] = (tx1 - tx0 - rate * (t1 - t0)) / ops
    hvd.allreduce(torch.zeros(1), name="idle.end")
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


# -- rows ---------------------------------------------------------------------------------------------
def steps_row(row, record, o, cp):
    """Fill a steps-part row with the measured and theoretical figures."""
    row.update(_record_fields(record))
    try:
        row.update(measure(record, row["warmup"], o.min_measured))
    except ValueError as e:
        row.update(status="failed", error=str(e))
        return row
    scheme = scheme_of(record)
    stats = record.get("hvd_topk_stats") or {}
    ratio = stats.get("density") or record.get("ratio") or 1.0      # the ratio in use at the end
    mix = ", ".join(f"{t} {stats[f'auto_{t}']}" for t in ("dense", "artopk", "allgather") if stats.get(f"auto_{t}"))
    row["scheme"] = scheme or (f"auto mix: {mix}" if mix else "")
    if scheme is not None:
        theo = theoretical_bytes(scheme, record["tensors"], record["min_numel"], ratio, record["ranks"],
                                 value_bytes=2 if record.get("value_dtype") == "float16" else 4)
        row.update(theoretical_bytes=theo, measured_over_theoretical=row["link_bytes"] / theo if theo else None,
                   excess_bytes=row["link_bytes"] - theo)
    rate = cp.get((record["ranks"], row["bandwidth"], row["cycle_ms"]))
    if rate is not None:
        row.update(cp_idle_bytes_per_s_per_rank=rate, cp_bound_bytes=rate * row["step_s"])
    return row


def estimate_text(runs, probes, o):
    """One line: the planned jobs and their estimated duration, by part."""
    per_part = {}
    for r in runs:
        per_part[r.part] = per_part.get(r.part, 0.0) + r.est_s
    probe_s = sum(STARTUP_S + STARTUP_PER_RANK_S * n + o.idle_seconds + 3 for n, _, _ in probes)
    startup = sum(STARTUP_S + STARTUP_PER_RANK_S * r.ranks for r in runs)
    total = sum(per_part.values()) + probe_s
    parts = ", ".join(f"{part} {s / 60:.0f}" for part, s in per_part.items())
    return (f"evidence: {len(runs)} runs + {len(probes)} control-plane probes, estimated {total / 60:.0f} min on "
            f"an idle {os.cpu_count()}-core machine ({parts}, probes {probe_s / 60:.0f} min; of it "
            f"{startup / 60:.0f} min job startup)")


def _record_fields(record):
    """The run's own figures kept in every CSV row."""
    return {k: record.get(k) for k in ("model", "dataset", "num_params", "min_numel", "steps", "wall_s",
                                       "params_identical", "test_loss", "test_accuracy", "compression",
                                       "communication")}


def add_relative(rows):
    """Speed-up over dense and fp16 and bytes relative to them, within each (example, ranks, link, cycle,
    repeat)."""
    base = {}
    for r in rows:
        if r["status"] == "ok" and r["label"] in ("dense", "fp16") and "step_s" in r:
            base[(r["example"], r["ranks"], r["bandwidth"], r["cycle_ms"], r.get("repeat", 0), r["label"])] = r
    for r in rows:
        if r["status"] != "ok" or "step_s" not in r:
            continue
        for ref in ("dense", "fp16"):
            b = base.get((r["example"], r["ranks"], r["bandwidth"], r["cycle_ms"], r.get("repeat", 0), ref))
            if b is not None:
                r[f"speedup_vs_{ref}"] = b["step_s"] / r["step_s"]
                r[f"bytes_vs_{ref}"] = r["link_bytes"] / b["link_bytes"]
    return rows


# Figures of a steps row whose median over the repeats is the cell's (``median_rows``).
MEDIAN_FIELDS = ("measured_steps", "step_s", "step_s_p10", "step_s_p90", "link_bytes", "theoretical_bytes",
                 "measured_over_theoretical", "excess_bytes", "cp_bound_bytes", "wall_s", "job_s")


def median_rows(rows):
    """One row per cell (example, ranks, link, cycle, mode, ratio) from the runs of every repeat: the
    median of each figure in ``MEDIAN_FIELDS`` over the runs that succeeded (``repeats`` of them; each
    one's step time in ``step_s_runs``); speed-ups and bytes against dense and fp16 are recomputed from
    the medians. A cell with no successful run keeps its first run's failure."""
    cells = {}
    for r in rows:
        cells.setdefault((r["example"], r["ranks"], r["bandwidth"], r["cycle_ms"], r["label"], r.get("ratio")),
                         []).append(r)
    out = []
    for runs in cells.values():
        ok = [r for r in runs if r["status"] == "ok" and "step_s" in r]
        row = {k: v for k, v in (ok or runs)[0].items() if not k.startswith(("speedup_vs_", "bytes_vs_"))}
        row.update(run_id=re.sub(r"-rep\d+$", "", row["run_id"]), repeat=0, repeats=len(ok))
        if ok:
            for field in MEDIAN_FIELDS:
                values = [r[field] for r in ok if r.get(field) is not None]
                row[field] = statistics.median(values) if values else None
            row.update(step_s_runs="/".join(f"{r['step_s'] * 1e3:.1f}" for r in ok),
                       scheme=", ".join(dict.fromkeys(r.get("scheme") or "" for r in ok)),
                       params_identical=all(r.get("params_identical") for r in ok),
                       error="; ".join(f"{r['run_id']}: {r['status']}" for r in runs if r not in ok))
        out.append(row)
    return add_relative(out)


def auto_vs_best(rows):
    """Every ``hvd_topk auto`` run against the fastest fixed mode (any other mode, at auto's ratio or
    uncompressed) and against dense of the same example, ranks, link, cycle time and repeat."""
    ok = [r for r in rows if r["status"] == "ok" and "step_s" in r]

    def cell(r):
        return r["example"], r["ranks"], r["bandwidth"], r["cycle_ms"], r.get("repeat", 0)

    out = []
    for a in ok:
        if a["label"] != "hvd_topk auto":
            continue
        fixed = [r for r in ok if r["label"] != "hvd_topk auto" and cell(r) == cell(a)
                 and r.get("ratio") in (None, a.get("ratio"))]
        if not fixed:
            continue
        best = min(fixed, key=lambda r: r["step_s"])
        dense = next((r for r in fixed if r["label"] == "dense"), None)
        out.append({"example": a["example"], "ranks": a["ranks"], "bandwidth": a["bandwidth"],
                    "cycle_ms": a["cycle_ms"], "repeat": a.get("repeat", 0), "ratio": a.get("ratio"),
                    "auto_s": a["step_s"], "best": _mode_name(best), "best_s": best["step_s"],
                    "vs_best": a["step_s"] / best["step_s"] - 1,
                    "vs_dense": None if dense is None else a["step_s"] / dense["step_s"] - 1})
    return out


# -- outputs --------------------------------------------------------------------------------------------
STEPS_COLUMNS = ["run_id", "status", "example", "model", "label", "compression", "communication", "scheme",
                 "ratio", "ranks", "bandwidth", "burst", "cycle_ms", "repeat", "repeats", "num_params", "steps",
                 "measured_steps", "step_s", "step_s_runs", "step_s_p10", "step_s_p90", "speedup_vs_dense",
                 "speedup_vs_fp16", "link_bytes", "theoretical_bytes", "measured_over_theoretical", "excess_bytes",
                 "cp_idle_bytes_per_s_per_rank",
                 "cp_bound_bytes", "bytes_vs_dense", "bytes_vs_fp16", "params_identical",
                 "test_accuracy", "test_loss", "wall_s", "job_s", "est_s", "command", "error"]
CP_COLUMNS = ["ranks", "bandwidth", "cycle_ms", "idle_s", "measured_s", "tx_bytes", "bytes_per_s",
              "bytes_per_s_per_rank", "allreduce_op_bytes", "broadcast_op_bytes", "status", "error"]
TTA_COLUMNS = ["run_id", "status", "example", "model", "label", "ratio", "ranks", "bandwidth", "budget_s",
               "eval_every", "steps", "wall_s", "final_metric", "time_to_target_s", "target", "params_identical",
               "test_accuracy", "test_loss", "job_s", "command", "error"]
ACC_COLUMNS = ["run_id", "status", "example", "model", "label", "ratio", "ranks", "non_iid", "steps",
               "test_accuracy", "test_loss", "vs_dense", "params_identical", "wall_s", "job_s", "command", "error"]


def write_csv(path, rows, columns):
    """Rows as CSV with the given columns (missing values empty, floats with 6 significant digits)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c])
                        for c in columns])


def _failed_row(lead, r, cells, limit=100):
    """Markdown row of a run that did not finish: ``lead`` cells, its status and error, then empty
    cells up to ``cells`` columns."""
    return "| " + " | ".join([*lead, f"{r['status']}: {r['error'][:limit]}"]) + " |" + " |" * (cells - len(lead) - 1)

def _mode_name(r):
    return r["label"] + ("" if r.get("ratio") in (None, "") else f" {r['ratio']:g}")


_STYLE = {0.1: ":", 0.01: "-", 0.001: "--"}     # line style by ratio; colour by mode


def _color(label):
    return f"C{list(MODES).index(label) % 10}"


def plot_all(out, steps, tta, curves):
    """bytes_per_step.png, speedup.png and tta_<example>.png (only those with data); returns the names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ok = [r for r in steps if r["status"] == "ok" and "link_bytes" in r]
    ranks_list = sorted({r["ranks"] for r in ok})
    if ok:
        width_in = max(5.5, 0.5 * len({_mode_name(r) for r in ok}))
        fig, axes = plt.subplots(1, len(ranks_list), figsize=(width_in * len(ranks_list), 4.5), squeeze=False)
        for ax, ranks in zip(axes[0], ranks_list):
            rs = [r for r in ok if r["ranks"] == ranks]
            names = list(dict.fromkeys(_mode_name(r) for r in rs))
            bws = [b for b in BANDWIDTHS if any(r["bandwidth"] == b for r in rs)]
            width = 0.8 / max(1, len(bws))
            for j, bw in enumerate(bws):
                xs, ys = [], []
                for i, name in enumerate(names):
                    hit = [r for r in rs if _mode_name(r) == name and r["bandwidth"] == bw]
                    if hit:
                        xs.append(i + (j - (len(bws) - 1) / 2) * width)
                        ys.append(hit[0]["link_bytes"])
                ax.bar(xs, ys, width, label=f"measured, {bw}")
            theo = [(i, next((r["theoretical_bytes"] for r in rs if _mode_name(r) == name
                              and r.get("theoretical_bytes")), None)) for i, name in enumerate(names)]
            theo = [(i, t) for i, t in theo if t]
            if theo:
                ax.scatter(*zip(*theo), marker="_", s=400, color="black", zorder=3, label="theoretical")
            ax.set_yscale("log")
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
            ax.set_ylabel("link bytes per rank per step")
            ax.set_title(f"{ranks} ranks")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "bytes_per_step.png"), dpi=100)
        plt.close(fig)
        written.append("bytes_per_step.png")

    fast = [r for r in ok if "speedup_vs_dense" in r]
    if fast:
        ranks_list = sorted({r["ranks"] for r in fast})
        fig, axes = plt.subplots(1, len(ranks_list), figsize=(5.5 * len(ranks_list), 4.2), squeeze=False)
        for ax, ranks in zip(axes[0], ranks_list):
            rs = [r for r in fast if r["ranks"] == ranks]
            bws = [b for b in BANDWIDTHS if any(r["bandwidth"] == b for r in rs)]
            for name in dict.fromkeys(_mode_name(r) for r in rs):
                mine = [r for r in rs if _mode_name(r) == name]
                pts = sorted((bws.index(r["bandwidth"]), r["speedup_vs_dense"]) for r in mine)
                ax.plot(*zip(*pts), marker="o", label=name, color=_color(mine[0]["label"]),
                        linestyle=_STYLE.get(mine[0].get("ratio"), "-"))
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xticks(range(len(bws)))
            ax.set_xticklabels(bws)
            ax.set_xlabel("link")
            ax.set_yscale("log")
            ax.set_ylabel("step-time speed-up over dense")
            ax.set_title(f"{ranks} ranks")
            ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "speedup.png"), dpi=100)
        plt.close(fig)
        written.append("speedup.png")

    for example in dict.fromkeys(r["example"] for r in tta if r["status"] == "ok"):
        metric = EXAMPLES[example].metric
        rs = [r for r in tta if r["status"] == "ok" and r["example"] == example]
        bws = [b for b in BANDWIDTHS if any(r["bandwidth"] == b for r in rs)]
        fig, axes = plt.subplots(1, len(bws), figsize=(4.5 * len(bws), 3.6), squeeze=False, sharey=True)
        for ax, bw in zip(axes[0], bws):
            for r in rs:
                if r["bandwidth"] != bw:
                    continue
                pts = [(c["wall_s"], c[metric]) for c in curves if c["run_id"] == r["run_id"]]
                if pts:
                    ax.plot(*zip(*pts), marker=".", label=_mode_name(r), color=_color(r["label"]))
            ax.set_title(f"{example}, {rs[0]['ranks']} ranks, {bw}")
            ax.set_xlabel("training wall clock (s)")
            ax.set_ylabel("test accuracy" if metric == "test_acc" else "test loss (nats/byte)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"tta_{example}.png"), dpi=100)
        plt.close(fig)
        written.append(f"tta_{example}.png")
    return written


def _fmt(v, spec=",.0f", suffix=""):
    return "-" if v is None or v == "" else format(v, spec) + suffix


def checks(steps, acc, runs=None):
    """The targets: list of (target, met: True/False/None for no data, numbers). ``steps`` are the
    cells (medians when the grid was repeated), ``runs`` every repeat's runs (or None)."""
    out = []
    ok = [r for r in steps if r["status"] == "ok" and "link_bytes" in r]
    comp = [r for r in ok if r.get("ratio") is not None and r.get("measured_over_theoretical")]
    if comp:
        worst = max(comp, key=lambda r: r["measured_over_theoretical"])
        bad = [r for r in comp if r["measured_over_theoretical"] > 1.1]
        by_ratio = "; ".join(
            f"ratio {ratio:g}: {min(q):.2f}-{max(q):.2f}" for ratio in sorted({r["ratio"] for r in comp}, reverse=True)
            for q in [[r["measured_over_theoretical"] for r in comp if r["ratio"] == ratio]])
        out.append(("(1) measured/theoretical <= 1.1 for every compressed mode", not bad,
                    f"{len(comp) - len(bad)}/{len(comp)} runs within 1.1; worst "
                    f"{worst['measured_over_theoretical']:.2f} ({_mode_name(worst)}, {worst['ranks']} ranks, "
                    f"{worst['bandwidth']}); range by ratio: {by_ratio}"))
    else:
        out.append(("(1) measured/theoretical <= 1.1 for every compressed mode", None, "no data"))
    for label, bound in (("hvd_topk allgather", 25), ("hvd_topk allgather fp16", 25), ("hvd_topk artopk", 40),
                         ("topkef", 40)):
        rs = [r for r in ok if r["label"] == label and r["ranks"] == 4 and r.get("ratio") == 0.01
              and r.get("bytes_vs_dense")]
        text = "; ".join(f"{r['bandwidth']}: 1/{1 / r['bytes_vs_dense']:.1f}" for r in rs)
        out.append((f"(2) 4 ranks, ratio 0.01: {label} link bytes <= 1/{bound} of dense",
                    all(1 / r["bytes_vs_dense"] >= bound for r in rs) if rs else None, text or "no data"))
    big = [r for r in ok if r["ranks"] == 4 and r["bandwidth"] == "100mbit" and r.get("ratio") == 0.01
           and (r.get("num_params") or 0) >= 5e6]
    for r in big:
        sd, sf = r.get("speedup_vs_dense"), r.get("speedup_vs_fp16")
        met = None if sd is None or sf is None else (sd >= 5 and sf >= 2.5)
        out.append((f"(3) 100 Mbit, 4 ranks, {r['num_params'] / 1e6:.1f}M params: {_mode_name(r)} step >= 5x "
                     "faster than dense, >= 2.5x than fp16", met,
                     f"{_fmt(sd, '.2f', 'x')} vs dense, {_fmt(sf, '.2f', 'x')} vs fp16"))
    if not big:
        out.append(("(3) 100 Mbit, 4 ranks, >= 5M params: >= 5x dense, >= 2.5x fp16", None, "no data"))
    acc_ok = [r for r in acc if r["status"] == "ok" and r.get("vs_dense") is not None]
    for r in acc_ok:
        if r["non_iid"] or not is_sparse(r["label"]):
            continue
        if EXAMPLES[r["example"]].metric == "test_acc":
            met = r["vs_dense"] >= -0.01
            text = f"{r['test_accuracy']:.4f} vs dense {r['test_accuracy'] - r['vs_dense']:.4f}"
            name = f"(4) {r['example']} accuracy within 1 point of dense: {_mode_name(r)}"
        else:
            met, text = r["vs_dense"] <= 0.02, f"loss {r['test_loss']:.4f}, {100 * r['vs_dense']:+.2f}% vs dense"
            name = f"(4) {r['example']} loss within 2% of dense: {_mode_name(r)}"
        out.append((name, met, text))
    noniid = [r for r in acc_ok if r["non_iid"]]
    out.append(("(4) non-IID reported", bool(noniid) if acc else None,
                f"{len(noniid)} non-IID runs in the accuracy table" if acc else "no data"))
    per_repeat = auto_vs_best(runs or [])
    for c in auto_vs_best(steps):
        # The target: on the emulated (tbf) links, within 5% of the best fixed mode; on the unlimited
        # loopback, within 5% of dense (its figure against the best fixed mode is given too).
        unlimited = c["bandwidth"] == "unlimited"
        key = "vs_dense" if unlimited else "vs_best"
        met = None if c[key] is None else c[key] <= 0.05
        text = (f"auto {c['auto_s'] * 1e3:,.1f} ms, best fixed {c['best']} {c['best_s'] * 1e3:,.1f} ms: "
                f"{100 * c['vs_best']:+.1f}%")
        if unlimited:
            text += f"; vs dense {_fmt(None if c['vs_dense'] is None else 100 * c['vs_dense'], '+.1f', '%')}"
        same = [x for x in per_repeat if (x["example"], x["ranks"], x["bandwidth"], x["cycle_ms"], x["ratio"])
                == (c["example"], c["ranks"], c["bandwidth"], c["cycle_ms"], c["ratio"])]
        if same:
            text += (f" (medians of {len(same)} repeats; each repeat vs "
                     + ("dense" if unlimited else "its best fixed mode") + ": "
                     + ", ".join(_fmt(None if x[key] is None else 100 * x[key], '+.1f', '%') for x in same) + ")")
        out.append((f"(auto) {c['ranks']} ranks, {c['bandwidth']}, ratio {c['ratio']:g}: auto within 5% of "
                    + ("dense" if unlimited else "the best fixed mode"), met, text))
    return out


def machine_facts():
    """Cores, CPU, kernel and versions, as markdown lines."""
    import horovod
    import torch
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return [f"- CPU: {os.cpu_count()} cores visible ({cpu or 'unknown model'}); Linux {platform.release()}",
            f"- Python {platform.python_version()}, torch {torch.__version__}, horovod {horovod.__version__} (Gloo)"]


def _cycle_summary(cycle):
    """One line per mode: its excess bytes at the shortest and the longest cycle time of the cycle part."""
    out = []
    ok = [r for r in cycle if r["status"] == "ok" and r.get("excess_bytes") is not None]
    for name in dict.fromkeys(_mode_name(r) for r in ok):
        rs = sorted((r for r in ok if _mode_name(r) == name), key=lambda r: float(r["cycle_ms"]))
        if len(rs) > 1:
            lo, hi = rs[0], rs[-1]
            out.append(f"- {name}: excess {lo['excess_bytes']:,.0f} B at {lo['cycle_ms']} ms, "
                       f"{hi['excess_bytes']:,.0f} B at {hi['cycle_ms']} ms; step {lo['step_s'] * 1e3:,.0f} ms "
                       f"vs {hi['step_s'] * 1e3:,.0f} ms")
    return out


def notes(o):
    """The report's notes: what the ratio includes, and why the settings are what they are."""
    return [
        "## Notes: what the numbers include", "",
        "- **measured / theoretical.** Measured: the loopback's transmitted bytes over the measured steps, every "
        "rank's together, divided by steps and ranks: payload, TCP/IP headers and ACKs, Gloo's per-message "
        "preambles and its 'send ready' / 'recv ready' notifications, and Horovod's control plane (a coordination "
        "allreduce every cycle, also while the step computes). Theoretical: the payload the scheme must move "
        "(`bench.evidence.theoretical_bytes`). excess = measured - theoretical: all of the overhead, measured. "
        "control plane <=: the probe's idle rate for the same ranks and link times the step time, an upper "
        "bound on the cycles' share: idle ranks cycle at the full rate, ranks busy computing (more ranks than "
        "cores) cycle far less often. Part `cycle` shows how much of the excess follows the cycle time.",
        "- **Theoretical bytes per rank per step** (Horovod 0.28.1's Gloo: ring allreduce, binomial-tree "
        "broadcast, ring allgatherv; see `theoretical_bytes`), N ranks, k = max(1, ceil(ratio * numel)) per "
        "compressed tensor, dense tensors 2(N-1)/N * 4 * numel: dense 2(N-1)/N * 4 * numel; fp16 2(N-1)/N * 2 "
        "* numel; topkef and artopk 2(N-1)/N * 4(k+1) + (N-1)/N * 4k (values + flag allreduced, the leader's "
        "int32 index set shared: (N-1) * 4k on the link, averaged over the ranks, whether broadcast or, since "
        "one allgather per step carries every set, forwarded around the ring); allgather (N-1) * 8(k+1); "
        "with float16 values (mode 'hvd_topk allgather fp16', `value_dtype=torch.float16`) a compressed "
        "tensor's values and flag take 2 bytes instead of 4 (allgather (N-1) * 6(k+1)).",
        "- **Step windows.** Each step's bytes are counted from the previous step's end to its own end on "
        "rank 0, so an asynchronous transfer (the next step's index sets) can land in a neighbouring "
        "window: the measured sum is off by up to about one step's index sets, a share 1/M of it over M "
        "measured steps (values slightly under 1.0 at ratio 0.1 come from this).",
        "- **Where the overhead comes from.** Every collective has a fixed cost in messages (probe table: a "
        "small broadcast costs a few KB over all ranks, more than a small allreduce), and the layer-wise "
        "transports run allreduces (fused per cycle) and, for the AR-Topk index sets, one allgather per step; "
        "the control plane adds a little per cycle. At ratio 0.001 the payload of this 6.3M-parameter model is "
        "tens of KB per rank per step, the same order as those fixed costs, so the ratio stays well above "
        "1.1 there; at 0.1 and 0.01 the payload dwarfs them. Fewer, larger collectives (hvd_topk's "
        "`--selection global`) lower the fixed part; "
        "none of this changes what the scheme itself must send.",
        f"- **HOROVOD_CYCLE_TIME={o.cycle_time_ms} ms.** Horovod 0.28.1 defaults to 1 ms. The grid sets one value "
        "for every job, dense and fp16 included: a ready tensor waits at most one cycle longer, which costs a "
        "network-bound step little, and the control plane shrinks in proportion. How much that matters depends "
        "on the machine: cycles run while ranks wait (for the link or for a core), so a loaded machine showed "
        "more of them than an idle one (`--part cycle` measures bytes and step time side by side).",
        "- **Allgather at 4 ranks, ratio 0.01.** Its theoretical bytes over dense are N(k+1)/numel = 0.04 = 1/25 "
        "before any overhead, so 'at most 1/25 of dense' can only hold if dense carried more overhead than it; "
        "with float16 values ('hvd_topk allgather fp16') it is 3/4 of that, 0.03 = 1/33.",
        "- **TopKEF vs hvd_topk.** TopKEF (stock Horovod's Compressor) compresses every tensor of at least "
        "min_numel elements, 1-D included; hvd_topk.DistributedOptimizer sends 1-D tensors dense.",
        "- **auto.** Its first steps probe the link and may measure up to 4 plans in turns of 4 steps, for 5 to 21 "
        f"rounds; its steps are measured after {MODE_WARMUP['hvd_topk auto']} warm-up steps, or after its trial "
        "when that takes longer. Its theoretical bytes are given when all "
        "its tensors use one transport (from `hvd_topk_stats`), else left empty.",
        "- **Time to accuracy.** The budget is checked at step boundaries, so a run's last step can end past it "
        "(one dense step at 100 Mbit with 4 ranks is ~12 s). Evaluation time is not on the clock.",
        f"- **Link model.** tbf with burst {o.burst} (1mb is the smallest that passes MTU-9000 frames here): "
        "that much can pass at the loopback's speed after an idle moment, so short bursts beat the rate.",
    ]


def write_report(path, o, steps, cycle, cp, tta, acc, pngs, command, runs=None):
    """report.md: check list, setup, control plane, step tables (medians with ``runs``, every repeat's
    runs, after --repeats), repeats, TTA, accuracy, notes, commands."""
    L = ["# Evidence: step time, link bytes, time to accuracy and accuracy of Top-K compression", ""]
    L += ["## Targets", "", "| target | status | numbers |", "|---|---|---|"]
    for name, met, text in checks(steps, acc, runs):
        L.append(f"| {name} | {'met' if met else 'not met' if met is False else 'no data'} | {text} |")
    L += ["", "## Setup", ""] + machine_facts() + [
        f"- Links: every job in a fresh network namespace; loopback MTU 9000; `tc tbf rate R burst {o.burst} "
        "latency 100ms` for 100mbit and 1gbit, no qdisc for unlimited. All ranks share the one loopback, so a "
        "job's total traffic (every rank's) goes through the limit.",
        f"- Horovod: Gloo controller, `HOROVOD_CYCLE_TIME={o.cycle_time_ms}` (ms) for every job, dense and fp16 "
        "included; fusion threshold and response cache at Horovod's defaults (128 MiB, on).",
        f"- Steps part: {o.warmup} warm-up steps skipped, then {o.min_measured}..{o.max_measured} measured steps "
        "(fewer when a step is slow); step time = median of the measured steps; link bytes = sum of the "
        "measured steps' loopback tx bytes / steps / ranks."
        + (f" The grid ran {max(r['repeat'] for r in runs)} times in turn (every mode once per repeat); every "
           "figure of the step tables is the median over the repeats (each run's step time is in the Repeats "
           "section)." if runs else ""),
        f"- Command: `{command}`", ""]
    L += ["## Horovod's control plane and per-collective overhead (measured)", "",
          "A probe job per link: its ranks first sit idle between two barriers, yet bytes flow: the Gloo "
          "controller runs a cycle every HOROVOD_CYCLE_TIME, each with a small bit-vector allreduce "
          "(response-cache coordination). Then it runs one-element allreduces and broadcasts one at a time: "
          "the bytes one small collective costs beyond its payload (the idle rate over the same time "
          "subtracted): each Gloo message travels with 'send ready' / 'recv ready' notifications "
          "(48-byte preambles), each TCP segment with its headers, and a ring allreduce of N ranks sends "
          "at least 2N segments. Bytes of all ranks together.", "",
          "| ranks | link | cycle ms | idle bytes/s | idle bytes/s per rank | bytes per small allreduce | "
          "bytes per small broadcast |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in cp:
        L.append(f"| {r['ranks']} | {r['bandwidth']} | {r['cycle_ms']} | {_fmt(r.get('bytes_per_s'))} | "
                 f"{_fmt(r.get('bytes_per_s_per_rank'))} | {_fmt(r.get('allreduce_op_bytes'))} | "
                 f"{_fmt(r.get('broadcast_op_bytes'))} |" if r["status"] == "ok"
                 else f"| {r['ranks']} | {r['bandwidth']} | {r['cycle_ms']} | failed: {r['error'][:80]} | | | |")
    L += ["", "## Step time and link bytes", "",
          "bytes: per rank per step. theoretical: what the scheme must send (`theoretical_bytes`, formulas "
          "verified in Horovod 0.28.1 / Gloo). ratio = measured / theoretical: it includes TCP/IP headers and "
          "ACKs, Gloo's per-message preamble and notifications, Horovod's control plane during the step, and "
          "everything else the job sent in the measured steps. excess = measured - theoretical. control plane <=: "
          "the probe's idle rate times the step time, an upper bound on the control plane's share (see the "
          "notes).", ""]
    for ranks in sorted({r["ranks"] for r in steps}):
        for bw in [b for b in BANDWIDTHS if any(r["bandwidth"] == b and r["ranks"] == ranks for r in steps)]:
            rs = [r for r in steps if r["ranks"] == ranks and r["bandwidth"] == bw]
            L += [f"### {ranks} ranks, {bw}", "",
                  "| mode | step ms | vs dense | vs fp16 | link bytes | theoretical | ratio | excess | "
                  "control plane <= | bytes vs dense | same params |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
            for r in rs:
                if r["status"] != "ok":
                    L.append(_failed_row([_mode_name(r)], r, 11, limit=120))
                    continue
                L.append(f"| {_mode_name(r)} | {r['step_s'] * 1e3:,.1f} | "
                         f"{_fmt(r.get('speedup_vs_dense'), '.2f', 'x')} | "
                         f"{_fmt(r.get('speedup_vs_fp16'), '.2f', 'x')} | {_fmt(r['link_bytes'])} | "
                         f"{_fmt(r.get('theoretical_bytes'))} | {_fmt(r.get('measured_over_theoretical'), '.3f')} | "
                         f"{_fmt(r.get('excess_bytes'))} | {_fmt(r.get('cp_bound_bytes'))} | "
                         f"{_fmt(r.get('bytes_vs_dense'), '.4f')} | "
                         f"{'yes' if r.get('params_identical') else 'NO'} |")
            L.append("")
    if runs:
        L += _repeats_section(runs)
    if cycle:
        L += ["## Control plane against HOROVOD_CYCLE_TIME", "",
              "The same runs at several cycle times (the cycle part): a longer cycle means fewer "
              "coordination rounds per second (fewer control-plane bytes) but a longer wait before a ready "
              "tensor is sent.", "",
              "| cycle ms | mode | ranks | link | step ms | link bytes | theoretical | ratio | excess | "
              "control plane <= |", "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in cycle:
            if r["status"] != "ok":
                L.append(_failed_row([str(r["cycle_ms"]), _mode_name(r), str(r["ranks"]), r["bandwidth"]], r, 10))
                continue
            L.append(f"| {r['cycle_ms']} | {_mode_name(r)} | {r['ranks']} | {r['bandwidth']} | "
                     f"{r['step_s'] * 1e3:,.1f} | {_fmt(r['link_bytes'])} | {_fmt(r.get('theoretical_bytes'))} | "
                     f"{_fmt(r.get('measured_over_theoretical'), '.3f')} | {_fmt(r.get('excess_bytes'))} | "
                     f"{_fmt(r.get('cp_bound_bytes'))} |")
        L += [""] + _cycle_summary(cycle) + [""]
    L += [f"![{title}]({png})\n" for png, title in (("bytes_per_step.png", "bytes per step"),
                                                    ("speedup.png", "speed-up over dense")) if png in pngs]
    if tta:
        L += ["## Time to accuracy", "",
              f"Every mode trains for the same wall-clock budget ({o.tta_budget:g} s of training; evaluation "
              "excluded from the clock). Target: the accuracy / loss named in the table.", "",
              "| example | link | mode | steps | final | time to target (s) | same params |",
              "|---|---|---|---:|---:|---:|:---:|"]
        for r in tta:
            if r["status"] != "ok":
                L.append(_failed_row([r["example"], r["bandwidth"], _mode_name(r)], r, 7))
                continue
            L.append(f"| {r['example']} | {r['bandwidth']} | {_mode_name(r)} | {r['steps']} | "
                     f"{_fmt(r.get('final_metric'), '.4f')} | "
                     f"{_fmt(r.get('time_to_target_s'), '.1f')} (target {r['target']:g}) | "
                     f"{'yes' if r.get('params_identical') else 'NO'} |")
        L.append("")
        L += [f"![time to accuracy, {p[4:-4]}]({p})" for p in pngs if p.startswith("tta_")] + [""]
    if acc:
        L += ["## Accuracy after a fixed length (unlimited link)", "",
              "| example | data | mode | length | test accuracy | test loss | vs dense | same params |",
              "|---|---|---|---:|---:|---:|---:|:---:|"]
        for r in acc:
            if r["status"] != "ok":
                L.append(_failed_row([r["example"], "non-IID" if r["non_iid"] else "IID", _mode_name(r)], r, 8))
                continue
            metric = EXAMPLES[r["example"]].metric
            vs = r.get("vs_dense")
            vs_text = "-" if vs is None else (f"{100 * vs:+.2f} pt" if metric == "test_acc" else f"{100 * vs:+.2f}%")
            L.append(f"| {r['example']} | {'non-IID' if r['non_iid'] else 'IID'} | {_mode_name(r)} | {r['steps']} | "
                     f"{_fmt(r.get('test_accuracy'), '.4f')} | {_fmt(r.get('test_loss'), '.4f')} | {vs_text} | "
                     f"{'yes' if r.get('params_identical') else 'NO'} |")
        L.append("")
    L += notes(o) + [""]
    L += ["## Commands of the runs", "", "<details><summary>every job's command line</summary>", "", "```"]
    L += [r.get("command", "") for r in (runs or steps) + tta + acc if r.get("command")]
    L += ["```", "", "</details>", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def _repeats_section(runs):
    """Markdown: each repeat's step time per cell, and auto against the best fixed mode per repeat."""
    n = max(r["repeat"] for r in runs)
    L = ["## Repeats", "", f"Step ms of every run; the grid ran {n} times in turn.", ""]
    for ranks in sorted({r["ranks"] for r in runs}):
        for bw in [b for b in BANDWIDTHS if any(r["bandwidth"] == b and r["ranks"] == ranks for r in runs)]:
            rs = [r for r in runs if r["ranks"] == ranks and r["bandwidth"] == bw]
            L += [f"### {ranks} ranks, {bw}", "", "| mode | " + " | ".join(f"run {i}" for i in range(1, n + 1))
                  + " | median |", "|---|" + "---:|" * (n + 1)]
            for name in dict.fromkeys(_mode_name(r) for r in rs):
                times = {r["repeat"]: r["step_s"] for r in rs if _mode_name(r) == name and r["status"] == "ok"
                         and "step_s" in r}
                cells = [f"{times[i] * 1e3:,.1f}" if i in times else "failed" for i in range(1, n + 1)]
                median = f"{statistics.median(times.values()) * 1e3:,.1f}" if times else "-"
                L.append(f"| {name} | " + " | ".join(cells) + f" | {median} |")
            L.append("")
    auto = auto_vs_best(runs)
    if auto:
        L += ["Auto against the fastest fixed mode of the same repeat:", "",
              "| ranks | link | ratio | run | auto ms | best fixed | its ms | auto vs best | auto vs dense |",
              "|---:|---|---:|---:|---:|---|---:|---:|---:|"]
        for c in auto:
            L.append(f"| {c['ranks']} | {c['bandwidth']} | {c['ratio']:g} | {c['repeat']} | {c['auto_s'] * 1e3:,.1f} | "
                     f"{c['best']} | {c['best_s'] * 1e3:,.1f} | {100 * c['vs_best']:+.1f}% | "
                     + ("-" if c["vs_dense"] is None else f"{100 * c['vs_dense']:+.1f}%") + " |")
        L.append("")
    return L


# -- the driver -----------------------------------------------------------------------------------------
def preflight(euid=None, which=shutil.which):
    """What is missing to run the grid (root, ip, tc); empty when nothing is."""
    missing = []
    if (os.geteuid() if euid is None else euid) != 0:
        missing.append("root (network namespaces and tc need it)")
    for tool in ("ip", "tc"):
        if which(tool) is None:
            missing.append(f"'{tool}' (Debian package iproute2)")
    return missing


def tta_row(row, record, o):
    """Fill a tta row: final metric, time to the target; returns (row, curve points)."""
    row.update(_record_fields(record))
    metric = EXAMPLES[row["example"]].metric
    target = o.tta_target[row["example"]]
    reached = [c["wall_s"] for c in record["curve"] if c.get(metric) is not None
               and (c[metric] >= target if metric == "test_acc" else c[metric] <= target)]
    row.update(final_metric=record["curve"][-1][metric] if record["curve"] else None, target=target,
               time_to_target_s=reached[0] if reached else None)
    points = [{"run_id": row["run_id"], "label": row["label"], "bandwidth": row["bandwidth"], **c}
              for c in record["curve"]]
    return row, points


def add_vs_dense_accuracy(rows):
    """Accuracy difference (points, as a fraction) or relative loss difference against dense."""
    dense = {(r["example"], r["non_iid"]): r for r in rows if r["status"] == "ok" and r["label"] == "dense"}
    for r in rows:
        d = dense.get((r["example"], r["non_iid"]))
        if r["status"] != "ok" or d is None:
            continue
        if EXAMPLES[r["example"]].metric == "test_acc":
            r["vs_dense"] = r["test_accuracy"] - d["test_accuracy"]
        else:
            r["vs_dense"] = r["test_loss"] / d["test_loss"] - 1.0
    return rows


def build_outputs(o, results, cp, command):
    """CSV, PNG and report.md from the collected (row, record) pairs."""
    os.makedirs(o.out, exist_ok=True)
    cp_rate = {(r["ranks"], r["bandwidth"], r["cycle_ms"]): r["bytes_per_s_per_rank"] for r in cp
               if r["status"] == "ok"}
    steps, cycle, tta, curves, acc = [], [], [], [], []
    for row, record in results:
        if row["part"] in ("steps", "cycle"):
            (steps if row["part"] == "steps" else cycle).append(steps_row(row, record, o, cp_rate) if record else row)
        elif row["part"] == "tta":
            if record:
                row, points = tta_row(row, record, o)
                curves += points
            tta.append(row)
        else:
            if record:
                row.update(_record_fields(record))
            acc.append(row)
    add_relative(steps)
    runs = None
    if any(r.get("repeat") for r in steps):      # --repeats: the cells are the medians of the runs
        runs, steps = steps, median_rows(steps)
    add_relative(cycle)
    add_vs_dense_accuracy(acc)
    written = []
    for name, rows, cols in (("steps.csv", steps, STEPS_COLUMNS), ("steps_runs.csv", runs, STEPS_COLUMNS),
                             ("cycle.csv", cycle, STEPS_COLUMNS),
                             ("control_plane.csv", cp, CP_COLUMNS),
                             ("tta.csv", tta, TTA_COLUMNS), ("accuracy.csv", acc, ACC_COLUMNS)):
        if rows:
            write_csv(os.path.join(o.out, name), rows, cols)
            written.append(name)
    if curves:
        write_csv(os.path.join(o.out, "tta_curves.csv"), curves,
                  ["run_id", "label", "bandwidth", "step", "epoch", "wall_s", "test_loss", "test_acc"])
        written.append("tta_curves.csv")
    pngs = plot_all(o.out, steps, tta, curves)
    write_report(os.path.join(o.out, "report.md"), o, steps, cycle, cp, tta, acc, pngs, command, runs)
    return written + pngs + ["report.md"]


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
    p.add_argument("--burst", default="1mb", help="tbf burst (>= 1mb at MTU 9000)")
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
    raw = os.path.join(o.out, "raw")
    if o.report_only:                 # the settings and command of the run that wrote raw/
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
    os.makedirs(raw, exist_ok=True)
    with open(os.path.join(raw, "options.json"), "w") as f:
        json.dump({"command": command, **{k: getattr(o, k) for k in REPORT_OPTIONS}}, f)
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    results, cp, unsupported, status = [], [], {}, 0
    t_start = time.perf_counter()
    try:
        for ranks, bw, cycle_ms in probes:
            row = control_plane(ranks, bw, cycle_ms, o)
            cp.append(row)
            with open(os.path.join(raw, f"probe-n{ranks}-{bw}-c{cycle_ms}.json"), "w") as f:
                json.dump({"probe": row}, f)
            print(f"[control plane] {ranks} ranks, {bw}, cycle {cycle_ms} ms: "
                  f"{_fmt(row.get('bytes_per_s'))} B/s idle {row['error'][:200]}", flush=True)
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
