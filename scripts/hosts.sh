#!/usr/bin/env bash
# Emulated hosts on this machine, for multi-host runs without a cluster (testbed/hosts.py):
#   bash scripts/hosts.sh up N [RATE]   N hosts node1..nodeN (10.77.0.1..N on eth0, sshd on each);
#                                       RATE (e.g. 1gbit) limits every host's eth0 with tbf
#   bash scripts/hosts.sh status        the hosts, their eth0 byte counters, what is wrong (exit 1)
#   bash scripts/hosts.sh down          end everything on the hosts and delete them (idempotent)
#   bash scripts/hosts.sh check         what this machine lacks to emulate hosts (exit 1 if anything)
#   bash scripts/hosts.sh run N CMD...  run CMD on host N, e.g. `run 1 horovodrun -np 4 -H ...`
#   bash scripts/hosts.sh demo [ARGS]   the demo (python -m bench demo --across-hosts ARGS, e.g. --rate 1gbit
#                                       --epochs 5) on 2 hosts: bytes between them, dense vs TopKEF
# Needs root, iproute2, util-linux and openssh-server (scripts/install.sh installs them).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The module is stdlib only: the system's python3 will do before the venv exists.
PY=${HVD_TOPK_VENV:-$ROOT/.venv}/bin/python
[ -x "$PY" ] || PY=python3
hosts() { PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m testbed.hosts "$@"; }

case "${1:-}" in
    run)
        [ "$#" -ge 3 ] || { echo "usage: hosts.sh run N COMMAND..." >&2; exit 2; }
        n=$2; shift 2
        [ -e "/run/netns/hvdhosts-node$n" ] || { echo "hosts.sh: node$n is not up (hosts.sh up N)" >&2; exit 1; }
        exec nsenter --uts="${HVD_TOPK_HOSTS_DIR:-/run/hvd_topk-hosts}/uts/node$n" -- \
            ip netns exec "hvdhosts-node$n" "$@" ;;
    demo)
        shift
        # Hosts this command builds are deleted again whatever happens (failure, Ctrl-C); hosts that
        # were up before are left up.
        hosts status >/dev/null 2>&1 || trap 'hosts down >/dev/null' EXIT
        cd "$ROOT"
        PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m bench demo --across-hosts "$@" ;;
    *)
        hosts "$@" ;;
esac
