"""The evidence grid's plan: which jobs to run (examples, modes, ratios, links, ranks), how long each runs,
and an estimate of the whole grid's time. Pure planning: nothing is launched here."""
import os
import re
import sys
from dataclasses import dataclass

from bench.constants import (AUTO_MODE, BANDWIDTHS, MODES, ON_REQUEST_MODES, RATE_BYTES_PER_S, ROOT,
                             SPARSE_COMPRESSIONS, auto_warmup_steps)
from bench.linkbytes import scheme_of, theoretical_bytes

RATIOS = (0.1, 0.01, 0.001)


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
            modes=",".join(m for m in MODES if m not in ON_REQUEST_MODES),
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


def mode_warmup(label):
    """Warm-up steps (at least) a mode needs before its steps are representative: auto's probe and trial."""
    return auto_warmup_steps() if label == AUTO_MODE else 0


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
        warmup = max(o.warmup, mode_warmup(label))
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

