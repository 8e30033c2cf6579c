#!/usr/bin/env bash
# Train from a TOML config. Sets up .venv on first use, prepares the default data on first use.
#
#   ./run_train.sh                                   # train_configs/debug_model.toml
#   ./run_train.sh train_configs/hsdp.toml           # another config
#   ./run_train.sh --training.steps 50               # override any key, TorchTitan's --section.key form
#   CONFIG_FILE=train_configs/tp.toml ./run_train.sh --print-config
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
config="${CONFIG_FILE:-train_configs/debug_model.toml}"
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then
  config="$1"
  shift
fi
config="$(realpath "$config" 2>/dev/null || echo "$config")"
source "$root/scripts/bootstrap.sh"
cd "$root"
exec "$PY" -m titan_recover.launch "$config" "$@"
