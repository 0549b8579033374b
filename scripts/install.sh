#!/usr/bin/env bash
# Set up everything hvd_topk needs on a fresh Debian 12 machine with Python 3.11, idempotently:
#   1. Debian packages: OpenMPI (libopenmpi-dev, openmpi-bin), Debian's cmake (pip's cmake 4.x rejects
#      gloo's CMakeLists), iproute2 (network namespaces and tc for the wire tests), openssh-server (sshd
#      on each emulated host of scripts/hosts.sh, which starts its own; the install does not start the
#      package's system service).
#   2. A virtual environment in ./.venv (ignored by git).
#   3. torch==2.13.0 (pinned: any other spec pulls the CUDA wheels), numpy, mpi4py, pytest and friends.
#   4. Horovod 0.28.1 built from PyPI's sdist with PyTorch + Gloo + MPI. Its CMake pins C++14, which
#      torch >= 2.1 headers reject; we set C++17 in the unpacked sdist (the only change) and cache the
#      built wheel under ~/.cache/hvd_topk/wheels, keyed by Horovod, torch, Python and MPI versions,
#      so a second run takes seconds.
#   5. hvd_topk itself, editable.
#   6. A stamp in the venv: a later run from the same checkout, with this script, setup.py, the pins and
#      every package unchanged, stops after checking that (about a second).
# Environment knobs: HVD_TOPK_VENV (venv path), HVD_TOPK_CACHE (wheel cache), PYTHON (interpreter),
# HVD_TOPK_TORCH_VERSION (torch pin; the Docker image sets a CUDA build),
# HOROVOD_GPU_OPERATIONS (e.g. NCCL, used by docker/Dockerfile), HVD_TOPK_SKIP_APT=1 (packages present).
set -euo pipefail

HOROVOD_VERSION=0.28.1
TORCH_VERSION=${HVD_TOPK_TORCH_VERSION:-2.13.0}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_TOPK_VENV:-$ROOT/.venv}
CACHE=${HVD_TOPK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_topk}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

STEP="starting"
HINT=""
fail() {
    echo >&2
    echo "install.sh: FAILED at step: $STEP" >&2
    [ -n "$HINT" ] && echo "install.sh: what to do: $HINT" >&2
    exit 1
}
trap fail ERR
step() { STEP=$1; HINT=$2; echo "==> $STEP"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "need root for: $*" >&2; return 1; fi
}

step "Debian packages (OpenMPI, cmake, iproute2, openssh-server)" \
     "run 'apt-get update && apt-get install -y libopenmpi-dev openmpi-bin cmake g++ iproute2 openssh-server' as root, then re-run"
need=()
for pkg in libopenmpi-dev openmpi-bin cmake g++ make iproute2 procps openssh-client openssh-server; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ] && [ "${HVD_TOPK_SKIP_APT:-0}" != 1 ]; then
    export DEBIAN_FRONTEND=noninteractive
    # openssh-server's scripts would start the system's sshd where an init system runs; the emulated
    # hosts run their own, so keep the system's one stopped (as scripts/install_slurm.sh does).
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
        as_root chmod +x "$policy"
        trap 'as_root rm -f "$policy"' EXIT
    fi
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
cmake_major=$(cmake --version | awk 'NR==1{split($3,v,"."); print v[1]}')
[ "$cmake_major" = 3 ] || { HINT="install Debian's cmake 3.x; pip's cmake 4.x rejects gloo"; false; }

step "virtual environment at $VENV" "check that '$PYTHON -m venv' works (apt-get install python3-venv)"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

# A later run: when the stamp says this script, setup.py and the pins were installed from this checkout
# into this venv, and every package is still there, nothing is reinstalled (the steps below take about
# 13 s even with nothing to do, at each start of scripts/test.sh). rm "$STAMP" forces them.
STAMP="$VENV/.hvd_topk-installed"
# The Python packages besides torch (Horovod's runtime deps among them): installed below, checked here.
PY_PACKAGES=(numpy mpi4py pytest pytest-timeout hypothesis scikit-learn tqdm pyyaml matplotlib tensorboard
             cloudpickle psutil packaging cffi)
