"""The main job: digits CNN on 2 ranks (horovodrun, Gloo), dense Horovod vs. TopKEF at ratio 0.01.

Each run happens in a private network namespace, so the loopback counters measure exactly the bytes
the job puts on the link. Shows one progress line per few epochs, then one table: test accuracy,
bytes per rank per step, wall time; and what to run next.

    python -m bench demo                    # as root: measured in a private network namespace
    python -m bench demo --epochs 5 --ratio 0.001
    python -m bench demo --across-hosts     # as root: 2 emulated hosts (scripts/hosts.sh), bytes on eth0

bash scripts/demo.sh runs it after installing what is missing.
"""
import contextlib
import json
import os
import re
import sys
import tempfile
import time

from testbed.hosts import EmulatedHosts
from testbed.launch import JobFailed, run_job
from testbed.wire import Namespace, can_make_namespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCH_LINE = re.compile(r"^\[0\]<stdout>:(epoch (\d+)/(\d+): .*)$")   # digits_cnn.py's progress, rank 0


def main(args):
    """The CLI's ``demo`` (``args``: np, ratio, epochs, timeout, across_hosts, rate); returns 0."""
    hosts = EmulatedHosts(2, args.rate) if args.across_hosts else None
    isolated = hosts is not None or can_make_namespace()
    if not isolated:
        print("note: not root, so no private network namespace; loopback bytes include other traffic")
    try:
        if hosts is not None:
            hosts.up()
            print(f"hosts: node1 ({hosts.hosts[0].addr}) and node2 ({hosts.hosts[1].addr}), "
                  f"{args.np // 2} rank(s) each, eth0 {args.rate or 'unlimited'}", flush=True)
        rows = []
        for mode in ("none", "topkef"):
            name = "dense Horovod" if mode == "none" else f"TopKEF ratio {args.ratio}"
            where = (f"-H {hosts.host_list(args.np // 2)} --network-interface eth0" if hosts
                     else f"-H localhost:{args.np}")
            print(f"== {name}: horovodrun -np {args.np} {where} --gloo python examples/digits_cnn.py "
                  f"--compression {mode} --epochs {args.epochs}", flush=True)
            rows.append(run(mode, args, isolated, hosts))
    finally:
        if hosts is not None:
            hosts.close()
    print_table(rows, args, isolated, hosts)
    return 0


def run(mode, args, isolated, hosts=None):
    """One training job; prints every few epochs' progress line; returns the run's record."""
    every = max(1, args.epochs // 4)

    def show(line):
        m = EPOCH_LINE.match(line)
        if m and (int(m.group(2)) % every == 0 or m.group(2) == m.group(3) or m.group(2) == "1"):
            print("   " + m.group(1), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.join(ROOT, "examples", "digits_cnn.py"), "--compression", mode,
                "--ratio", str(args.ratio), "--epochs", str(args.epochs), "--json-out", out_json]
        t0 = time.perf_counter()
        try:
            if hosts is not None:
                sent = sum(h.eth0_bytes()[0] for h in hosts.hosts)
                try:
                    run_job(args.np, argv, timeout=args.timeout, prefix=hosts.hosts[0].prefix, on_line=show,
                            hosts=hosts.host_list(args.np // 2), interface="eth0")
                finally:
                    hosts.kill_strays()
                sent = sum(h.eth0_bytes()[0] for h in hosts.hosts) - sent
            else:
                ns = Namespace() if isolated else contextlib.nullcontext()
                with ns:
                    run_job(args.np, argv, timeout=args.timeout, prefix=ns.prefix if isolated else (),
                            on_line=show)
        except JobFailed as e:
            sys.exit(f"demo: the {mode} job failed\n{e}")
        with open(out_json) as f:
            record = json.load(f)
        if hosts is not None:
            # Every byte between the hosts is sent by one host's eth0: the sum of their tx is the
            # inter-host traffic (the job's loopback counters see none of it).
            record["inter_host_bytes"] = sent
            record["bytes_per_rank_per_step"] = sent / args.np / max(1, record["steps"])
    print(f"   done in {time.perf_counter() - t0:.0f} s (startup and evaluation included)", flush=True)
    return record


def print_table(rows, args, isolated, hosts=None):
    """The comparison, how to read it, and what to try next."""
    dense = rows[0]
    print()
    where = ("the hosts' eth0 (all traffic between them: gradients, Horovod's negotiation, ssh)" if hosts
             else f"the {'private ' if isolated else ''}loopback")
    print(f"digits CNN ({dense['num_params']:,} parameters), {args.np} ranks, {dense['steps']} steps, "
          f"bytes measured on {where}")
    if hosts is not None:
        for r in rows:
            name = "dense Horovod" if r["compression"] == "none" else f"TopKEF ratio {r['ratio']}"
            print(f"  {name}: {r['inter_host_bytes']:,} bytes between the hosts")
    print(f"| {'mode':<22} | {'test acc':>8} | {'bytes/rank/step':>15} | {'vs dense':>8} | {'wall s':>7} | same params |")
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 17}|{'-' * 10}|{'-' * 9}|-------------|")
    for r in rows:
        name = "dense Horovod" if r["compression"] == "none" else f"TopKEF ratio {r['ratio']}"
        gain = dense["bytes_per_rank_per_step"] / r["bytes_per_rank_per_step"]
        print(f"| {name:<22} | {r['test_accuracy']:8.4f} | {r['bytes_per_rank_per_step']:15,.0f} | "
              f"{gain:7.1f}x | {r['wall_s']:7.2f} | {'yes' if r['params_identical'] else 'NO':>11} |")
    print()
    link = "this loopback is unlimited"
    if hosts is not None:
        link = f"the hosts' eth0 are {'limited to ' + args.rate if args.rate else 'unlimited'}"
    print("How to read it: bytes/rank/step is what the link carried, headers included, so 'vs dense' is\n"
          f"the traffic saved at about the same accuracy. Wall time is not the point here: {link}\n"
          "and the model tiny, so selecting the top-k costs more than the bytes it saves; on a slow link\n"
          "the saved bytes are the step time. See that with the bandwidth-limited benchmark:")
    print('  python -m bench run --task cnn-wide --link 100mbit --arms "horovod dense,topkef" --steps 30 \\\n'
          '      --eval-every 10 --out bench/results/run_try      # ~3 min; then read its table.md')
