"""testbed/launch.py's command lines, which checkout a job's ranks import, and what a failed job shows."""
import os
import subprocess
import sys

import pytest

from testbed.launch import ROOT, JobFailed, launch_command, run_job

HOSTS = "10.77.0.1:2,10.77.0.2:2"


def _mca(cmd):
    return {cmd[i + 1]: cmd[i + 2] for i, a in enumerate(cmd) if a == "--mca"}


def test_mpi_is_tcp_only_unless_shared_memory_is_asked():
    plain = _mca(launch_command(4, ["python", "w.py"], "mpi", hosts=HOSTS, interface="eth0"))
    assert plain["btl"] == "tcp,self"
    shm = _mca(launch_command(4, ["python", "w.py"], "mpi", hosts=HOSTS, interface="eth0", shared_memory=True))
    assert shm["pml"] == "ob1" and shm["btl"] == "self,vader,tcp"
    # between the hosts still TCP on the interface asked for, so eth0 counts the inter-host bytes
    assert shm["btl_tcp_if_include"] == shm["oob_tcp_if_include"] == "eth0"


def test_every_mpi_launch_yields_when_idle():
    """2 ranks on 2 cores are not oversubscribed to Open MPI, which then spins by default (testbed/launch.py)."""
    for kwargs in ({}, {"hosts": HOSTS, "interface": "eth0"}, {"hosts": HOSTS, "shared_memory": True}):
        assert _mca(launch_command(2, ["python", "w.py"], "mpi", **kwargs))["mpi_yield_when_idle"] == "1", kwargs


def test_shared_memory_is_mpi_only():
    with pytest.raises(ValueError, match="mpi"):
        launch_command(2, ["python", "w.py"], "gloo", shared_memory=True)


def test_a_failed_job_shows_its_first_traceback_when_the_tail_starts_later():
    """One rank's error ends the job; the other ranks' errors after it can fill the tail."""
    cause = "[1]<stderr>:Traceback (most recent call last)\n[1]<stderr>:ValueError: the cause\n"
    long = str(JobFailed("job exited with 1", "[0]<stdout>:start\n" + cause + "[2]<stderr>:later\n" * 1000))
    assert "first traceback ---\n" + cause in long and long.count("ValueError: the cause") == 1
    short = str(JobFailed("job exited with 1", cause + "[2]<stderr>:later\n" * 10))
    assert "first traceback" not in short and short.count("ValueError: the cause") == 1   # in the tail already


@pytest.mark.multirank
def test_ranks_import_this_checkouts_packages(tmp_path, monkeypatch):
    """A worker's own folder is its sys.path[0] and the venv's editable install may name another checkout
    (another clone that ran scripts/install.sh): here another hvd_topk is first on the caller's path, yet
    the ranks import this checkout's."""
    (tmp_path / "other" / "hvd_topk").mkdir(parents=True)
    (tmp_path / "other" / "hvd_topk" / "__init__.py").write_text("")
    (tmp_path / "worker.py").write_text("import hvd_topk\nprint('imported', hvd_topk.__file__)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "other"))
    # mpirun: the environment is run_job's for either launcher, and mpirun starts without horovodrun's own check
    out = run_job(1, [sys.executable, str(tmp_path / "worker.py")], backend="mpi", cwd=str(tmp_path), timeout=120)
    assert f"imported {os.path.join(ROOT, 'hvd_topk', '__init__.py')}" in out, out


@pytest.mark.multirank
def test_a_launch_from_a_child_of_an_mpi_singleton_runs(hvd):
    """``hvd.init()`` without a launcher is an MPI singleton (Horovod is built with MPI): Open MPI puts its
    variables (``PMIX_*``, ``OMPI_MCA_ess``, ...) in this process's C environment, where a child started
    without ``env=`` finds them. An mpirun started under them took itself for part of that job and exited 1
    without a word (the accuracy runs of bench/tests/test_run.py did so in a full run)."""
    inherited = subprocess.run(["env"], capture_output=True, text=True).stdout    # no env=: what a child gets
    assert "\nPMIX_NAMESPACE=" in "\n" + inherited, "this process holds no MPI singleton: the test cannot fail"
    launch = ("import sys; from testbed.launch import run_job; "
              "print(run_job(1, [sys.executable, '-c', 'print(\"the rank ran\")'], backend='mpi', timeout=60))")
    proc = subprocess.run([sys.executable, "-c", launch], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "the rank ran" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
