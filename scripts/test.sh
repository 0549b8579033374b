#!/usr/bin/env bash
# The test suite: install what is missing, then pytest (single-process and real multi-rank jobs).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/install.sh"
cd "$ROOT"
exec "${HVD_TOPK_VENV:-$ROOT/.venv}/bin/python" -m pytest -ra --timeout=1200 tests "$@"
