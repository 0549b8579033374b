"""The Slurm templates, the sweep helper and the Docker image definition, tested for real.

A private single-node Slurm cluster (Debian's slurm-wlm + munge, installed by
scripts/install_slurm.sh) runs for this module: its own slurm.conf, ports, state directories and munge
key under a temporary directory; slurmctld, slurmd and munged are started here and stopped at the end.
Jobs go through slurm/train_cpu.sbatch exactly as a user submits them (srun --mpi=pmix, Horovod over
MPI; the requeued one with HVD_TOPK_LAUNCHER=mpirun). The Docker image cannot be built here (no Docker
engine): its Dockerfile is linted (hadolint, shellcheck) and parsed for consistency with
scripts/install.sh.
"""
import csv
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("hvd_topk_sweep", os.path.join(ROOT, "slurm", "sweep.py"))
sweep = importlib.util.module_from_spec(_spec)     # slurm/sweep.py is a script, not part of the package
_spec.loader.exec_module(sweep)

DIGITS = "examples/digits_cnn.py"
JOB_TIMEOUT = 240          # seconds for one digits job (2 ranks, 3 epochs: about 60 s here)
CACHE = os.environ.get("HVD_TOPK_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvd_topk")
HADOLINT = os.path.join(CACHE, "tools", "bin", "hadolint")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: installs Debian's slurm-wlm and "
                                "munge with apt-get and runs slurmd, which starts jobs as root")


# -- the cluster ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def slurm_tools():
    """scripts/install_slurm.sh has run: Slurm, munge, shellcheck and hadolint are installed."""
    if os.geteuid() != 0:
        pytest.skip("needs root: scripts/install_slurm.sh installs Debian packages")
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_slurm.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"install_slurm.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


class Cluster:
    """A running private Slurm: command helpers with its SLURM_CONF, and its logs for diagnostics.

    ``prefix`` runs the client commands elsewhere, e.g. on an emulated host (tests/test_multihost.py);
    ``daemon_logs`` are the logs (relative to ``base``) whose tails failure messages show."""

    def __init__(self, base, prefix=(), daemon_logs=("log/slurmctld.log", "log/slurmd.log")):
        self.base = base
        self.prefix = list(prefix)
        self.daemon_logs = list(daemon_logs)
        self.conf = os.path.join(base, "slurm.conf")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env["SLURM_CONF"] = self.conf
        self.procs = []
        self.files = []

    def run(self, *cmd, check=True, timeout=30):
        """Run a Slurm client command against this cluster; returns stdout."""
        proc = subprocess.run([*self.prefix, *cmd], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}\n{self.logs()}")
        return proc.stdout

    def sbatch(self, *args, env=None):
        """Submit from the repository root (as a user does); returns the job id."""
        full = dict(self.env, **(env or {}))
        proc = subprocess.run([*self.prefix, "sbatch", "--parsable", *args], env=full, capture_output=True, text=True,
                              timeout=30, cwd=ROOT)
        assert proc.returncode == 0, f"sbatch {' '.join(args)} failed: {proc.stderr}\n{self.logs()}"
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id):
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for(self, what, check, timeout, poll=1.0):
        """Poll ``check()`` until it returns something truthy; fail (with logs) after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(poll)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def wait_done(self, job_id, out, timeout=JOB_TIMEOUT):
        """Wait for a job to leave the queue for good; returns its final ``job()`` record."""
        final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")

        def finished():
            info = self.job(job_id)
            return info if info["JobState"] in final else None
        return self.wait_for(f"job {job_id} to finish (output: {out})", finished, timeout)

    def logs(self, job_out=None):
        """Tails of the daemons' logs (and a job's output) for failure messages."""
        parts = []
        for name in ([job_out] if job_out else []) + self.daemon_logs:
            path = name if os.path.isabs(name) else os.path.join(self.base, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    parts.append(f"--- {path} (tail) ---\n" + "".join(f.readlines()[-40:]))
        return "\n".join(parts)

    def start(self, name, *cmd):
        """Start a daemon (in the foreground, output in ``log/<name>.out``) that ``stop()`` ends."""
        log = open(os.path.join(self.base, "log", f"{name}.out"), "w")
        self.files.append(log)
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def start_munge(self):
        """munged with a fresh key in ``munge/``, on the socket that slurm.conf names; waits for it."""
        munge = os.path.join(self.base, "munge")
        os.makedirs(munge)
        os.chmod(munge, 0o755)                           # munged: its socket dir must be reachable
        key = os.path.join(munge, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        self.start("munged", "munged", "--foreground", "--force", f"--key-file={key}",
                   f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                   f"--seed-file={munge}/munged.seed", f"--log-file={self.base}/log/munged.log")
        self.wait_for("munged's socket", lambda: os.path.exists(f"{munge}/munge.socket"), 30, 0.2)

    def stop(self):
        """Cancel every job, then stop slurmd, slurmctld and munged (SIGTERM, then SIGKILL after 5 s).

        Why only 5 s: the daemons end within milliseconds, but slurmctld sometimes never ends on SIGTERM
        (its log: "Saving all slurm state", "_write_msg: read/write op failed"; its one thread left waits
        on a condition variable), and this cluster's state is thrown away anyway."""
        if os.path.exists(self.conf):
            subprocess.run([*self.prefix, "scancel", "--full", "--user", "root"], env=self.env, capture_output=True,
                           timeout=30)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for f in self.files:
            f.close()


