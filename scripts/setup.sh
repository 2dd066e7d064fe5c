#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with torch (CPU build
# first, so no multi-GB CUDA wheel is pulled) and Tartlet installed editable
# with its test extras. Re-runs are fast: pip is skipped while pyproject.toml
# is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "Tartlet needs Python 3.11+"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.tartlet-setup
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
# pip's output (and the build backend's notes, such as setuptools' "Editable
# installation" notice) is shown only when a step fails.
quiet() {
  local log; log=$(mktemp)
  if "$@" >"$log" 2>&1; then rm -f "$log"; else local rc=$?; cat "$log" >&2; rm -f "$log"; return $rc; fi
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip show torch >/dev/null 2>&1 || quiet .venv/bin/python -m pip install -q torch==2.13.0
  quiet .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
