"""testbed/hosts_lock.py: a second user of the emulated hosts is told who holds them, at once.

A real flock held by another process (no root, no hosts needed); the hosts themselves, held by a test
module while another process tries to rebuild or delete them, are in tests/test_multihost.py."""
import fcntl
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from testbed.hosts_lock import HostsBusy, HostsLock, holders

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def other_holder(tmp_path):
    """Start another process holding the lock file ("shared" or "exclusive"); yields (path, its pid)."""
    procs = []

    def start(kind):
        path = str(tmp_path / "hosts.lock")
        proc = subprocess.Popen([sys.executable, "-c", HOLD, path, kind], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return path, proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_shared_holder_lets_others_share_but_not_hold_alone(other_holder):
    path, proc = other_holder("shared")
    assert [pid for pid, _ in holders(path)] == [proc.pid]
    mine = HostsLock(path)
    mine.share(wait_s=0)
    with pytest.raises(HostsBusy, match="cannot rebuild them: the emulated hosts are held by pid") as busy:
        HostsLock(path).exclusive("rebuild them")
    assert f"pid {os.getpid()} (this process): " in str(busy.value)          # every holder, in any order
    assert re.search(rf"pid {proc.pid}: \S*python -c import fcntl", str(busy.value))
    mine.release()
    assert mine.fd is None and [pid for pid, _ in holders(path)] == [proc.pid]


def test_an_exclusive_holder_keeps_everyone_out_until_it_ends(other_holder):
    path, proc = other_holder("exclusive")
    lock = HostsLock(path)
    t0 = time.monotonic()
    with pytest.raises(HostsBusy, match=f"cannot use them: .* pid {proc.pid}"):
        lock.share(wait_s=0.5)
    assert time.monotonic() - t0 >= 0.5, "share() refused before its wait_s was over"
    assert lock.fd is None                       # a refused lock holds nothing
    ends = threading.Timer(0.5, proc.kill)       # a holder that dies lets go with its descriptor ...
    ends.start()
    lock.share(wait_s=10)                        # ... and share() waits for that instead of refusing
    ends.join()
    assert lock.mode == fcntl.LOCK_SH and [pid for pid, _ in holders(path)] == [os.getpid()]
    lock.exclusive("delete them")
    assert lock.mode == fcntl.LOCK_EX
    lock.release()
    assert holders(path) == []