def _free_ports(n):
    """n distinct TCP ports that are free now (bound to port 0, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# slurm.conf of every private test cluster: {header} names the cluster, its controller and slurmd's
# files, {nodes} the nodes and the partition (this module: one node; tests/test_multihost.py: one per
# emulated host).
SLURM_CONF = """\
{header}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge/munge.socket
StateSaveLocation={base}/state
SlurmctldPidFile={base}/slurmctld.pid
SlurmctldLogFile={base}/log/slurmctld.log
# No cgroups in containers and CI: track processes by parent, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
JobRequeue=1
KillWait=10
# A requeued job held until a start time becomes eligible without an event, so only the main
# scheduling loop starts it: every 60 s unset, and the requeue tests waited 30-35 s for it.
SchedulerParameters=sched_interval=1
InactiveLimit=0
MinJobAge=3600
# The nodes are declared with the CPUs the tests need, whatever the machine has.
SlurmdParameters=config_overrides
{nodes}
"""


@pytest.fixture(scope="module")
def cluster(slurm_tools, tmp_path_factory):
    """Start munged, slurmctld and slurmd on private ports and files; stop them after the module."""
    base = str(tmp_path_factory.mktemp("slurm"))
    for sub in ("state", "spool", "log", "jobs"):
        os.makedirs(os.path.join(base, sub))
    node = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = _free_ports(2)
    c = Cluster(base)
    header = (f"ClusterName=hvdtopktest\nSlurmctldHost={node}(127.0.0.1)\nSlurmctldPort={ctld_port}\n"
              f"SlurmdPort={slurmd_port}\nSlurmdSpoolDir={base}/spool\n"
              f"SlurmdPidFile={base}/slurmd.pid\nSlurmdLogFile={base}/log/slurmd.log")
    nodes = (f"NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN\n"      # the tests need exactly 2 slots
             f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP")
    with open(c.conf, "w") as f:
        f.write(SLURM_CONF.format(header=header, base=base, nodes=nodes))
    try:
        c.start_munge()
        c.start("slurmctld", "slurmctld", "-D", "-i", "-f", c.conf)
        c.start("slurmd", "slurmd", "-D", "-N", node, "-f", c.conf)
        c.wait_for("the node to be idle", lambda: c.run("sinfo", "-h", "-o", "%T", check=False).strip()
                   == "idle", 60)
        yield c
    finally:
        c.stop()


# -- jobs -------------------------------------------------------------------------------------------

def _read(path):
    """A file's text, or '' while it does not exist yet."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _result(text):
    """The JSON line the digits example prints on rank 0 (the last one, after a requeue)."""
    lines = [line for line in text.splitlines() if line.startswith("{") and "test_accuracy" in line]
    assert lines, f"no result line in the job output:\n{text[-4000:]}"
    return json.loads(lines[-1])


