"""testbed/launch.py's command lines (no job is started)."""
import pytest

from testbed.launch import launch_command

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


def test_shared_memory_is_mpi_only():
    with pytest.raises(ValueError, match="mpi"):
        launch_command(2, ["python", "w.py"], "gloo", shared_memory=True)
