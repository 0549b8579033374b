#!/usr/bin/env bash
# The test suite: install what is missing, then pytest (single-process and real multi-rank jobs).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` (the fast loop).
# --timeout: one test that hangs costs 15 minutes, not the run; --durations: the 15 slowest, so that
# the suite's budget stays visible.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/install.sh"
cd "$ROOT"
exec "${HVD_TOPK_VENV:-$ROOT/.venv}/bin/python" -m pytest -ra --timeout=900 --durations=15 tests bench/tests "$@"
