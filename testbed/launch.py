"""Launch real multi-rank jobs (horovodrun with Gloo, or mpirun) with a hard timeout.

Used by the demo, the benchmarks and the tests: a failed or hung rank ends the whole job (its process
group is killed) instead of hanging the caller.
"""
import os
import shutil
import signal
import subprocess
import sys
import threading

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["launch_command", "run_job", "JobFailed"]

# mpirun across hosts starts its daemon on each other host through ssh before any rank runs. On a loaded
# 2-core machine (emulated hosts, the full test suite) that start failed in 1 of 3 full runs one day
# and in none of 8 runs of the same tests alone. Nothing has run then, so run_job launches once more.
ORTE_START_FAILED = "ORTE was unable to reliably start one or more daemons"


class JobFailed(RuntimeError):
    """A launched job exited non-zero or ran past its timeout; carries its output. The message shows the
    output's tail and, where the tail starts later, the first traceback: when one rank's error ends the
    job, the other ranks' errors that follow it can fill the tail and hide the cause."""

    def __init__(self, message, output=""):
        first = output.find("Traceback (most recent call last)")
        first = output.rfind("\n", 0, first) + 1 if first >= 0 else -1     # from its line's start: the rank
        cause = f"--- job output, first traceback ---\n{output[first:first + 3000]}\n" \
            if 0 <= first < len(output) - 6000 else ""
        super().__init__(f"{message}\n{cause}--- job output (tail) ---\n{output[-6000:]}")
        self.output = output


