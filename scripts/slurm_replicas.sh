#!/usr/bin/env bash
# Replica groups across nodes under SLURM: one launcher per node (./run_train.sh = python -m titan_recover.launch),
# each started by srun with this node's rank. Node 0 hosts the job's store at $head:$port (unless
# [recover] store = "etcd://...") and runs the coordinator; node i runs its contiguous block of the replica groups
# (recover.replicas + recover.spares over the nodes, the first ones one more; at most one node per group). Every
# launcher exits with the job's verdict (docs/deploy.md "Running on many nodes").
#   sbatch --nodes 2 --gpus-per-node 8 scripts/slurm_replicas.sh train_configs/replicas.toml [--section.key value ...]
# Environment: STORE_PORT (default 29600: a free port on the first node, reachable from every node), RUN_DIR (the
# run folder, on a file system every node shares; default outputs/<config name>).
# Three minutes before the time limit SLURM sends SIGUSR1 to this script's process (srun, after the exec below), which
# passes it to every node's launcher: the job stops with a durable checkpoint of its last committed step, exit 138.
# At a preemption SLURM sends SIGTERM to every process of the job: with [recover] preemption_grace_s > 0 (below
# the partition's GraceTime) that is meant to stop it with a checkpoint too, exit 143; not yet run under SLURM
# (docs/deploy.md "Preemption").
#SBATCH --job-name=titan_recover_replicas
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=B:USR1@180
set -euo pipefail
config="${1:?usage: sbatch scripts/slurm_replicas.sh CONFIG.toml [overrides]}"
shift
root="${SLURM_SUBMIT_DIR:-$(pwd)}"
source "$root/scripts/bootstrap.sh"
nodes="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"  # whole: a pipe into head could end scontrol by SIGPIPE
head="${nodes%%$'\n'*}"
port="${STORE_PORT:-29600}"
run_dir="${RUN_DIR:-$root/outputs/$(basename "$config" .toml)}"
mkdir -p "$run_dir"
cd "$root"
# One task per node; SLURM_NODEID is the node's rank inside the allocation (0 on $head). The single quotes keep
# $SLURM_NODEID for the task's own shell.
exec srun --nodes "$SLURM_NNODES" --ntasks "$SLURM_NNODES" --ntasks-per-node 1 --kill-on-bad-exit=0 \
  bash -c 'exec "$0" -m titan_recover.launch "$@" --node-rank "$SLURM_NODEID"' \
  "$PY" "$config" --nnodes "$SLURM_NNODES" --rdzv-endpoint "$head:$port" --dump_folder "$run_dir" "$@"
