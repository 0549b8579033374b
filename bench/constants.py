"""What every benchmark shares: the links, Horovod's cycle time, the example's mode table, auto's warm-up.

One place, so that the evidence grid, the side-by-side job, the adaptive-ratio runs and the step-time
benchmark cannot drift apart on what "1gbit" or "hvd_topk artopk" means.
"""
import inspect
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

# Link name -> tbf rate (None: no qdisc, the loopback's own speed), and the same in bytes per second.
BANDWIDTHS = {"100mbit": "100mbit", "1gbit": "1gbit", "unlimited": None}
RATE_BYTES_PER_S = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8, "unlimited": None}
# tbf burst: 1mb is the smallest that passes MTU-9000 frames here.
TBF_BURST = "1mb"
# HOROVOD_CYCLE_TIME (ms) of every job, dense included: a longer cycle than Horovod's 1 ms default shrinks
# the control plane's bytes, and every mode gets the same (docs/benchmarks.md).
CYCLE_TIME_MS = "20"

# Mode label -> the example's arguments (examples/digits_cnn.py, examples/char_lm.py). Modes whose
# --compression is topkef or hvd_topk are Top-K modes and run at every ratio of a grid.
MODES = {
    "dense": ["--compression", "none"],
    "fp16": ["--compression", "fp16"],
    "topkef": ["--compression", "topkef"],                 # TopKEF's default transport (split_reduce)
    "topkef artopk": ["--compression", "topkef", "--communication", "artopk"],
    "topkef allgather": ["--compression", "topkef", "--communication", "allgather"],
    "hvd_topk allgather": ["--compression", "hvd_topk", "--communication", "allgather"],
    "hvd_topk artopk": ["--compression", "hvd_topk", "--communication", "artopk"],
    "hvd_topk auto": ["--compression", "hvd_topk", "--communication", "auto"],
    # Horovod's groups=1: all gradients in one grouped collective per kind (not in the default grid)
    "topkef grouped": ["--compression", "topkef", "--groups", "1"],
    "hvd_topk artopk grouped": ["--compression", "hvd_topk", "--communication", "artopk", "--groups", "1"],
    "hvd_topk allgather grouped": ["--compression", "hvd_topk", "--communication", "allgather", "--groups", "1"],
    "hvd_topk allgather fp16": ["--compression", "hvd_topk", "--communication", "allgather", "--value-dtype",
                                "float16"],
    # Ok-Topk's split-and-reduce: rows to their index region's owner (alltoall), reduced and selected there
    "hvd_topk split_reduce": ["--compression", "hvd_topk", "--communication", "split_reduce"],
    "hvd_topk split_reduce fp16": ["--compression", "hvd_topk", "--communication", "split_reduce",
                                   "--value-dtype", "float16"],
}
# Modes run only when named (--modes): not in the full grid's default, to keep its length.
ON_REQUEST_MODES = ("topkef grouped", "hvd_topk artopk grouped", "hvd_topk allgather grouped",
                    "hvd_topk split_reduce fp16", "topkef artopk", "topkef allgather")
SPARSE_COMPRESSIONS = ("topkef", "hvd_topk")
AUTO_MODE = "hvd_topk auto"
# The transports auto chooses from, each fixed: auto's target is the fastest of them (of those that ran).
FIXED_TRANSPORT_MODES = ("dense", "hvd_topk allgather", "hvd_topk artopk", "hvd_topk split_reduce")


def auto_warmup_steps():
    """Steps before auto's step times are representative, from AutoTuner's own defaults.

    auto probes the link after its first step (2 steps), then its plans take turns of ``trial_steps``
    steps: the model's plan and at most one uniform plan per transport (``hvd_topk.auto.plans.TRANSPORTS``:
    all dense, all artopk, ...), for ``trial_rounds`` counted rounds after one uncounted round. A
    longer trial is skipped as well, from the run's own decision history
    (``bench.linkbytes.settled_step``).
    """
    from hvd_topk.auto import AutoTuner
    from hvd_topk.auto.plans import TRANSPORTS

    defaults = inspect.signature(AutoTuner).parameters
    plans = 1 + len(TRANSPORTS)
    probe_steps = 2
    trial_steps, trial_rounds = defaults["trial_steps"].default, defaults["trial_rounds"].default
    return probe_steps + plans * trial_steps * (trial_rounds + 1)
