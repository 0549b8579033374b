"""Elastic Horovod on one machine (``tests/workers/elastic_train.py``): horovodrun --gloo with --min-np 1
--max-np 3 and a host discovery script whose hosts file the test edits while the job trains.

- grow and shrink: 2 slots, then 3 once training is under way, then 2 again;
- a killed worker: 3 workers on two host names (Horovod blacklists the failed host, so the survivors
  need another name for theirs), one SIGKILLed between two commits; the others restore the last commit
  and finish on 2.

Both must finish without a hang, with parameters identical on every rank at every step (records of
the same step and world size), for ``hvd_topk.DistributedOptimizer`` and for stock Horovod, each with
TopKEF and with PowerSGD: each job trains the four side by side in one elastic state (the worker's
docstring says why).
"""
import collections
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from testbed.launch import launch_command
from conftest import ROOT, WORKERS

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

JOB_TIMEOUT = 240
DOORS = ("hvd_topk", "topkef", "hvd_topk_powersgd", "powersgd")   # the worker's copies: door x compressor


def run_elastic(tmp_path, hosts, np, args, on_progress=lambda step, size: None):
    """Run the elastic job; ``on_progress(step, size)`` may rewrite the hosts (returned by it). Returns
    {(step, size, door): {digest, ...}} and the sizes seen, in order."""
    out = tmp_path / "out"
    out.mkdir()
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    horovodrun = launch_command(np, [])[0]
    cmd = [horovodrun, "-np", str(np), "--min-np", "1", "--max-np", "3", "--host-discovery-script", str(discover),
           "--network-interface", "lo", sys.executable, os.path.join(WORKERS, "elastic_train.py"),
           "--out", str(out), *map(str, args)]
    # A survivor waiting on the killed worker through another rank learns of it from Gloo's timeout (30 s
    # unset), not from a reset connection: 10 s here, where every collective takes milliseconds.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HOROVOD_GLOO_TIMEOUT_SECONDS="10")
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"elastic job hung:\n{(tmp_path / 'job.log').read_text()[-4000:]}"
            progress = (out / "progress").read_text().split() if (out / "progress").exists() else []
            if len(progress) == 2:
                new_hosts = on_progress(int(progress[0]), int(progress[1]))
                if new_hosts:
                    hosts_file.write_text(new_hosts)
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert proc.returncode == 0, f"elastic job failed:\n{(tmp_path / 'job.log').read_text()[-4000:]}"
    digests, sizes = collections.defaultdict(set), []
    for path in glob.glob(str(out / "log.*.jsonl")):
        for line in open(path):
            record = json.loads(line)
            for door, digest in record["digest"].items():
                digests[(record["step"], record["size"], door)].add(digest)
    for step, size, _ in sorted(digests):
        if not sizes or sizes[-1] != size:
            sizes.append(size)
    return digests, sizes


def test_grow_and_shrink_keeps_ranks_identical(tmp_path):
    phases = iter([(8, 2, "localhost:3\n"), (20, 3, "localhost:2\n")])
    wanted = [next(phases)]

    def on_progress(step, size):
        if wanted and step >= wanted[0][0] and size == wanted[0][1]:
            hosts = wanted.pop()[2]
            wanted.extend(phases)
            return hosts
        return None

    digests, sizes = run_elastic(tmp_path, "localhost:2\n", 2, ["--steps", 40], on_progress)
    assert sizes == [2, 3, 2], sizes
    assert {door for _, _, door in digests} == set(DOORS)
    assert all(max(step for step, _, d in digests if d == door) == 40 for door in DOORS)
    differ = {key: d for key, d in digests.items() if len(d) > 1}
    assert not differ, f"ranks differ at (step, size, door): {sorted(differ)}"


def test_worker_killed_between_commits_the_others_finish_identical(tmp_path):
    digests, sizes = run_elastic(tmp_path, "localhost:2\n127.0.0.1:1\n", 3,
                                 ["--steps", 30, "--commit-every", 5, "--kill-host", "127.0.0.1", "--kill-step", 12])
    # steps 1-12 on 3 ranks; the kill after step 12 rolls back to the commit after step 10, and steps
    # 11-30 run on the 2 survivors; for each door
    on_three = {(step, 3, door) for step in range(1, 13) for door in DOORS}
    on_two = {(step, 2, door) for step in range(11, 31) for door in DOORS}
    assert {key for key in digests if key[1] == 3} == on_three, sorted(digests)
    assert {key for key in digests if key[1] == 2} == on_two, sorted(digests)
    differ = {key: d for key, d in digests.items() if len(d) > 1}
    assert not differ, f"ranks differ at (step, size, door): {sorted(differ)}"


def test_the_elastic_example_trains(tmp_path):
    """examples/elastic_digits.py, as its docstring launches it, on a fixed host list."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    cmd = [launch_command(2, [])[0], "-np", "2", "--min-np", "1", "--max-np", "3", "--host-discovery-script",
           str(discover), "--network-interface", "lo", sys.executable, "examples/elastic_digits.py", "--epochs", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "epoch 2/2: 2 ranks, test acc" in proc.stdout
