"""Bytes on the link, from the kernel's interface counters, and private network namespaces.

A job run inside its own network namespace talks to itself over that namespace's loopback only, so
the loopback counters count exactly the job's traffic (headers included). Needs root and iproute2.
"""
import os
import shutil
import subprocess
import uuid

__all__ = ["loopback_bytes", "can_make_namespace", "Namespace"]


def loopback_bytes(device="lo"):
    """(tx_bytes, rx_bytes) of ``device`` in the calling process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == device:
                cols = fields.split()
                return int(cols[8]), int(cols[0])
    raise RuntimeError(f"no interface {device!r} in /proc/net/dev")


def can_make_namespace():
    """True when this process may create network namespaces (root and iproute2 present)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


class Namespace:
    """A fresh network namespace whose loopback is up, MTU 9000, optionally rate-limited by tbf.

    Args:
        rate: tbf rate such as ``"100mbit"`` or ``"1gbit"``; None for an unlimited loopback.
        burst: tbf burst (>= 1mb, or big packets are dropped at MTU 9000).
        name: namespace name; a unique one by default.

    Example (as root)::

        with Namespace(rate="100mbit") as ns:
            subprocess.run(ns.prefix + ["python", "job.py"], check=True)
            print(ns.tx_bytes())
    """

    def __init__(self, rate=None, burst="1mb", name=None):
        if not can_make_namespace():
            raise PermissionError("network namespaces need root and iproute2 ('ip')")
        if rate is not None and shutil.which("tc") is None:
            raise RuntimeError("rate limiting needs 'tc' (Debian package iproute2)")
        self.name = name or f"hvdtopk-{uuid.uuid4().hex[:8]}"
        self.rate, self.burst = rate, burst
        self.prefix = ["ip", "netns", "exec", self.name]

    def __enter__(self):
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        try:
            self._ip("link", "set", "lo", "mtu", "9000")
            self._ip("link", "set", "lo", "up")
            if self.rate is not None:
                subprocess.run(["tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "tbf",
                                "rate", self.rate, "burst", self.burst, "latency", "100ms"], check=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Delete the namespace (also kills nothing: callers end their jobs first)."""
        subprocess.run(["ip", "netns", "del", self.name], check=False, stderr=subprocess.DEVNULL)

    def tx_bytes(self):
        """Bytes sent on the namespace's loopback so far."""
        out = subprocess.run(self.prefix + ["cat", "/proc/net/dev"], check=True,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
        raise RuntimeError("no loopback in namespace")

    def _ip(self, *args):
        subprocess.run(["ip", "-n", self.name, *args], check=True)
