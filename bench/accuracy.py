"""Final accuracy (digits CNN) or test loss (byte-level LM): dense Horovod against hvd_topk's modes.

Seeds side by side, 2 ranks by default (``--np``; horovodrun, Gloo). Prints a markdown table of the
mean per config and, beside it, its difference from the dense config of the same optimizer when that
ran too (points of accuracy, or relative test loss); with --out, also writes it (table.md), every
run's figures (runs.json) and, for the LM, the test-loss curves (loss_curves.png), with manifest.json
(commit, command, date, machine).

    python -m bench.accuracy                     # digits: every config, seeds 0 1 2
    python -m bench.accuracy --seeds 0 --epochs 5
    python -m bench.accuracy --example lm --seeds 0 --out bench/results/lm   # the LM table (600 steps)
    python -m bench.accuracy --np 8 --configs "SGD dense" "SGD top-k 0.01, correction" \
        "SGD top-k 0.01, correction, allgather" "SGD top-k 0.01, correction, split_reduce"
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile

from testbed.batch import run_batch
from bench.manifest import write_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {
    "SGD dense": ["--compression", "none"],
    "SGD stock TopKEF 0.01, budget 2": ["--compression", "topkef", "--ratio", "0.01", "--budget", "2"],
    "SGD stock TopKEF 0.01, budget 4": ["--compression", "topkef", "--ratio", "0.01", "--budget", "4"],
    # 16 ranks at the 8-rank runs' global batch (8 per rank, so as many steps)
    "SGD dense, batch 8": ["--compression", "none", "--batch-size", "8"],
    "SGD stock TopKEF 0.01, batch 8": ["--compression", "topkef", "--ratio", "0.01", "--batch-size", "8"],
    "SGD top-k 0.01, no correction, artopk": ["--compression", "hvd_topk", "--communication", "artopk",
                                              "--ratio", "0.01", "--momentum-correction", "off"],
    "SGD top-k 0.01, correction": ["--compression", "hvd_topk", "--communication", "artopk", "--ratio", "0.01",
                                   "--momentum-correction", "on"],
    "SGD top-k 0.01, correction, allgather": ["--compression", "hvd_topk", "--ratio", "0.01", "--communication",
                                              "allgather", "--momentum-correction", "on"],
    "SGD top-k 0.01, correction, split_reduce": ["--compression", "hvd_topk", "--ratio", "0.01", "--communication",
                                                 "split_reduce", "--momentum-correction", "on"],
    # 8 ranks (--np 8): the same with DGC's warm-up, for every transport
    "SGD top-k 0.01, correction + warm-up": ["--compression", "hvd_topk", "--communication", "artopk", "--ratio",
                                             "0.01", "--warmup-epochs", "4", "--momentum-correction", "on"],
    "SGD top-k 0.01, correction + warm-up, allgather": ["--compression", "hvd_topk", "--communication", "allgather",
                                                        "--ratio", "0.01", "--warmup-epochs", "4",
                                                        "--momentum-correction", "on"],
    "SGD top-k 0.01, correction + warm-up, split_reduce": ["--compression", "hvd_topk", "--communication",
                                                           "split_reduce", "--ratio", "0.01", "--warmup-epochs", "4",
                                                           "--momentum-correction", "on"],
    # the stock path: hvd.DistributedOptimizer(compression=TopKEF(...)), each transport; and
    # hvd_topk.DistributedOptimizer with every argument but the ratio at its default
    "SGD stock TopKEF 0.01": ["--compression", "topkef", "--ratio", "0.01"],
    "SGD stock TopKEF 0.01, artopk": ["--compression", "topkef", "--ratio", "0.01", "--communication", "artopk"],
    "SGD stock TopKEF 0.01, allgather": ["--compression", "topkef", "--ratio", "0.01", "--communication",
                                         "allgather"],
    "SGD top-k 0.01, defaults": ["--compression", "hvd_topk", "--ratio", "0.01"],
    # communication='hierarchical' needs two hosts: run with --hosts 2
    "SGD top-k 0.01, hierarchical": ["--compression", "hvd_topk", "--ratio", "0.01", "--communication",
                                     "hierarchical"],
    "SGD stock TopKEF 0.01, hierarchical": ["--compression", "topkef", "--ratio", "0.01", "--communication",
                                            "hierarchical"],
    # non-IID (--non-iid: each rank sees 2 label shards): the same front doors at their defaults
    "SGD dense, non-IID": ["--compression", "none", "--non-iid"],
    "SGD stock TopKEF 0.01, non-IID": ["--compression", "topkef", "--ratio", "0.01", "--non-iid"],
    "SGD stock TopKEF 0.01, artopk, non-IID": ["--compression", "topkef", "--ratio", "0.01", "--communication",
                                               "artopk", "--non-iid"],
    "SGD stock TopKEF 0.01, allgather, non-IID": ["--compression", "topkef", "--ratio", "0.01", "--communication",
                                                  "allgather", "--non-iid"],
    "SGD top-k 0.01, defaults, non-IID": ["--compression", "hvd_topk", "--ratio", "0.01", "--non-iid"],
    "SGD top-k 0.01, correction, split_reduce, non-IID": ["--compression", "hvd_topk", "--ratio", "0.01",
                                                          "--momentum-correction", "on", "--non-iid"],
    # ablation: split_reduce's budget, momentum correction and warm-up under non-IID data
    "SGD stock TopKEF 0.01, budget 2, non-IID": ["--compression", "topkef", "--ratio", "0.01", "--budget", "2",
                                                 "--non-iid"],
    "SGD top-k 0.01, budget 2, non-IID": ["--compression", "hvd_topk", "--ratio", "0.01", "--budget", "2",
                                          "--non-iid"],
    "SGD top-k 0.01, no correction, non-IID": ["--compression", "hvd_topk", "--ratio", "0.01",
                                               "--momentum-correction", "off", "--non-iid"],
    "SGD top-k 0.01, no correction": ["--compression", "hvd_topk", "--ratio", "0.01", "--momentum-correction", "off"],
    "SGD top-k 0.01, warm-up": ["--compression", "hvd_topk", "--ratio", "0.01", "--warmup-epochs", "4"],
    "SGD top-k 0.01, warm-up, non-IID": ["--compression", "hvd_topk", "--ratio", "0.01", "--warmup-epochs", "4",
                                         "--non-iid"],
    "SGD top-k 0.001, no correction": ["--compression", "hvd_topk", "--communication", "artopk",
                                       "--ratio", "0.001", "--momentum-correction", "off"],
    "SGD top-k 0.001, correction + warm-up": ["--compression", "hvd_topk", "--communication", "artopk",
                                              "--ratio", "0.001", "--warmup-epochs", "4",
                                              "--momentum-correction", "on"],
    "SGD top-k 0.001, correction + warm-up, allgather": ["--compression", "hvd_topk", "--ratio", "0.001",
                                                         "--warmup-epochs", "4", "--communication", "allgather",
                                                         "--momentum-correction", "on"],
    "SGD top-k 0.001, correction + warm-up, split_reduce": ["--compression", "hvd_topk", "--ratio", "0.001",
                                                            "--warmup-epochs", "4", "--communication", "split_reduce",
                                                            "--momentum-correction", "on"],
    "SGD top-k 0.001, correction + warm-up, global selection": [
        "--compression", "hvd_topk", "--communication", "artopk",
        "--ratio", "0.001", "--warmup-epochs", "4", "--selection", "global", "--momentum-correction", "on"],
    "Adam dense": ["--compression", "none", "--optimizer", "adam", "--lr", "0.001"],
    "Adam top-k 0.01": ["--compression", "hvd_topk", "--communication", "artopk",
                        "--optimizer", "adam", "--lr", "0.001", "--ratio", "0.01"],
    "Adam top-k 0.01, update": ["--compression", "hvd_topk", "--communication", "artopk",
                                "--optimizer", "adam", "--lr", "0.001", "--ratio",
                                "0.01", "--compress", "update"],
    "Adam top-k 0.01, update, no local momentum": ["--compression", "hvd_topk", "--communication", "artopk",
                                                   "--optimizer", "adam", "--lr",
                                                   "0.001", "--ratio", "0.01", "--compress", "update",
                                                   "--local-momentum", "off"],
}
# The byte-level LM (examples/char_lm.py: AdamW, lr 2e-3, cosine schedule, clipping at 1.0).
LM_CONFIGS = {
    "AdamW dense": ["--compression", "none"],
    "AdamW top-k 0.01": ["--compression", "hvd_topk", "--communication", "artopk", "--ratio", "0.01"],
    "AdamW top-k 0.01, dense steps 100": ["--compression", "hvd_topk", "--communication", "artopk",
                                          "--ratio", "0.01", "--dense-steps", "100"],
    "AdamW top-k 0.01, dense steps 100, allgather": ["--compression", "hvd_topk", "--ratio", "0.01",
                                                     "--dense-steps", "100", "--communication", "allgather"],
    "AdamW top-k 0.01, split_reduce": ["--compression", "hvd_topk", "--ratio", "0.01", "--communication",
                                       "split_reduce"],
    "AdamW top-k 0.01, dense steps 100, split_reduce": ["--compression", "hvd_topk", "--ratio", "0.01",
                                                        "--dense-steps", "100", "--communication", "split_reduce"],
    "AdamW top-k 0.01, update, allgather": ["--compression", "hvd_topk", "--ratio", "0.01", "--compress", "update",
                                            "--communication", "allgather"],
    "AdamW top-k 0.01, update, dense steps 100": ["--compression", "hvd_topk", "--communication", "artopk",
                                                  "--ratio", "0.01", "--compress",
                                                  "update", "--dense-steps", "100"],
    "AdamW top-k 0.01, update, dense steps 100, allgather": [
        "--compression", "hvd_topk", "--ratio", "0.01", "--compress", "update", "--dense-steps", "100",
        "--communication", "allgather"],
    "AdamW top-k 0.1, update, dense steps 100, allgather": [
        "--compression", "hvd_topk", "--ratio", "0.1", "--compress", "update", "--dense-steps", "100",
        "--communication", "allgather"],
    # --local-momentum off: AdamW steps with beta1 = 0 once steps are compressed
    "AdamW top-k 0.01, update, no local momentum, allgather": [
        "--compression", "hvd_topk", "--ratio", "0.01", "--compress", "update", "--local-momentum", "off",
        "--communication", "allgather"],
    "AdamW top-k 0.01, update, no local momentum, dense steps 100, allgather": [
        "--compression", "hvd_topk", "--ratio", "0.01", "--compress", "update", "--local-momentum", "off",
        "--dense-steps", "100", "--communication", "allgather"],
    "AdamW top-k 0.01, update, no local momentum, dense steps 100": [
        "--compression", "hvd_topk", "--communication", "artopk",
        "--ratio", "0.01", "--compress", "update", "--local-momentum", "off",
        "--dense-steps", "100"],
    "AdamW top-k 0.01, update, no local momentum, split_reduce": [
        "--compression", "hvd_topk", "--ratio", "0.01", "--compress", "update", "--local-momentum", "off",
        "--communication", "split_reduce"],
    "AdamW stock TopKEF 0.01": ["--compression", "topkef", "--ratio", "0.01"],
    "AdamW stock TopKEF 0.01, artopk": ["--compression", "topkef", "--ratio", "0.01", "--communication", "artopk"],
    "AdamW dense, non-IID": ["--compression", "none", "--non-iid"],
    "AdamW top-k 0.01, update, no local momentum, allgather, non-IID": [
        "--compression", "hvd_topk", "--ratio", "0.01", "--compress", "update", "--local-momentum", "off",
        "--communication", "allgather", "--non-iid"],
}
# example -> (script, configs, the metric the table shows)
EXAMPLES = {"digits": ("digits_cnn.py", CONFIGS, "test_accuracy"),
            "lm": ("char_lm.py", LM_CONFIGS, "test_loss")}


def run_records(runs, args):
    """The JSON records of several runs, ``runs`` a list of (config, seed), made in one launch
    (testbed/batch.py: each run still starts from its own seed, as in a job of its own).

    ``args``: np, example, and epochs + min_numel (digits) or steps, plus lm_layers and lm_width (lm).
    """
    example = getattr(args, "example", "digits")
    script, configs, _ = EXAMPLES[example]
    if example == "digits":
        length = ["--epochs", str(args.epochs), "--min-numel", str(args.min_numel)]
    else:
        length = ["--steps", str(args.steps), "--n-layer", str(getattr(args, "lm_layers", 4)),
                  "--d-model", str(getattr(args, "lm_width", 128))]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{i}.json") for i in range(len(runs))]
        entries = [[os.path.join(ROOT, "examples", script), "--quiet", "--seed", str(seed), *length,
                    "--json-out", out, *configs[config]] for (config, seed), out in zip(runs, outs)]
        for failure in run_batch(args.np, entries, timeout_each=1800, cwd=ROOT, **host_launch(args)):
            if failure is not None:
                raise failure
        records = []
        for out in outs:
            with open(out) as f:
                records.append(json.load(f))
        return records


def host_launch(args):
    """run_job's arguments for ``--hosts``: with 2, Horovod sees two hosts of np/2 ranks each.

    Both names are this machine ("localhost" and "127.0.0.1" start locally, without ssh), but Horovod
    numbers local and cross ranks by the names, so communication='hierarchical' finds two hosts.
    Accuracy does not depend on the link, so this measures it without the emulated hosts; step times
    and inter-host bytes need those (bench/hierarchical.py).
    """
    hosts = getattr(args, "hosts", 1)
    if hosts == 1:
        return {}
    return {"hosts": f"localhost:{args.np // 2},127.0.0.1:{args.np // 2}", "interface": "lo",
            "env": {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}}


def dense_reference(config, configs):
    """The dense config ``config`` is compared with: same optimizer (first word), same data split
    ("non-IID" or not); None when that is not in ``configs`` or is ``config`` itself."""
    ref = config.split()[0] + " dense" + (", non-IID" if "non-IID" in config else "")
    return ref if ref in configs and ref != config else None


def vs_dense(metric, ours, dense):
    """Text of ``ours`` against ``dense``: points of accuracy, or relative test loss."""
    if metric == "test_accuracy":
        return f"{100 * (ours - dense):+.2f} pt"
    return f"{100 * (ours / dense - 1):+.2f}%"


def plot_curves(records, path):
    """Test loss against step, one line per config (seed 0's run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for config, runs in records.items():
        pts = [(c["step"], c["test_loss"]) for c in runs[0]["curve"]]
        ax.plot(*zip(*pts), marker=".", label=config)
    ax.set_xlabel("step")
    ax.set_ylabel("test loss (nats/byte)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--example", choices=list(EXAMPLES), default="digits")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (digits), 0 (lm)")
    p.add_argument("--epochs", type=int, default=20, help="digits")
    p.add_argument("--min-numel", type=int, default=2048, help="digits: smaller tensors (the classifier) go dense")
    p.add_argument("--steps", type=int, default=600, help="lm")
    p.add_argument("--lm-layers", type=int, default=4, help="lm: transformer blocks")
    p.add_argument("--lm-width", type=int, default=128, help="lm: model width (d_model)")
    p.add_argument("--hosts", type=int, choices=[1, 2], default=1,
                   help="2: Horovod sees two hosts of np/2 ranks on this machine (for communication='hierarchical')")
    p.add_argument("--configs", nargs="+", default=None, help="default: every config of the example")
    p.add_argument("--out", default=None, help="folder for table.md, runs.json (and loss_curves.png for lm)")
    args = p.parse_args()
    _, configs, metric = EXAMPLES[args.example]
    args.configs = args.configs or list(configs)
    bad = [c for c in args.configs if c not in configs]
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {list(configs)}")
    if args.hosts == 2 and args.np % 2:
        p.error(f"--hosts 2 needs an even --np, got {args.np}")
    if args.seeds is None:
        args.seeds = [0, 1, 2] if args.example == "digits" else [0]
    records, table = {}, {}
    for config in args.configs:
        records[config] = run_records([(config, seed) for seed in args.seeds], args)
        table[config] = [r[metric] for r in records[config]]
        print(f"{config}: {' '.join(f'{a:.4f}' for a in table[config])}", flush=True)
    setup = (f"{args.np} ranks, {args.epochs} epochs, min_numel {args.min_numel}" if args.example == "digits"
             else f"{args.np} ranks, {args.steps} steps, {args.lm_layers}x{args.lm_width} model") + \
        (f", {args.hosts} hosts" if args.hosts > 1 else "") + f", seeds {args.seeds}"
    lines = [setup, "", f"| config | mean {metric.replace('_', ' ')} | vs dense | per seed |", "|---|---:|---:|---|"]
    for c, v in table.items():
        ref = dense_reference(c, table)
        diff = vs_dense(metric, statistics.mean(v), statistics.mean(table[ref])) if ref else ""
        lines.append(f"| {c} | {statistics.mean(v):.4f} | {diff} | {' '.join(f'{a:.4f}' for a in v)} |")
    print("\n" + "\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        command = shlex.join(["python", "-m", "bench.accuracy", *sys.argv[1:]])
        write_manifest(args.out, command)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write("\n".join([f"`{command}`", ""] + lines) + "\n")
        with open(os.path.join(args.out, "runs.json"), "w") as f:
            json.dump({c: [{k: r.get(k) for k in ("test_loss", "test_accuracy", "curve", "wall_s", "ranks",
                                                   "communication", "bytes_per_rank_per_step", "params_identical",
                                                   "hvd_topk_stats")} for r in rs]
                       for c, rs in records.items()}, f, indent=1)
        if args.example == "lm":
            plot_curves(records, os.path.join(args.out, "loss_curves.png"))


if __name__ == "__main__":
    main()