mpi_ver=$(mpirun --version 2>/dev/null | awk 'NR==1{print $NF}')
want=$({ cat "$ROOT/scripts/install.sh" "$ROOT/setup.py"
         echo "$ROOT torch=$TORCH_VERSION horovod=$HOROVOD_VERSION ompi=$mpi_ver gpu=${HOROVOD_GPU_OPERATIONS:-}"; } |
       sha256sum | cut -d' ' -f1)
still_installed() {
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] || return 1
    "$PY" - "$ROOT" "$TORCH_VERSION" "$HOROVOD_VERSION" "${PY_PACKAGES[@]}" <<'PYEOF' 2>/dev/null
import importlib.metadata as md, importlib.util, os, sys
root, torch_version, horovod_version, *packages = sys.argv[1:]
for dist in packages:
    md.version(dist)                    # raises when it is gone
assert md.version("torch").split("+")[0] == torch_version and md.version("horovod") == horovod_version
spec = importlib.util.find_spec("hvd_topk")            # finds, does not import
assert os.path.realpath(spec.submodule_search_locations[0]) == os.path.realpath(os.path.join(root, "hvd_topk"))
PYEOF
}
if still_installed; then
    echo "==> ready: $VENV (installed before from this checkout: $STAMP)"
    exit 0
fi
rm -f "$STAMP"

step "Python packages (torch==$TORCH_VERSION, numpy, mpi4py, pytest, ...)" \
     "check network access to PyPI; torch must be exactly $TORCH_VERSION (the local CPU build)"
"${PIP[@]}" install -U pip setuptools wheel
"${PIP[@]}" install "torch==$TORCH_VERSION"
# Horovod's runtime deps are installed here so that the wheel install below needs no resolution.
"${PIP[@]}" install "torch==$TORCH_VERSION" "${PY_PACKAGES[@]}"

step "Horovod $HOROVOD_VERSION (PyTorch + Gloo + MPI${HOROVOD_GPU_OPERATIONS:+ + $HOROVOD_GPU_OPERATIONS})" \
     "read the build log above; rm -rf '$CACHE' to force a clean rebuild"
key="horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-py$pyver-ompi$mpi_ver${HOROVOD_GPU_OPERATIONS:+-${HOROVOD_GPU_OPERATIONS,,}}"
wheeldir="$CACHE/wheels/$key"
have_hvd() {
    "$PY" - <<'PYEOF' 2>/dev/null
import horovod, horovod.torch as hvd
assert horovod.__version__ == "0.28.1"
assert hvd.mpi_built() and hvd.gloo_built()
PYEOF
}
if ! have_hvd; then
    if ! ls "$wheeldir"/horovod-*.whl >/dev/null 2>&1; then
        echo "    building Horovod from source (about 8 minutes on 2 cores); cached in $wheeldir"
        build=$(mktemp -d)
        "${PIP[@]}" download --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
        tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
        src="$build/horovod-$HOROVOD_VERSION"
        # The one install-time fix: torch >= 2.1 needs C++17.
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
            "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
        grep -q 'set(CMAKE_CXX_STANDARD 17)' "$src/CMakeLists.txt"
        grep -q 'set(CMAKE_CXX_STANDARD 17)' "$src/horovod/torch/CMakeLists.txt"
        mkdir -p "$wheeldir"
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS="-j$(nproc)" \
        PATH="$VENV/bin:$PATH" \
            "$PY" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps \
            -w "$build/out" "$src" > "$build/build.log" 2>&1 \
            || { tail -n 60 "$build/build.log" >&2; false; }
        cp "$build"/out/horovod-*.whl "$wheeldir/"
        rm -rf "$build"
    fi
    "${PIP[@]}" install --no-deps --force-reinstall "$wheeldir"/horovod-*.whl
fi

step "hvd_topk (editable)" "check setup.py"
"${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"

step "horovodrun --check-build lists PyTorch, MPI and Gloo" "rm -rf '$wheeldir' and re-run to rebuild"
check=$("$VENV/bin/horovodrun" --check-build)
for fw in "PyTorch" "MPI" "Gloo"; do
    grep -qE "\[X\] $fw" <<<"$check" || { echo "$check"; HINT="Horovod was built without $fw; rm -rf '$wheeldir' and re-run"; false; }
done
echo "$want" > "$STAMP"
echo "==> ready: $VENV (Horovod $HOROVOD_VERSION, torch $TORCH_VERSION, Python $pyver)"
