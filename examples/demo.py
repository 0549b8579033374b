"""The main job: digits CNN on 2 ranks (horovodrun, Gloo), dense Horovod vs. TopKEF at ratio 0.01.

Each run happens in a private network namespace, so the loopback counters measure exactly the bytes
the job puts on the link. Shows one progress line per few epochs, then one table: test accuracy,
bytes per rank per step, wall time; and what to run next.

    python examples/demo.py                 # as root: measured in a private network namespace
    python examples/demo.py --epochs 5 --ratio 0.001
"""
import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time

# Run as a script: put the repository root on sys.path for the bench/infra tooling (jobs, namespaces).
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.infra.launch import JobFailed, run_job  # noqa: E402
from bench.infra.wire import Namespace, can_make_namespace  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EPOCH_LINE = re.compile(r"^\[0\]<stdout>:(epoch (\d+)/(\d+): .*)$")   # digits_cnn.py's progress, rank 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--timeout", type=int, default=900)
    args = p.parse_args()

    isolated = can_make_namespace()
    if not isolated:
        print("note: not root, so no private network namespace; loopback bytes include other traffic")
    rows = []
    for mode in ("none", "topkef"):
        name = "dense Horovod" if mode == "none" else f"TopKEF ratio {args.ratio}"
        print(f"== {name}: horovodrun -np {args.np} --gloo python examples/digits_cnn.py "
              f"--compression {mode} --epochs {args.epochs}", flush=True)
        rows.append(run(mode, args, isolated))
    print_table(rows, args, isolated)


def run(mode, args, isolated):
    """One training job; prints every few epochs' progress line; returns the run's record."""
    every = max(1, args.epochs // 4)

    def show(line):
        m = EPOCH_LINE.match(line)
        if m and (int(m.group(2)) % every == 0 or m.group(2) == m.group(3) or m.group(2) == "1"):
            print("   " + m.group(1), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.join(HERE, "digits_cnn.py"), "--compression", mode,
                "--ratio", str(args.ratio), "--epochs", str(args.epochs), "--json-out", out_json]
        ns = Namespace() if isolated else contextlib.nullcontext()
        t0 = time.perf_counter()
        try:
            with ns:
                run_job(args.np, argv, timeout=args.timeout, prefix=ns.prefix if isolated else (), on_line=show)
        except JobFailed as e:
            sys.exit(f"demo: the {mode} job failed\n{e}")
        with open(out_json) as f:
            record = json.load(f)
    print(f"   done in {time.perf_counter() - t0:.0f} s (startup and evaluation included)", flush=True)
    return record


def print_table(rows, args, isolated):
    """The comparison, how to read it, and what to try next."""
    dense = rows[0]
    print()
    print(f"digits CNN ({dense['num_params']:,} parameters), {args.np} ranks, {dense['steps']} steps, "
          f"bytes measured on the {'private ' if isolated else ''}loopback")
    print(f"| {'mode':<22} | {'test acc':>8} | {'bytes/rank/step':>15} | {'vs dense':>8} | {'wall s':>7} | same params |")
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 17}|{'-' * 10}|{'-' * 9}|-------------|")
    for r in rows:
        name = "dense Horovod" if r["compression"] == "none" else f"TopKEF ratio {r['ratio']}"
        gain = dense["bytes_per_rank_per_step"] / r["bytes_per_rank_per_step"]
        print(f"| {name:<22} | {r['test_accuracy']:8.4f} | {r['bytes_per_rank_per_step']:15,.0f} | "
              f"{gain:7.1f}x | {r['wall_s']:7.2f} | {'yes' if r['params_identical'] else 'NO':>11} |")
    print()
    print("How to read it: bytes/rank/step is what the link carried, headers included, so 'vs dense' is\n"
          "the traffic saved at about the same accuracy. Wall time is not the point here: this loopback is\n"
          "unlimited and the model tiny, so selecting the top-k costs more than the bytes it saves; on a\n"
          "slow link the saved bytes are the step time. See that with the bandwidth-limited benchmark:")
    print('  python -m bench.evidence --part steps --ranks 2 --bandwidths 100mbit --ratios 0.01 \\\n'
          '      --modes "dense,topkef" --out /tmp/ev      # ~2 min; report in /tmp/ev/report.md')


if __name__ == "__main__":
    main()
