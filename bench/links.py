"""Where a run's ranks run, over which link, and how the bytes on that link are counted.

Two places (``place``):

- one host: a fresh network namespace (``testbed.wire.Namespace``) whose loopback has MTU 9000 and, for
  a limited link, a ``tc tbf`` qdisc (burst 1mb, latency 100 ms; no netem, which reorders and drops);
  every rank talks over that loopback, so its counters are the job's traffic alone;
- ``hosts`` emulated hosts x ``slots`` ranks (``testbed.hosts.EmulatedHosts``), each host's eth0 limited
  the same way; the job is launched from the first host, and the hosts' eth0 counters are every byte
  between them. The run holds the hosts alone (nobody rebuilds them or runs a job there meanwhile).

The bytes of a turn: each host's first rank reads its interface's tx counter (``iface_tx``) and the
ranks sum it (the runner's collective), at the turn's start and end. Links: ``LINKS``. Horovod's cycle
time (``HOROVOD_CYCLE_TIME``) is left at Horovod's own default (1 ms) unless a run sets it.
"""
import contextlib
import itertools
import os
import shutil
import threading

from testbed.hosts import EmulatedHosts, missing_requirements
from testbed.launch import JobFailed, run_job
from testbed.wire import Namespace

__all__ = ["LINKS", "TBF_BURST", "HOROVOD_DEFAULT_CYCLE_MS", "Placement", "place", "missing", "run_ranks",
           "launcher_env", "iface_tx", "LoadSampler"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINKS = {"unlimited": None, "1gbit": "1gbit", "100mbit": "100mbit"}          # name -> tbf rate
RATE_BYTES_PER_S = {"unlimited": None, "1gbit": 1e9 / 8, "100mbit": 100e6 / 8}
TBF_BURST = "1mb"                 # the smallest burst that passes MTU-9000 frames
HOROVOD_DEFAULT_CYCLE_MS = 1.0
_NAMESPACES = itertools.count()


class Placement:
    """Where one job runs: the launcher's prefix, host list (None: this host), the counted interface,
    the ranks, and the address of torch.distributed's store (the first host)."""

    def __init__(self, prefix, np, iface, host_list=None, master_addr="127.0.0.1", cluster=None):
        self.prefix, self.np, self.iface, self.host_list = prefix, np, iface, host_list
        self.master_addr, self.cluster = master_addr, cluster

    def describe(self, link):
        where = (f"{self.cluster.n} emulated hosts x {self.np // self.cluster.n} ranks, bytes on eth0"
                 if self.cluster else f"{self.np} ranks on one host, bytes on its loopback")
        return f"{where}, link {link}"


def missing(link, hosts):
    """What this machine lacks for the run (root, ip, tc; the hosts' own needs), as sentences."""
    if hosts:
        return missing_requirements()
    lacks = [] if os.geteuid() == 0 else ["root (network namespaces need it)"]
    tools = ("ip", "tc") if LINKS[link] else ("ip",)
    return lacks + [f"'{t}' (Debian package iproute2)" for t in tools if shutil.which(t) is None]


@contextlib.contextmanager
def place(link, np=2, hosts=0, slots=2, keep_hosts=False):
    """The ``Placement`` of a job on ``link``: a fresh namespace on this host, or ``hosts`` emulated
    hosts of ``slots`` ranks each (brought up at the link's rate, held alone, taken down afterwards if
    this built them, unless ``keep_hosts``)."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {list(LINKS)}, got {link!r}")
    if not hosts:
        with Namespace(LINKS[link], TBF_BURST, name=f"hvdtopk-run{os.getpid()}-{next(_NAMESPACES)}") as ns:
            yield Placement(ns.prefix, np, "lo")
        return
    cluster = EmulatedHosts(hosts, rate=LINKS[link], burst=TBF_BURST)
    cluster.up(exclusive=True)       # alone: the link must carry this run's traffic only
    try:
        yield Placement(cluster.hosts[0].prefix, hosts * slots, "eth0", cluster.host_list(slots),
                        cluster.hosts[0].addr, cluster)
    finally:
        cluster.close(keep=keep_hosts)


def run_ranks(placement, argv, env, timeout, launcher="gloo", failed_log=None):
    """Run ``argv`` on every rank of ``placement``; returns the job's output. On failure the whole
    output goes to ``failed_log`` (JobFailed keeps only its tail, which loses the first rank's error)
    and, across hosts, what the job left on the other hosts is ended."""
    try:
        return run_job(placement.np, argv, backend=launcher, timeout=timeout, prefix=placement.prefix, env=env,
                       cwd=ROOT, hosts=placement.host_list, interface=placement.iface if placement.host_list else None,
                       shared_memory=launcher == "mpi" and placement.host_list is not None)
    except JobFailed as e:
        if failed_log:
            with open(failed_log, "w") as f:
                f.write(e.output)
        if placement.cluster is not None:
            placement.cluster.kill_strays()     # a launcher's kill does not cross ssh
        raise


# -- in the ranks -------------------------------------------------------------------------------------
def launcher_env():
    """(rank, size, local_rank) from horovodrun's, mpirun's or torchrun's environment."""
    for r, s, lr in (("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
                     ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                     ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s]), int(os.environ.get(lr, 0))
    raise RuntimeError("no rank in the environment: launch with horovodrun, mpirun or torchrun")


def iface_tx(iface):
    """Bytes sent so far on ``iface`` of this process's network namespace (the kernel's counter)."""
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``every`` seconds while a job runs (the machine may be shared)."""

    def __init__(self, every=15.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.done = every, [], threading.Event()

    def run(self):
        while True:
            self.samples.append(round(os.getloadavg()[0], 2))
            if self.done.wait(self.every):
                return
