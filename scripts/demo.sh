#!/usr/bin/env bash
# The main job: install what is missing, then digits CNN on 2 ranks, dense Horovod vs. TopKEF 0.01.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/install.sh"
cd "$ROOT"
exec "${HVD_TOPK_VENV:-$ROOT/.venv}/bin/python" -m bench demo "$@"
