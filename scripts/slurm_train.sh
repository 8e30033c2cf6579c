#!/usr/bin/env bash
# Multi-node training under SLURM: one torchrun per node, joined by torchrun's c10d rendezvous on the first node.
#   sbatch --nodes 8 --gpus-per-node 8 scripts/slurm_train.sh train_configs/llama3_70b.toml [--section.key value ...]
#SBATCH --job-name=titan_recover
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
config="${1:?usage: sbatch scripts/slurm_train.sh CONFIG.toml [overrides]}"
shift
root="${SLURM_SUBMIT_DIR:-$(pwd)}"
source "$root/scripts/bootstrap.sh"
head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
gpus="${SLURM_GPUS_ON_NODE:-8}"
srun --kill-on-bad-exit=1 "$PY" -m titan_recover.torchrun \
  --nnodes "$SLURM_NNODES" --nproc-per-node "$gpus" \
  --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" --rdzv-endpoint "$head_node:29500" \
  -m titan_recover.train "$config" "$@"