def _load_rank(path, rank, size=2):
    """One rank's checkpoint file as written by hvd_topk.save_checkpoint."""
    import torch
    return torch.load(f"{path}.rank{rank}-of-{size}", map_location="cpu", weights_only=False)


def _digits_job(cluster, name, compression="topkef", env=None, nodes=1, tasks_per_node=2):
    """Submit the digits example (2 ranks, 3 epochs) through slurm/train_cpu.sbatch; (job id, paths)."""
    jobs = os.path.join(cluster.base, "jobs")
    out, ckpt = os.path.join(jobs, f"{name}.out"), os.path.join(jobs, f"{name}.pt")
    args = [f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}", "--time=00:10:00", f"--output={out}",
            "slurm/train_cpu.sbatch", DIGITS, "--compression", compression, "--epochs", "3",
            "--quiet", "--checkpoint", ckpt]
    return cluster.sbatch(*args, env=env), out, ckpt


def _interrupt_and_requeue(cluster, job_id, out):
    """Mid-run USR1 to the batch shell; wait for the requeue, release it, wait for the end."""
    # Mid-run: the first end-of-epoch checkpoint is written (2 epochs still to go).
    cluster.wait_for("the first checkpoint", lambda: "(end of epoch)" in _read(out), JOB_TIMEOUT)
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)

    # The ranks checkpoint at the next step and exit 85; the batch script requeues the job. Slurm then
    # holds a requeued job for about two minutes (its BeginTime); release it at once for the test.
    def requeued():
        info = cluster.job(job_id)
        return info["Restarts"] == "1" and info["JobState"] == "PENDING"
    cluster.wait_for("the requeue", requeued, 120)
    # Not StartTime=now: slurmd revokes the old run's credential with a one-second timestamp, and a new
    # start within that same second is refused ("Job credential revoked") and the job fails. A start
    # 3 s later is always in a later second, as Slurm's own two-minute hold is.
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
    info = cluster.wait_done(job_id, out)
    text = _read(out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{cluster.logs(out)}"
    assert info["Restarts"] == "1", info
    saved = re.search(r"checkpoint: saved \S+ \(\d+ ranks\) at epoch (\d+) step (\d+) \(signal SIGUSR1\)", text)
    assert saved, f"no checkpoint on SIGUSR1:\n{text}"
    assert "job_step: step exited with status 85" in text and "requeueing job" in text, text
    resumed = re.search(r"checkpoint: resumed from \S+ at epoch (\d+) step (\d+)", text)
    assert resumed and resumed.groups() == saved.groups(), text
    epoch, step = map(int, saved.groups())
    assert (1, 0) <= (epoch, step) and epoch < 3, "the signal must land mid-run"
    assert text.index(saved.group(0)) < text.index("restart 1") < text.index(resumed.group(0))
    result = _result(text)
    assert result["resumed_from"] == {"epoch": epoch, "step": step}, result
    assert result["params_identical"] is True and result["test_accuracy"] >= 0.6, result
    return result


@pytest.fixture(scope="module")
def uninterrupted(cluster):
    """The reference job: digits + TopKEF on 2 ranks, 3 epochs, never interrupted."""
    job_id, out, ckpt = _digits_job(cluster, "uninterrupted")
    info = cluster.wait_done(job_id, out)
    return job_id, info, out, ckpt


@pytest.mark.slow
@pytest.mark.multirank
@needs_root
def test_cpu_job_topkef_completes_with_accuracy(cluster, uninterrupted):
    """sbatch slurm/train_cpu.sbatch examples/digits_cnn.py --compression topkef: 2 ranks, completes."""
    job_id, info, out, ckpt = uninterrupted
    text = _read(out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{cluster.logs(out)}"
    assert "srun --mpi=pmix" in text                   # the launcher the template documents
    result = _result(text)
    assert result["ranks"] == 2 and result["compression"] == "topkef"
    assert result["test_accuracy"] >= 0.6, result      # 10 classes: chance is 0.1; ~0.8 after 3 epochs
    assert result["params_identical"] is True
    assert result["resumed_from"] is None and info["Restarts"] == "0"
    for rank in range(2):                              # one checkpoint per rank, at the end of epoch 3
        state = _load_rank(ckpt, rank)
        assert (state["rank"], state["world_size"], state["extra"]["epoch"]) == (rank, 2, 3)
        assert state["extra"]["compressor"]["residuals"], "TopKEF residuals missing from the checkpoint"


# One requeue per launcher: srun's (Slurm forwards USR1 to each task) in tests/test_multihost.py's
# two-node job, Open MPI's mpirun inside the allocation here, compared with the srun job above. (A
# second requeued job of its own, srun on one node, ran until 2026-11-30: 24 s of the suite.)
@pytest.mark.slow
@pytest.mark.multirank
@needs_root
def test_usr1_checkpoints_requeues_and_resumes_exactly(cluster, uninterrupted):
    """HVD_TOPK_LAUNCHER=mpirun (Open MPI inside the allocation) and scancel --signal=USR1 --batch
    mid-run: mpirun forwards USR1 and passes on exit 85; per-rank checkpoints, requeue, resume, and the
    same end state as the uninterrupted srun job."""
    job_id, out, ckpt = _digits_job(cluster, "requeued", env={"HVD_TOPK_LAUNCHER": "mpirun"})
    result = _interrupt_and_requeue(cluster, job_id, out)
    assert "mpirun -np 2" in _read(out)

    # Resuming restored everything (model, momentum, every rank's TopKEF residuals and pending index
    # sets, the position in the epoch): the end state equals the uninterrupted run's, bit for bit.
    import torch
    ref_result = _result(_read(uninterrupted[2]))
    assert result["test_accuracy"] == ref_result["test_accuracy"]
    for rank in range(2):
        a, b = _load_rank(ckpt, rank), _load_rank(uninterrupted[3], rank)
        assert a["extra"]["epoch"] == b["extra"]["epoch"] == 3
        for name in b["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), f"rank {rank}: {name} differs"
        res_a, res_b = a["extra"]["compressor"]["residuals"], b["extra"]["compressor"]["residuals"]
        torch.testing.assert_close(res_a, res_b, rtol=0, atol=0)
        torch.testing.assert_close(a["optimizer"]["state"], b["optimizer"]["state"], rtol=0, atol=0)


def _rank_alive(pid, marker):
    """Whether ``pid`` still runs a rank whose command line holds ``marker`` (zombies are dead)."""
    import psutil
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and marker in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


@pytest.mark.slow
@pytest.mark.multirank
@needs_root
def test_sigkilled_rank_ends_the_job_step(cluster, record_property):
    """srun --mpi=pmix through slurm/train_cpu.sbatch, 2 ranks: rank 1 SIGKILLs itself between backward
    and step() (tests/workers/faults.py); the step exits non-zero, the job fails without a requeue,
    and rank 0, inside the step's collectives, is gone within 60 s of the kill."""
    jobs = os.path.join(cluster.base, "jobs")
    out, data = os.path.join(jobs, "sigkill.out"), os.path.join(jobs, "sigkill")
    os.makedirs(data)
    job_id = cluster.sbatch("--nodes=1", "--ntasks-per-node=2", "--time=00:05:00", f"--output={out}",
                            "slurm/train_cpu.sbatch", "tests/workers/faults.py", "--out", data, "--steps", "200",
                            "--kill-rank", "1", "--kill-step", "5", env={"PYTHON": sys.executable})
    killed_at = os.path.join(data, "killed_at")
    cluster.wait_for("rank 1 to kill itself", lambda: _read(killed_at), JOB_TIMEOUT, poll=0.2)
    killed = float(_read(killed_at))
    pids = [int(_read(os.path.join(data, f"pid{r}"))) for r in range(2)]
    while any(_rank_alive(pid, data) for pid in pids) and time.time() < killed + 90:
        time.sleep(0.1)
    gone_s = time.time() - killed
    info = cluster.wait_done(job_id, out, timeout=120)
    print(f"\nsrun: last rank gone {gone_s:.1f} s after the SIGKILL")
    record_property("last_rank_gone_s", round(gone_s, 2))
    text = _read(out)
    assert not any(_rank_alive(pid, data) for pid in pids), f"a rank outlived the kill\n{text}"
    assert gone_s <= 60, f"rank 0 ran {gone_s:.0f} s after rank 1 died\n{text}"
    step_rc = re.search(r"job_step: step exited with status (\d+)", text)
    assert step_rc and step_rc.group(1) != "0", f"{info}\n{cluster.logs(out)}"
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", f"{info}\n{cluster.logs(out)}"
    assert not any(os.path.exists(os.path.join(data, f"rank{r}.pt")) for r in range(2))


@pytest.mark.slow
@pytest.mark.multirank
@needs_root
def test_sweep_submits_an_array_and_collects_a_table(cluster, tmp_path):
    """slurm/sweep.py: a 2-point grid as a job array (1 rank per task), then results.csv/.md."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, os.path.join(ROOT, "slurm", "sweep.py"), "submit", "--out", str(out),
           "--grid", "compression=none,topkef", "--grid", "ratio=0.05",
           "--sbatch=--ntasks-per-node=1", "--sbatch=--time=00:10:00",
           "--wait", "--timeout", str(JOB_TIMEOUT), "--", DIGITS, "--epochs", "1", "--quiet"]
    proc = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=JOB_TIMEOUT + 60,
                          cwd=ROOT)
    logs = "\n".join(_read(p) for p in sorted(str(q) for q in (out / "logs").glob("*.out")))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}\n{cluster.logs()}"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["task"], r["compression"], r["ratio"], r["status"]) for r in rows] == \
        [("0", "none", "0.05", "ok"), ("1", "topkef", "0.05", "ok")]
    for task, row in enumerate(rows):                  # each task really ran with its grid point
        result = json.loads((out / "results" / f"{task}.json").read_text())
        assert result["compression"] == row["compression"] and result["ranks"] == 1
        assert float(row["test_accuracy"]) == pytest.approx(result["test_accuracy"], rel=1e-3)
        assert result["test_accuracy"] >= 0.5
    table = (out / "results.md").read_text().splitlines()
    assert table[0].startswith("| task | compression | ratio | status | test_accuracy") and len(table) == 4
    array_id = json.loads((out / "sweep.json").read_text())["job_id"]
    assert array_id and "submitted job array" in proc.stdout


# -- the sweep helper without Slurm ----------------------------------------------------------------

def test_sweep_grid_expansion_and_task_args():
    """Grid specs become one array task per combination, each with its own result and checkpoint."""
    grid = sweep.parse_grid(["compression=topkef,hvd_topk", "--ratio=0.01, 0.001"])
    assert grid == [("compression", ["topkef", "hvd_topk"]), ("ratio", ["0.01", "0.001"])]
    points = sweep.expand(grid)
    assert len(points) == 4 and points[1] == {"compression": "topkef", "ratio": "0.001"}
    assert sweep.task_args(points[3], "/o", 3) == [
        "--compression", "hvd_topk", "--ratio", "0.001", "--json-out", "/o/results/3.json",
        "--checkpoint", "/o/ckpt/3.pt"]
    assert sweep.task_args(points[0], "/o", 0, result_arg="", checkpoint_arg="")[-1] == "0.01"


@pytest.mark.parametrize("specs, message", [
    ([], "at least one"), (["ratio"], "key=v1,v2"), (["=1,2"], "key=v1,v2"), (["ratio=0.1,"], "non-empty"),
    (["ratio=1", "ratio=2"], "twice"), (["bad key=1"], "key=v1,v2")])
def test_sweep_rejects_bad_grids(specs, message):
    """Malformed --grid values raise ValueError naming the problem."""
    with pytest.raises(ValueError, match=message):
        sweep.parse_grid(specs)


def test_sweep_collect_marks_missing_results(tmp_path):
    """collect() writes the CSV and markdown tables and reports tasks without a result."""
    (tmp_path / "results").mkdir()
    (tmp_path / "logs").mkdir()
    grid = [("ratio", ["0.1", "0.01"])]
    (tmp_path / "sweep.json").write_text(json.dumps({"grid": grid, "points": sweep.expand(grid)}))
    (tmp_path / "results" / "0.json").write_text(json.dumps({"test_accuracy": 0.91234, "wall_s": 3.0}))
    (tmp_path / "logs" / "1.out").write_text("step\nsrun: error: task 1: Exited with exit code 1\n")
    rows = sweep.collect(str(tmp_path))
    assert [r["status"] for r in rows] == ["ok", "missing"]
    assert "exit code 1" in rows[1]["note"]
    md = (tmp_path / "results.md").read_text()
    assert "| 0 | 0.1 | ok | 0.9123 |" in md and "| 1 | 0.01 | missing |" in md


# -- static checks: shell scripts and the Docker image ---------------------------------------------

SHELL_FILES = ["slurm/train_cpu.sbatch", "slurm/train_gpu.sbatch", "slurm/job_step.sh",
               "scripts/install_slurm.sh", "scripts/hosts.sh", "docker/entrypoint.sh"]


@needs_root
def test_shell_scripts_pass_shellcheck(slurm_tools):
    """shellcheck (following the sourced slurm/job_step.sh) finds nothing in the scripts."""
    proc = subprocess.run(["shellcheck", "-x", *SHELL_FILES], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for path in SHELL_FILES:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        assert "set -euo pipefail" in text or path.endswith("job_step.sh"), path


@needs_root
def test_dockerfile_passes_hadolint(slurm_tools):
    """hadolint (with its built-in shellcheck of every RUN) accepts docker/Dockerfile."""
    proc = subprocess.run([HADOLINT, "docker/Dockerfile"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _dockerfile():
    """docker/Dockerfile as (instruction, argument text) pairs, continuation lines joined."""
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as f:
        lines = [line.rstrip("\n") for line in f if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [tuple(line.strip().split(None, 1)) for line in text.splitlines() if line.strip()]


def test_dockerfile_build_args_are_consistent():
    """Every build ARG is declared before use and used; FROM is a CUDA devel image."""
    instructions = _dockerfile()
    first_from = next(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    global_args = {a.split("=")[0] for op, a in instructions[:first_from] if op == "ARG"}
    stage_args = {a.split("=")[0]: a.split("=", 1)[1].strip('"') for op, a in instructions[first_from:]
                  if op == "ARG"}
    assert instructions[first_from][1] == "${CUDA_IMAGE}" and global_args == {"CUDA_IMAGE"}
    default_image = dict(a.split("=", 1) for op, a in instructions[:first_from] if op == "ARG")["CUDA_IMAGE"]
    assert re.match(r"nvidia/cuda:\d+\.\d+(\.\d+)?-(cudnn-)?devel-ubuntu\d+\.\d+$", default_image)
    envs = set()
    used = set()
    for op, arg in instructions[first_from + 1:]:
        refs = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", arg))
        if op == "ENV":
            envs |= {m for m in re.findall(r"(?:^|\s)([A-Z_][A-Z0-9_]*)=", arg)}
        unknown = refs - set(stage_args) - envs - {"PATH", "PIP_EXTRA_INDEX_URL"}
        assert not unknown, f"{op} {arg[:60]}... uses undeclared {unknown}"
        used |= refs
    assert set(stage_args) <= used, f"declared but unused ARGs: {set(stage_args) - used}"
    assert stage_args["PYTHON_VERSION"] == "3.11"


def test_dockerfile_builds_with_the_projects_install_script():
    """The image runs scripts/install.sh with NCCL and knobs that install.sh really reads."""
    instructions = _dockerfile()
    runs = [a for op, a in instructions if op == "RUN" and "scripts/install.sh" in a]
    assert len(runs) == 1, "exactly one RUN must call scripts/install.sh"
    run = runs[0]
    words = shlex.split(run.replace("&&", " && "))
    call = words.index("scripts/install.sh")
    assert words[call - 1] == "bash"
    start = max(i for i, w in enumerate(words[:call]) if w == "&&") + 1
    knobs = dict(w.split("=", 1) for w in words[start:call - 1])
    assert knobs["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert knobs["HVD_TOPK_TORCH_VERSION"] == "${TORCH_VERSION}"
    assert knobs["PYTHON"] == "python${PYTHON_VERSION}"
    with open(os.path.join(ROOT, "scripts", "install.sh")) as f:
        install = f.read()
    # Knobs meant for install.sh must be ones it reads; the rest go to Horovod's own build (setup.py,
    # CMake), which install.sh runs in the same environment.
    for knob in knobs:
        if knob.startswith(("HVD_TOPK_", "PYTHON")) or knob == "HOROVOD_GPU_OPERATIONS":
            assert re.search(r"\$\{?" + knob + r"\b", install), f"install.sh does not read {knob}"
        else:
            assert knob.startswith("HOROVOD_"), knob
    assert "set(CMAKE_CXX_STANDARD 17)" in install          # the C++17 fix the image relies on
    # Defaults agree with install.sh's: torch pin and interpreter.
    args = {a.split("=")[0]: a.split("=", 1)[1].strip('"') for op, a in instructions if op == "ARG" and "=" in a}
    assert f"HVD_TOPK_TORCH_VERSION:-{args['TORCH_VERSION']}}}" in install
    assert f"PYTHON:-python{args['PYTHON_VERSION']}}}" in install
    # The venv install.sh creates is the one on PATH and the one the checks use.
    env = " ".join(a for op, a in instructions if op == "ENV")
    venv = re.search(r"HVD_TOPK_VENV=(\S+)", env).group(1)
    assert f"PATH={venv}/bin:" in env and f"{venv}/bin/python" in run
    assert "hvd.nccl_built()" in run and "torch.version.cuda" in run
    # The stub libcuda is on the loader path for the build only.
    assert run.index("ldconfig /usr/local/cuda/lib64/stubs") < run.index("scripts/install.sh")
    assert run.rstrip().endswith("ldconfig")


def test_dockerfile_copies_what_it_needs():
    """COPY sources exist, pass the .dockerignore, and come before the install; the entrypoint too."""
    instructions = _dockerfile()
    with open(os.path.join(ROOT, "docker", "Dockerfile.dockerignore")) as f:
        allowed = [line.strip()[1:].rstrip("/") for line in f if line.strip().startswith("!")]
    copied, install_at = [], None
    for i, (op, arg) in enumerate(instructions):
        if op == "COPY":
            parts = [p for p in arg.split() if not p.startswith("--")]
            for src in parts[:-1]:
                assert os.path.exists(os.path.join(ROOT, src)), f"COPY {src}: no such file"
                assert src.rstrip("/") in allowed, f"COPY {src}: excluded by Dockerfile.dockerignore"
                copied.append((i, src.rstrip("/")))
        if op == "RUN" and "scripts/install.sh" in arg:
            install_at = i
    for needed in ("scripts", "setup.py", "hvd_topk", "README.md"):   # install.sh: pip install -e .
        assert any(src == needed and i < install_at for i, src in copied), f"{needed} not copied before install"
    workdir = next(a for op, a in instructions if op == "WORKDIR")
    entry = json.loads(dict(instructions)["ENTRYPOINT"])
    assert entry[0].startswith(workdir + "/")
    rel = os.path.relpath(entry[0], workdir)
    assert rel in {src for _, src in copied} and os.access(os.path.join(ROOT, rel), os.X_OK)
    assert json.loads(dict(instructions)["CMD"]) == ["horovodrun", "--check-build"]


def test_entrypoint_runs_the_given_command():
    """docker/entrypoint.sh execs its arguments (root-friendly Open MPI settings exported)."""
    script = os.path.join(ROOT, "docker", "entrypoint.sh")
    proc = subprocess.run(["bash", script, "bash", "-c", "echo $OMPI_ALLOW_RUN_AS_ROOT; exit 7"],
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout.strip()) == (7, "1")