def _tool(name):
    """Path of a launcher next to this interpreter (the venv) or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else (shutil.which(name) or name)


def launch_command(np, argv, backend="gloo", hosts=None, interface=None, export=(), shared_memory=False):
    """Command line that starts ``np`` ranks of ``argv`` (a list, e.g. [python, script, ...]).

    Args:
        np: number of ranks, >= 1.
        argv: the per-rank command.
        backend: ``"gloo"`` (horovodrun --gloo) or ``"mpi"`` (mpirun over TCP, no shared memory, so
            that traffic crosses the network).
        hosts: None: every rank on this machine, over the loopback. Otherwise the host list,
            ``"addr:slots,addr:slots"`` or a list of ``"addr:slots"``: ranks are placed in order (the
            first host's slots first) and started on the other hosts through ssh.
        interface: the network interface the ranks talk over (``lo`` without ``hosts``), e.g. the
            hosts' ``eth0``; None with ``hosts``: the launcher's own choice.
        export: names of environment variables the ranks on other hosts must get too (mpirun passes
            only those it is told to; horovodrun passes its whole environment).
        shared_memory: ``"mpi"`` only: ranks on the same host talk through Open MPI's shared-memory
            BTL (vader) instead of TCP, as on a real multi-rank host; between hosts it is still TCP
            on ``interface``.
    """
    if shared_memory and backend != "mpi":
        raise ValueError("shared_memory is an Open MPI setting: backend must be 'mpi'")
    if hosts is None:
        host_list, interface = f"localhost:{np}", interface or "lo"
    else:
        host_list = hosts if isinstance(hosts, str) else ",".join(hosts)
    if backend == "gloo":
        nic = ["--network-interface", interface] if interface else []
        return [_tool("horovodrun"), "-np", str(np), "-H", host_list, "--gloo", *nic, *argv]
    if backend == "mpi":
        nic = (["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface]
               if interface else [])
        btl = ["--mca", "btl", "tcp,self"]
        if shared_memory:
            # ob1 named so that the btl list is certain to be what carries the bytes. No single-copy
            # mechanism (CMA needs ptrace rights a container may not grant): copies through the shared
            # segment.
            btl = ["--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp",
                   "--mca", "btl_vader_single_copy_mechanism", "none"]
        # Yield when idle, whatever the rank count: each rank has two busy threads (the training loop and
        # Horovod's background loop), and Open MPI yields by itself only when the ranks outnumber the
        # cores, so 2 ranks on 2 cores spun in the progress loop and took the core from the thread they
        # waited for: a 2-rank, 150-step MLP job took 11.9 s instead of 8.1 s, and a 6.3M-float
        # reduce-scatter between emulated hosts (4 ranks on 2 cores, which Open MPI cannot see) 2-14 s
        # instead of 0.25-1.3 s.
        cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none", *btl,
               "--mca", "mpi_yield_when_idle", "1", *nic, "-x", "PATH", "-x", "PYTHONPATH"]
        if hosts is not None:
            # Ranks on the other hosts get only what -x names (ssh starts their daemons with a clean
            # environment); on this host they inherit the launcher's.
            forwarded = dict.fromkeys(["OMP_NUM_THREADS", "PYTHONUNBUFFERED", *export])
            cmd = [*cmd[:3], "-H", host_list, *cmd[3:], *(a for name in forwarded for a in ("-x", name))]
        return [*cmd, *argv]
    raise ValueError(f"backend must be 'gloo' or 'mpi', got {backend!r}")


def run_job(np, argv, backend="gloo", timeout=300, prefix=(), env=None, cwd=None, stream=False, on_line=None,
            hosts=None, interface=None, shared_memory=False):
    """Run a multi-rank job to completion; return its combined output, or raise JobFailed.

    Args:
        np, argv, backend, hosts, interface, shared_memory: as for ``launch_command``.
        timeout: seconds; past it every process of the job is killed and JobFailed raised.
        prefix: command prefix, e.g. ``Namespace.prefix`` to run inside a network namespace, or
            ``Host.prefix`` (testbed/hosts.py) to launch from an emulated host. A timeout kills the
            processes on this machine's side; ranks on other hosts end with their ssh sessions (or are
            ended by ``EmulatedHosts.kill_strays``).
        env: extra environment variables (every rank gets them, on every host).
        stream: also copy the job's output to this process's stdout as it comes (progress bars).
        on_line: called with each complete line of the job's output as it comes (without the newline),
            e.g. to show a filtered progress.

    An mpirun across ``hosts`` whose daemon on another host never started (``ORTE_START_FAILED``,
    before any rank ran) is launched once more; any other failure, or a second such start, raises.
    """
    full_env = _outside_any_mpi_job(dict(os.environ))
    # Running as root (containers, CI): OpenMPI refuses unless told it is deliberate.
    full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # The ranks import this checkout's packages: a worker's own folder is its sys.path[0], and the venv's
    # editable install names whichever checkout ran scripts/install.sh last (a second clone sharing the venv).
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    full_env.update(env or {})
    cmd = [*prefix, *launch_command(np, argv, backend, hosts=hosts, interface=interface,
                                    export=tuple(env or ()), shared_memory=shared_memory)]
    try:
        return _run_once(cmd, full_env, timeout, cwd, stream, on_line)
    except JobFailed as failed:
        if backend != "mpi" or hosts is None or ORTE_START_FAILED not in failed.output:
            raise
        print(f"mpirun's daemon on another host did not start; launching again:\n{failed.output[-1500:]}")
    return _run_once(cmd, full_env, timeout, cwd, stream, on_line)


def _outside_any_mpi_job(env):
    """``env`` less an enclosing MPI job's variables, where it holds them: a process started by mpirun,
    or a child of one that called ``hvd.init()`` without a launcher (an MPI singleton, since Horovod is
    built with MPI), has PMIx's and Open MPI's variables, and an mpirun started under them takes itself
    for part of that job and exits 1 without a word. A new job is not part of it, so every ``PMIX_``,
    ``ORTE_`` and ``OMPI_`` variable goes, Open MPI settings a user exported included (``env=`` passes
    them on); ``run_job`` sets ``OMPI_ALLOW_RUN_AS_ROOT`` again."""
    if "PMIX_NAMESPACE" not in env and "OMPI_MCA_ess" not in env:
        return env
    return {k: v for k, v in env.items() if not k.startswith(("PMIX_", "ORTE_", "OMPI_"))}


def _run_once(cmd, full_env, timeout, cwd, stream, on_line):
    """One launch of ``cmd`` (see ``run_job``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, cwd=cwd, start_new_session=True)
    expired = threading.Event()

    def expire():
        expired.set()
        _kill_tree(proc)

    timer = threading.Timer(timeout, expire)
    timer.start()
    chunks, pending = [], b""
    try:
        for chunk in iter(lambda: os.read(proc.stdout.fileno(), 65536), b""):
            chunks.append(chunk)
            if stream:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if on_line is not None:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    on_line(line.decode(errors="replace").rstrip("\r"))
        proc.wait()
    finally:
        timer.cancel()
        _kill_tree(proc)   # ranks a dead launcher left behind
        proc.stdout.close()
    out = b"".join(chunks).decode(errors="replace")
    if expired.is_set():
        raise JobFailed(f"job timed out after {timeout}s: {' '.join(cmd)}", out)
    if proc.returncode != 0:
        raise JobFailed(f"job exited with {proc.returncode}: {' '.join(cmd)}", out)
    return out


def _kill_tree(proc):
    """SIGKILL the launcher and every descendant (launchers start ranks in sessions of their own)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
