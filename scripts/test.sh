#!/usr/bin/env bash
# Run the test suite (sets up .venv on first use). Extra arguments go to pytest, e.g.
#   ./scripts/test.sh tests/test_config.py -x
#   ./scripts/test.sh -m "not multiprocess"      # the fast tier only
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/bootstrap.sh"
"$root/scripts/ensure_etcd.sh"
cd "$root"
exec "$PY" -m pytest "$@"
