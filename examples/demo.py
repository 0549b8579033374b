"""The main job: digits CNN on 2 ranks (horovodrun, Gloo), dense Horovod vs. TopKEF at ratio 0.01.

Each run happens in a private network namespace, so the loopback counters measure exactly the bytes
the job puts on the link. Prints one table: test accuracy, bytes per rank per step, wall time.

    python examples/demo.py                 # as root: measured in a private network namespace
    python examples/demo.py --epochs 5 --ratio 0.001
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile

# Run as a script: put the repository root on sys.path for the bench/infra tooling (jobs, namespaces).
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.infra.launch import run_job  # noqa: E402
from bench.infra.wire import Namespace, can_make_namespace  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


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
        with tempfile.TemporaryDirectory() as tmp:
            out_json = os.path.join(tmp, "result.json")
            argv = [sys.executable, os.path.join(HERE, "digits_cnn.py"), "--compression", mode,
                    "--ratio", str(args.ratio), "--epochs", str(args.epochs), "--json-out", out_json]
            ns = Namespace() if isolated else contextlib.nullcontext()
            with ns:
                print(f"== {'dense Horovod' if mode == 'none' else f'TopKEF ratio {args.ratio}'}: "
                      f"horovodrun -np {args.np} --gloo", flush=True)
                run_job(args.np, argv, timeout=args.timeout,
                        prefix=ns.prefix if isolated else (), stream=True)
            with open(out_json) as f:
                rows.append(json.load(f))

    dense = rows[0]
    print()
    print(f"digits CNN ({dense['num_params']} parameters), {args.np} ranks, {dense['steps']} steps, "
          f"bytes measured on the {'private ' if isolated else ''}loopback")
    print(f"| {'mode':<22} | {'test acc':>8} | {'bytes/rank/step':>15} | {'vs dense':>8} | {'wall s':>7} | same params |")
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 17}|{'-' * 10}|{'-' * 9}|-------------|")
    for r in rows:
        name = "dense Horovod" if r["compression"] == "none" else f"TopKEF ratio {r['ratio']}"
        gain = dense["bytes_per_rank_per_step"] / r["bytes_per_rank_per_step"]
        print(f"| {name:<22} | {r['test_accuracy']:8.4f} | {r['bytes_per_rank_per_step']:15,.0f} | "
              f"{gain:7.1f}x | {r['wall_s']:7.2f} | {str(r['params_identical']):>11} |")


if __name__ == "__main__":
    main()
