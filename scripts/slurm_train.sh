#!/usr/bin/env bash
# Multi-node training without replica groups under SLURM: one launcher per node (./run_train.sh = python -m
# titan_recover.launch), each started by srun with this node's rank; the launchers' torchruns join through torchrun's
# c10d rendezvous on the first node. Every launcher checks the config first (a bad one exits 2 on every node before
# any training process starts), prepares the default data where missing, and runs this node's snapshot keeper where
# [recover.snapshot] asks for one.
#   sbatch --nodes 8 --gpus-per-node 8 scripts/slurm_train.sh train_configs/llama3_70b.toml [--section.key value ...]
# Environment: RDZV_PORT (default 29500: a free port on the first node, reachable from every node). The run id is
# $SLURM_JOB_ID (it names the job's in-memory snapshots, docs/phoenix.md).
# Three minutes before the time limit SLURM sends SIGUSR1 to this script's process (srun, after the exec below), which
# passes it to every node's launcher: every rank stops after the same step with a checkpoint of it, exit 138
# (docs/deploy.md "Stopping with a checkpoint").
# At a preemption SLURM sends SIGTERM to every process of the job: with [recover] preemption_grace_s > 0 (below
# the partition's GraceTime) that is meant to stop it with a checkpoint too, exit 143; not yet run under SLURM
# (docs/deploy.md "Preemption").
#SBATCH --job-name=titan_recover
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=B:USR1@180
set -euo pipefail
config="${1:?usage: sbatch scripts/slurm_train.sh CONFIG.toml [overrides]}"
shift
root="${SLURM_SUBMIT_DIR:-$(pwd)}"
source "$root/scripts/bootstrap.sh"
nodes="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"  # whole: a pipe into head could end scontrol by SIGPIPE
head_node="${nodes%%$'\n'*}"
gpus="${SLURM_GPUS_ON_NODE:-8}"
cd "$root"
# One task per node. No --node-rank: torchrun's c10d rendezvous orders the nodes itself (it ignores a node rank).
exec srun --nodes "$SLURM_NNODES" --ntasks "$SLURM_NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 \
  "$PY" -m titan_recover.launch "$config" --nnodes "$SLURM_NNODES" --nproc-per-node "$gpus" \
  --rdzv-endpoint "$head_node:${RDZV_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID" "$@"
