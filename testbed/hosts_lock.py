"""Who holds the emulated hosts: a lock, so that no user rebuilds or deletes them under another's job.

Every user of the hosts (a test module, a benchmark's driver) holds a lock on a file beside the hosts'
state from ``EmulatedHosts.up()`` until ``close()``:

- shared, to run jobs on them as they are (several test modules, or a test beside a demo);
- exclusive, to rebuild them (another number of hosts or another rate), to delete them, or for a
  benchmark's whole run, whose link must carry its own traffic only.

Without it a test that wanted unlimited hosts rebuilt them, killing whatever ran there, under a
benchmark running at 100 Mbit/s; and a benchmark between two of its jobs would have carried on over
hosts of another rate. Now the second comer gets ``HostsBusy`` at once, naming the holder's process.

The lock is an flock(2) on an open file: it goes with its holder, so a driver that dies never leaves
the hosts locked, and its ranks (other processes, which do not inherit the descriptor) are not holders.
Stdlib only, like testbed/hosts.py.
"""
import fcntl
import os
import time

__all__ = ["HostsBusy", "HostsLock", "holders"]


class HostsBusy(RuntimeError):
    """Another process holds the emulated hosts; says which, and what this one wanted."""


class HostsLock:
    """This process's hold on the hosts: ``share``, ``exclusive`` or ``release``; one per EmulatedHosts."""

    def __init__(self, path):
        self.path = path
        self.fd = None
        self.mode = None           # fcntl.LOCK_SH or LOCK_EX while held

    def share(self, wait_s=60.0):
        """Hold the hosts beside other users. Waits up to ``wait_s`` for one that is rebuilding or
        deleting them (which takes seconds), or holds them alone; then HostsBusy."""
        self._take(fcntl.LOCK_SH, wait_s, "use them")

    def exclusive(self, what):
        """Hold the hosts alone, to do ``what``; HostsBusy at once while any other process holds them."""
        self._take(fcntl.LOCK_EX, 0.0, what)

    def release(self):
        if self.fd is not None:
            os.close(self.fd)      # closing the descriptor lets the lock go
        self.fd, self.mode = None, None

    def _take(self, kind, wait_s, what):
        if self.fd is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)     # not inherited by children
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self.fd, kind | fcntl.LOCK_NB)
                self.mode = kind
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.5)
        # Converting a held lock is not atomic (flock(2)): a failed try may have dropped it.
        self.release()
        raise HostsBusy(f"cannot {what}: the emulated hosts are held by {describe(holders(self.path))}; "
                        "run again once that is over")


def holders(path):
    """[(pid, command line)] of the processes holding a lock on ``path`` (read from /proc/locks)."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":     # "->": a waiter, not a holder
            continue
        if fields[5].rsplit(":", 1)[-1] == str(inode) and int(fields[4]) not in pids:
            pids.append(int(fields[4]))
    return [(pid, _command(pid)) for pid in pids]


def describe(found):
    if not found:
        return "another process (it let go just now: try again)"
    return ", ".join(f"pid {pid}{' (this process)' if pid == os.getpid() else ''}: {cmd}" for pid, cmd in found)


def _command(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())[:200] or "?"
    except OSError:
        return "?"
