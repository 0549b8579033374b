"""Emulated hosts on one machine: one network namespace per host, a switch between them, sshd on each.

Host N (1-based) is a network namespace with a UTS namespace of its own (hostname ``nodeN``), an
interface ``eth0`` with address 10.77.0.N/24 (MTU 9000) and its own sshd listening on that address.
The hosts' eth0 are veth pairs whose other ends sit on a bridge inside a "switch" namespace, so every
byte between two hosts crosses eth0 (its counters are the inter-host traffic) and an optional tbf
qdisc on each eth0 slows the inter-host link to RATE (never netem: it reorders and drops). Traffic
only ever goes to these private addresses and loopback; nothing is attached to the machine's own
network namespace.

Processes run "on" host N through ``Host.prefix`` (nsenter into its network and UTS namespaces; the
filesystem is the machine's, as a shared filesystem would be on a cluster). Root ssh between hosts
uses a key made for this cluster: a clearly marked drop-in in /etc/ssh/ssh_config.d/ tells ssh (which
horovodrun and mpirun call) to use it for 10.77.0.* without host-key checks; it is removed by down().

Stdlib only, so that scripts/hosts.sh works before the project's venv exists. Needs root, iproute2,
util-linux (nsenter, unshare) and openssh-server (installed by scripts/install.sh).

    python -m testbed.hosts up 2 1gbit     # or: bash scripts/hosts.sh up 2 1gbit
    python -m testbed.hosts status
    python -m testbed.hosts down
"""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from testbed.hosts_lock import HostsBusy, HostsLock, describe, holders

__all__ = ["HostsUnavailable", "HostsBusy", "cannot_make_namespaces", "missing_requirements", "Host", "EmulatedHosts",
           "down_all", "main"]

SUBNET = "10.77.0"
NETNS_PREFIX = "hvdhosts-"                         # namespaces: hvdhosts-switch, hvdhosts-node1, ...
SWITCH = NETNS_PREFIX + "switch"
STATE_DIR = os.environ.get("HVD_TOPK_HOSTS_DIR", "/run/hvd_topk-hosts")
SSH_DROPIN = "/etc/ssh/ssh_config.d/hvd_topk-hosts.conf"
SSHD = "/usr/sbin/sshd"
ETC_NETNS = "/etc/netns"                           # `ip netns exec NS` mounts /etc/netns/NS/* over /etc
MTU = 9000
MAX_HOSTS = 32


class HostsUnavailable(RuntimeError):
    """The machine cannot emulate hosts here (not root, no namespaces, no sshd); says what is missing."""


def _run(cmd, check=True, timeout=30, **kw):
    """Run a command with a hard timeout; raise with its stderr when it fails and ``check``."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def cannot_make_namespaces():
    """Why this process cannot make network namespaces (not root, no kernel or container support), or
    None. Only this is a reason to skip; a missing tool is a missing install (scripts/install.sh)."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth pairs and sshd need root (run with sudo)"
    if shutil.which("ip") is None:
        return None                    # reported by missing_requirements() as a missing package
    probe = f"{NETNS_PREFIX}probe{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    _run(["ip", "netns", "del", probe], check=False)
    if made.returncode != 0:
        return (f"no network namespace support (ip netns add failed: {made.stderr.strip()}); in a "
                "container, run it with --privileged or CAP_SYS_ADMIN + CAP_NET_ADMIN")
    return None


def missing_requirements():
    """What this machine lacks to emulate hosts, as sentences ([] when nothing is missing)."""
    missing = []
    tools = {"ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux", "unshare": "util-linux",
             "ssh": "openssh-client", "ssh-keygen": "openssh-client"}
    for tool, package in tools.items():
        if shutil.which(tool) is None:
            missing.append(f"'{tool}' (Debian package {package})")
    if not os.access(SSHD, os.X_OK):
        missing.append(f"{SSHD} (Debian package openssh-server; scripts/install.sh installs it)")
    reason = cannot_make_namespaces()
    return ([reason] if reason else []) + missing


