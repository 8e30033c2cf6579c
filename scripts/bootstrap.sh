#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) with everything installed.
# Idempotent: a second run only compares a stamp and returns in well under a second.
# Usage: source scripts/bootstrap.sh   (sets $PY to the venv's python)
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${TITAN_RECOVER_VENV:-$_root/.venv}"
_stamp="$_venv/.titan_recover_installed"
_want="$(cat "$_root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$_venv/bin/python" ]; then
  echo "[bootstrap] creating virtual environment in $_venv" >&2
  python3 -m venv "$_venv"
fi
if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
  echo "[bootstrap] installing titan_recover and its dependencies (first run: a few minutes)" >&2
  "$_venv/bin/python" -m pip install -q --upgrade pip >&2
  "$_venv/bin/python" -m pip install -q -e "$_root[test]" >&2
  echo "$_want" > "$_stamp"
fi
PY="$_venv/bin/python"
export PY
