"""Digits CNN accuracy: dense Horovod against hvd_topk (with and without momentum correction), seeds
side by side, 2 ranks (horovodrun, Gloo). Prints a markdown table of mean test accuracy per config.

    python -m bench.accuracy                     # the full table (27 runs)
    python -m bench.accuracy --seeds 0 --epochs 5
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

from hvd_topk.launch import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {
    "SGD dense": ["--compression", "none"],
    "SGD top-k 0.01, no correction": ["--compression", "hvd_topk", "--ratio", "0.01", "--momentum-correction", "off"],
    "SGD top-k 0.01, correction": ["--compression", "hvd_topk", "--ratio", "0.01"],
    "SGD top-k 0.001, no correction": ["--compression", "hvd_topk", "--ratio", "0.001", "--momentum-correction", "off"],
    "SGD top-k 0.001, correction + warm-up": ["--compression", "hvd_topk", "--ratio", "0.001", "--warmup-epochs", "4"],
    "SGD top-k 0.001, correction + warm-up, allgather": ["--compression", "hvd_topk", "--ratio", "0.001",
                                                         "--warmup-epochs", "4", "--communication", "allgather"],
    "SGD top-k 0.001, correction + warm-up, global selection": [
        "--compression", "hvd_topk", "--ratio", "0.001", "--warmup-epochs", "4", "--selection", "global"],
    "Adam dense": ["--compression", "none", "--optimizer", "adam", "--lr", "0.001"],
    "Adam top-k 0.01": ["--compression", "hvd_topk", "--optimizer", "adam", "--lr", "0.001", "--ratio", "0.01"],
}


def run(config, seed, args):
    """Test accuracy of one digits run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        argv = [sys.executable, os.path.join(ROOT, "examples", "digits_cnn.py"), "--quiet", "--seed", str(seed),
                "--epochs", str(args.epochs), "--min-numel", str(args.min_numel), "--json-out", out,
                *CONFIGS[config]]
        run_job(args.np, argv, timeout=900, cwd=ROOT)
        with open(out) as f:
            return json.load(f)["test_accuracy"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--min-numel", type=int, default=2048, help="smaller tensors (the classifier) go dense")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    table = {}
    for config in args.configs:
        accs = [run(config, seed, args) for seed in args.seeds]
        table[config] = accs
        print(f"{config}: {' '.join(f'{a:.4f}' for a in accs)}", flush=True)
    print(f"\n{args.np} ranks, {args.epochs} epochs, min_numel {args.min_numel}, seeds {args.seeds}")
    print("| config | mean test acc | per seed |\n|---|---:|---|")
    for config, accs in table.items():
        print(f"| {config} | {statistics.mean(accs):.4f} | {' '.join(f'{a:.4f}' for a in accs)} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