class Host:
    """One emulated host: its name (``nodeN``), address, namespaces and command prefix."""

    def __init__(self, index, state_dir=STATE_DIR):
        self.index = index
        self.name = f"node{index}"
        self.addr = f"{SUBNET}.{index}"
        self.netns = NETNS_PREFIX + self.name
        self.uts_file = os.path.join(state_dir, "uts", self.name)
        self.sshd_config = os.path.join(state_dir, f"sshd-{self.name}.conf")
        self.sshd_pid_file = os.path.join(state_dir, f"sshd-{self.name}.pid")
        self.sshd_log = os.path.join(state_dir, f"sshd-{self.name}.log")
        # `ip netns exec` also mounts a /sys of the host's own network namespace (in a mount namespace
        # of its own; the rest of the filesystem stays the machine's, as a shared filesystem would):
        # Gloo's hvd.init() reads the interfaces' /sys entries and crashes (SIGSEGV) without it.
        self.prefix = ["nsenter", f"--uts={self.uts_file}", "--", "ip", "netns", "exec", self.netns]
        # ... and /etc/netns/<netns>/hosts over /etc/hosts: each host resolves the hosts' names (Gloo
        # crashes too when a host cannot resolve its own hostname).
        self.etc_dir = os.path.join(ETC_NETNS, self.netns)
        # Without the /sys remount, which hides the cgroup mounts slurmd needs (Slurm's jobs use MPI,
        # not Gloo).
        self.slurmd_prefix = ["nsenter", f"--net=/run/netns/{self.netns}", f"--uts={self.uts_file}", "--"]

    def run(self, *cmd, check=True, timeout=30):
        """Run ``cmd`` on this host; returns the CompletedProcess (text)."""
        return _run([*self.prefix, *cmd], check=check, timeout=timeout)

    def slots(self, n):
        """``addr:n``, one entry of a horovodrun/mpirun host list."""
        return f"{self.addr}:{n}"

    def eth0_bytes(self):
        """(tx_bytes, rx_bytes) of this host's eth0: every byte it exchanged with the other hosts."""
        text = _run(["ip", "netns", "exec", self.netns, "cat", "/proc/net/dev"]).stdout
        for line in text.splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "eth0":
                cols = fields.split()
                return int(cols[8]), int(cols[0])
        raise RuntimeError(f"{self.name} has no eth0")

    def pids(self):
        """Process ids of everything running in this host's network namespace."""
        proc = _run(["ip", "netns", "pids", self.netns], check=False)
        return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []

    def sshd_pid(self):
        try:
            with open(self.sshd_pid_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None


def _netns_list():
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _kill_all(pids, grace=3.0):
    """SIGTERM, then SIGKILL after ``grace`` seconds, every pid still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(_exists(p) for p in pids):
            time.sleep(0.1)


def _exists(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"     # a zombie has ended
    except OSError:
        return False


def down_all(state_dir=STATE_DIR, quiet=False):
    """Tear down every emulated host, whatever state it is in: end every process in the hosts'
    namespaces, unmount the UTS namespaces, delete the namespaces, the ssh drop-in and the state.
    Safe to call when nothing is up (idempotent)."""
    say = (lambda *_: None) if quiet else (lambda msg: print(f"hosts: {msg}", flush=True))
    ours = [ns for ns in _netns_list() if ns.startswith(NETNS_PREFIX)]
    for ns in ours:
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if pids:
            say(f"ending {len(pids)} process(es) in {ns}")
            _kill_all(pids)
    uts_dir = os.path.join(state_dir, "uts")
    for name in (sorted(os.listdir(uts_dir)) if os.path.isdir(uts_dir) else []):
        _run(["umount", os.path.join(uts_dir, name)], check=False)
    for ns in ours:
        _run(["ip", "netns", "del", ns], check=False)
    for ns in (os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []):
        if ns.startswith(NETNS_PREFIX):
            shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    try:
        os.rmdir(ETC_NETNS)          # made by up() when absent; left alone when anything else is in it
    except OSError:
        pass
    if os.path.exists(SSH_DROPIN):
        os.remove(SSH_DROPIN)
    state = _read_state(state_dir)
    home_ssh = os.path.expanduser("~/.ssh")
    if state.get("created_home_ssh") and os.path.isdir(home_ssh) and not os.listdir(home_ssh):
        os.rmdir(home_ssh)     # ssh makes ~/.ssh when it first runs; leave no trace of that
    shutil.rmtree(state_dir, ignore_errors=True)
    if ours:
        say(f"down: deleted {', '.join(ours)}")
    else:
        say("down: nothing was up")


def lock_path(state_dir):
    """The lock file of the hosts whose state is ``state_dir``: beside it, since down_all deletes it."""
    return state_dir.rstrip("/") + ".lock"


def _read_state(state_dir):
    try:
        with open(os.path.join(state_dir, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


SSHD_CONFIG = """\
# sshd of emulated host {name} (testbed/hosts.py)
ListenAddress {addr}
Port 22
HostKey {state}/ssh_host_ed25519_key
PidFile {pid_file}
AuthorizedKeysFile {state}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
# horovodrun and mpirun open many sessions at once (one per rank and service)
MaxStartups 200
MaxSessions 200
"""

SSH_CLIENT_DROPIN = """\
# hvd_topk emulated hosts (testbed/hosts.py, scripts/hosts.sh): root ssh between the hosts'
# private addresses with a key made for them. Removed by `scripts/hosts.sh down`.
Host {subnet}.*
    User root
    IdentityFile {state}/id_ed25519
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    ConnectTimeout 10
    ServerAliveInterval 5
    ServerAliveCountMax 3
"""


class EmulatedHosts:
    """N emulated hosts (see the module docstring); ``up()``/``close()`` or a ``with`` block.

    Between ``up()`` and ``close()`` this process holds them (testbed/hosts_lock.py): nobody else
    rebuilds or deletes them meanwhile, and where that is what this one needs, ``HostsBusy`` says who
    holds them.

    Args:
        n: number of hosts (1..32).
        rate: tbf rate of every host's eth0, such as ``"1gbit"``; None: unlimited.
        burst: tbf burst; at MTU 9000 it must hold several whole frames (>= 1mb).
    """

    def __init__(self, n, rate=None, burst="1mb", state_dir=STATE_DIR):
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"number of hosts must be 1..{MAX_HOSTS}, got {n}")
        self.n, self.rate, self.burst, self.state_dir = n, rate, burst, state_dir
        self.hosts = [Host(i, state_dir) for i in range(1, n + 1)]
        self.brought_up = False      # whether up() built them (False: they were up already)
        self.daemons = set()         # pids of services started on the hosts (slurmd, ...): kept by kill_strays
        self.lock = HostsLock(lock_path(state_dir))

    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.close()

    def host_list(self, slots_per_host):
        """horovodrun/mpirun ``-H`` value: ``10.77.0.1:S,10.77.0.2:S,...``."""
        return ",".join(h.slots(slots_per_host) for h in self.hosts)

    def up(self, exclusive=False):
        """Build the hosts, or keep them when exactly these are up and answer; else rebuild.

        ``exclusive``: hold them alone until ``close()`` (a benchmark, whose link must carry its own
        traffic only). HostsBusy when another process holds them and this needs them alone (exclusive,
        or a rebuild), or when processes of a job run on them and a rebuild would end them."""
        missing = missing_requirements()
        if missing:
            raise HostsUnavailable("cannot emulate hosts here; missing: " + "; ".join(missing))
        state = _read_state(self.state_dir)
        wanted = f"{self.n} host(s), eth0 {self.rate or 'unlimited'}"
        same = state.get("n") == self.n and state.get("rate") == self.rate
        if exclusive or not same:
            self.lock.exclusive(f"have them alone as {wanted}" if same else
                                f"rebuild them as {wanted} (they are {state.get('n')} host(s), eth0 "
                                f"{state.get('rate') or 'unlimited'})")
            jobs = self.foreign_processes() if state else []
            if jobs:
                self.lock.release()
                raise HostsBusy(f"cannot {'have' if same else 'rebuild'} the emulated hosts as {wanted}: a job "
                                f"runs on them ({jobs}); end it, or run `scripts/hosts.sh down`")
        else:
            self.lock.share()
        if same and not self.problems():
            return self
        if self.lock.mode != fcntl.LOCK_EX:
            self.lock.exclusive(f"rebuild them as {wanted} (they do not answer)")
        down_all(self.state_dir, quiet=True)
        try:
            self._make_state_dir()
            self._make_network()
            for host in self.hosts:
                self._start_sshd(host)
            self._wait_for_ssh()
        except BaseException:
            down_all(self.state_dir, quiet=True)
            self.lock.release()
            raise
        self.brought_up = True
        if not exclusive:
            self.lock.share()                       # let others run beside this user from now on
        return self

    def close(self, keep=False):
        """Let the hosts go: delete them if this built them, nobody else holds them and not ``keep``;
        else leave them up (for those who hold them, or for the next user: up() keeps hosts that match)."""
        if self.brought_up and not keep:
            self.down()
        self.lock.release()

    def down(self):
        """Delete the hosts; where another process holds them, leave them up for it and say so. Returns
        whether they were deleted."""
        try:
            self.lock.exclusive("delete them")
        except HostsBusy as e:
            print(f"hosts: left up: {e}", file=sys.stderr, flush=True)
            return False
        down_all(self.state_dir, quiet=True)
        self.lock.release()
        self.brought_up = False
        return True

    def foreign_processes(self):
        """'N processes on nodeK, ...' for the processes other than sshd and this object's daemons on
        the hosts (a job's ranks); '' when none run or the hosts are not up."""
        keep = self.daemons | {h.sshd_pid() for h in self.hosts}
        used = [f"{len(others)} processes on {h.name}" for h in self.hosts
                if (others := [p for p in h.pids() if p not in keep and p != os.getpid()])]
        return ", ".join(used)

    def _make_state_dir(self):
        os.makedirs(os.path.join(self.state_dir, "uts"), mode=0o700)
        key = os.path.join(self.state_dir, "id_ed25519")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvd_topk-hosts", "-f", key])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
              os.path.join(self.state_dir, "ssh_host_ed25519_key")])
        shutil.copyfile(key + ".pub", os.path.join(self.state_dir, "authorized_keys"))
        state = {"n": self.n, "rate": self.rate, "subnet": SUBNET,
                 "created_home_ssh": not os.path.isdir(os.path.expanduser("~/.ssh"))}
        with open(os.path.join(self.state_dir, "state.json"), "w") as f:
            json.dump(state, f)
        os.makedirs(os.path.dirname(SSH_DROPIN), exist_ok=True)
        with open(SSH_DROPIN, "w") as f:
            f.write(SSH_CLIENT_DROPIN.format(subnet=SUBNET, state=self.state_dir))

    def _make_network(self):
        """The switch (a bridge in its own namespace) and, per host, namespaces, veth and tbf."""
        _run(["ip", "netns", "add", SWITCH])
        _run(["ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", SWITCH, "link", "set", "br0", "mtu", str(MTU), "up"])
        etc_hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{h.addr} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            _run(["ip", "netns", "add", h.netns])
            os.makedirs(h.etc_dir, exist_ok=True)
            with open(os.path.join(h.etc_dir, "hosts"), "w") as f:
                f.write(etc_hosts)
            open(h.uts_file, "w").close()              # unshare binds the namespace onto this file
            _run(["unshare", f"--uts={h.uts_file}", "hostname", h.name])
            # The pair is made inside the switch; its host end moves straight into the host as eth0.
            _run(["ip", "-n", SWITCH, "link", "add", f"port{h.index}", "mtu", str(MTU), "type", "veth",
                  "peer", "name", "eth0", "mtu", str(MTU), "netns", h.netns])
            _run(["ip", "-n", SWITCH, "link", "set", f"port{h.index}", "master", "br0", "up"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0"])
            _run(["ip", "-n", h.netns, "link", "set", "eth0", "up"])
            if self.rate:
                _run(["tc", "-n", h.netns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", self.rate,
                      "burst", self.burst, "latency", "100ms"])

    def _start_sshd(self, host):
        with open(host.sshd_config, "w") as f:
            f.write(SSHD_CONFIG.format(name=host.name, addr=host.addr, state=self.state_dir,
                                       pid_file=host.sshd_pid_file))
        os.makedirs("/run/sshd", exist_ok=True)       # sshd's privilege-separation directory
        # sshd daemonizes (its pid in the PidFile) and stays in the host's namespaces.
        host.run(SSHD, "-f", host.sshd_config, "-E", host.sshd_log)

    def _wait_for_ssh(self, timeout=30):
        """Every host reaches every host (itself included) by ssh, and sees the right hostname."""
        deadline = time.monotonic() + timeout
        while True:
            problems = self.problems()
            if not problems:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("emulated hosts did not come up: " + "; ".join(problems))
            time.sleep(0.5)

    def problems(self):
        """What is wrong with the running hosts ([] when all are up and reach each other by ssh)."""
        problems = []
        present = set(_netns_list())
        for h in self.hosts:
            if h.netns not in present or not os.path.exists(h.uts_file):
                problems.append(f"{h.name}: no namespace")
                continue
            if h.sshd_pid() is None or not _exists(h.sshd_pid()):
                problems.append(f"{h.name}: sshd not running (log: {h.sshd_log})")
                continue
            target = self.hosts[h.index % self.n]
            proc = h.run("ssh", target.addr, "hostname", check=False, timeout=20)
            if proc.returncode != 0 or proc.stdout.strip() != target.name:
                problems.append(f"{h.name} -> {target.name} by ssh: rc {proc.returncode}, "
                                f"{(proc.stdout + proc.stderr).strip()[:200]}")
        return problems

    def kill_strays(self, keep=()):
        """End every process on the hosts except their sshd (and ``keep``): what a failed or timed-out
        job left behind on a host other than the launcher's (a launcher's kill does not cross ssh)."""
        others = [(pid, cmd) for pid, cmd in holders(self.lock.path) if pid != os.getpid()]
        if others:               # their processes are on the hosts too, and look just like strays
            print(f"hosts: strays not ended: the hosts are also held by {describe(others)}", file=sys.stderr)
            return []
        keep = set(keep) | self.daemons | {h.sshd_pid() for h in self.hosts}
        strays = [p for h in self.hosts for p in h.pids() if p not in keep and p != os.getpid()]
        # sshd's per-connection children are processes of ours too, and end with their sessions.
        _kill_all(strays)
        return strays

    def status(self):
        """A dict: per host its address, sshd pid, eth0 bytes; and the problems found."""
        hosts = []
        for h in self.hosts:
            entry = {"name": h.name, "addr": h.addr, "netns": h.netns, "sshd_pid": h.sshd_pid()}
            try:
                entry["eth0_tx_bytes"], entry["eth0_rx_bytes"] = h.eth0_bytes()
            except RuntimeError:
                pass
            hosts.append(entry)
        return {"n": self.n, "rate": self.rate, "hosts": hosts, "problems": self.problems()}


def _running_state():
    state = _read_state(STATE_DIR)
    return EmulatedHosts(state["n"], state.get("rate")) if state.get("n") else None


def main(argv=None):
    """``up N [RATE]`` | ``down`` | ``status`` | ``check`` (what is missing); returns an exit status."""
    argv = sys.argv[1:] if argv is None else argv
    # SIGTERM mid-`up` unwinds like Ctrl-C, so that up() deletes what it had built.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    usage = "usage: hosts.sh up N [RATE] | down | status | check | run N COMMAND... | demo [ARGS]"
    if not argv or argv[0] not in ("up", "down", "status", "check"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "check":
        missing = missing_requirements()
        print("hosts: can emulate hosts" if not missing else "hosts: missing: " + "; ".join(missing))
        return 0 if not missing else 1
    if argv[0] == "down":
        held = holders(lock_path(STATE_DIR))
        if held:
            print(f"hosts: not deleted: they are held by {describe(held)}", file=sys.stderr)
            return 1
        down_all()
        return 0
    if argv[0] == "status":
        cluster = _running_state()
        if cluster is None:
            print("hosts: none up")
            return 1
        status = cluster.status()
        print(json.dumps(status, indent=1))
        return 0 if not status["problems"] else 1
    if len(argv) not in (2, 3) or not argv[1].isdigit():
        print(usage, file=sys.stderr)
        return 2
    cluster = EmulatedHosts(int(argv[1]), argv[2] if len(argv) == 3 else None)
    try:
        cluster.up()
    except (HostsUnavailable, HostsBusy) as e:
        print(f"hosts: {e}", file=sys.stderr)
        return 1
    what = "built" if cluster.brought_up else "already up"
    rate = f", eth0 limited to {cluster.rate}" if cluster.rate else ""
    print(f"hosts: {what}: " + ", ".join(f"{h.name}={h.addr}" for h in cluster.hosts) + rate)
    print("hosts: run a command on node1 with: bash scripts/hosts.sh run 1 COMMAND")
    print(f"hosts: e.g. horovodrun -np {2 * cluster.n} -H {cluster.host_list(2)} --gloo "
          "--network-interface eth0 python train.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
