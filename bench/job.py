"""Running one job of the grid: a fresh network namespace, the example under horovodrun, its record.

Also the control-plane probe (an idle job's bytes per second) and the preflight check (root, ip, tc).
"""
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from bench.constants import BANDWIDTHS, MODES, ROOT

class Interrupted(BaseException):
    """SIGTERM: unwind like Ctrl-C so that every job is killed and every namespace deleted."""


def on_sigterm(signum, frame):
    """SIGTERM handler: raise ``Interrupted``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)     # a second one must not cut the clean-up short
    raise Interrupted(f"signal {signum}")


_NAMESPACES = itertools.count()


def namespace(rate, burst):
    """A fresh namespace named after this process (``hvdtopk-ev<pid>-<n>``), so leftovers are traceable."""
    from testbed.wire import Namespace
    return Namespace(rate=rate, burst=burst, name=f"hvdtopk-ev{os.getpid()}-{next(_NAMESPACES)}")


def job_env(cycle_ms):
    """Environment of a job: the same Horovod settings for every mode, dense included."""
    return {"HOROVOD_CYCLE_TIME": str(cycle_ms)}


def execute(run, o, unsupported):
    """Run one job in a fresh namespace; returns its row (status ok / failed / skipped) and record.

    ``unsupported`` maps a mode label to the reason it was skipped; a job failing with a ValueError
    (or an argparse error) that names one of its mode's options adds its label there."""
    from testbed.launch import JobFailed, run_job

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
            reason = unsupported_reason(e.output, MODES[run.label])
            if reason:
                unsupported[run.label] = f"unsupported option: {reason}"
                row.update(status="skipped", error=unsupported[run.label])
            else:
                row.update(status="failed", error=tail_line(str(e)))
            return row, None
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            row.update(status="failed", error=tail_line(f"{type(e).__name__}: {e}"))
            return row, None
        finally:
            row["job_s"] = round(time.perf_counter() - t0, 1)
    return row, record


def relative(command):
    """A recorded command with this checkout's absolute path taken out (run from the repository root)."""
    return command.replace(ROOT + os.sep, "")


def recorded_command(env, prefix, ranks, argv):
    """The command line of a job as a report records it: environment, namespace prefix, launcher."""
    from testbed.launch import launch_command

    return relative(shlex.join([*(f"{k}={v}" for k, v in env.items()), *prefix, *launch_command(ranks, argv)]))


def unsupported_reason(output, mode_args):
    """The ValueError / argparse error line of a job's output if it names one of the mode's options."""
    words = {a.lstrip("-") for a in mode_args} - {"compression", "none", "fp16", "topkef", "hvd_topk"}
    for line in output.splitlines():
        text = re.sub(r"^\[\d+\]<std\w+>:", "", line).strip()
        if (text.startswith("ValueError:") or "invalid choice" in text or "unrecognized arguments" in text) \
                and any(w and w in text for w in words):
            return text[:300]
    return None


def tail_line(text, n=1500):
    """The last ``n`` characters on one line (CSV-friendly)."""
    return " | ".join(line for line in text[-n:].splitlines() if line.strip())


def control_plane(ranks, bandwidth, cycle_ms, o):
    """Loopback bytes per second of a job whose ranks sit idle between two barriers (Horovod's
    background loop coordinating every HOROVOD_CYCLE_TIME with a small allreduce), all ranks together."""
    from testbed.launch import run_job

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
            row.update(status="failed", error=tail_line(str(e)))
    return row


def idle_worker(seconds, out, ops=30):
    """The probe job's rank body: the ranks sit idle between two barriers (the control plane's rate),
    then run ``ops`` one-element allreduces and then broadcasts, one at a time (the fixed bytes of one
    small collective: its messages' headers, Gloo's notifications, its cycle; the idle rate over the
    same time is subtracted). Rank 0 writes ``out``."""
    import horovod.torch as hvd
    import torch

    from testbed.wire import loopback_bytes

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



def preflight(euid=None, which=shutil.which):
    """What is missing to run the grid (root, ip, tc); empty when nothing is."""
    missing = []
    if (os.geteuid() if euid is None else euid) != 0:
        missing.append("root (network namespaces and tc need it)")
    for tool in ("ip", "tc"):
        if which(tool) is None:
            missing.append(f"'{tool}' (Debian package iproute2)")
    return missing

