#!/usr/bin/env bash
# Replica groups across nodes under SLURM: the coordinator on the first node, one torchrun per replica group,
# each replica group on its own node(s). Replicas find the coordinator by address; nothing else is shared.
#   sbatch --nodes 4 --gpus-per-node 8 scripts/slurm_replicas.sh train_configs/replicas.toml [--section.key value ...]
# With R = nodes / nodes_per_replica replica groups; set [recover] replicas = R and a fixed coordinator_port.
#SBATCH --job-name=titan_recover_replicas
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
config="${1:?usage: sbatch scripts/slurm_replicas.sh CONFIG.toml [overrides]}"
shift
root="${SLURM_SUBMIT_DIR:-$(pwd)}"
source "$root/scripts/bootstrap.sh"
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head="${nodes[0]}"
port="${COORDINATOR_PORT:-29600}"
gpus="${SLURM_GPUS_ON_NODE:-8}"
nodes_per_replica="${NODES_PER_REPLICA:-1}"
replicas=$(( ${#nodes[@]} / nodes_per_replica ))
run_dir="${RUN_DIR:-$root/outputs/$(basename "$config" .toml)}"
mkdir -p "$run_dir"
export TITAN_RECOVER_RUN_DIR="$run_dir" TITAN_RECOVER_COORDINATOR="$head:$port" TORCH_GLOO_LAZY_INIT=1

srun --nodes 1 --ntasks 1 -w "$head" --overlap "$PY" -m titan_recover.recover.groups.coordinator \
  --replicas "$replicas" --ranks-per-replica $(( gpus * nodes_per_replica )) --run-dir "$run_dir" \
  --host 0.0.0.0 --port "$port" &
coordinator=$!

pids=()
for (( i = 0; i < replicas; i++ )); do
  group=("${nodes[@]:$(( i * nodes_per_replica )):$nodes_per_replica}")
  hosts=$(IFS=,; echo "${group[*]}")
  TITAN_RECOVER_REPLICA=$i srun --nodes "$nodes_per_replica" --ntasks "$nodes_per_replica" -w "$hosts" \
    "$PY" -m torch.distributed.run --nnodes "$nodes_per_replica" --nproc-per-node "$gpus" \
    --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID-$i" --rdzv-endpoint "${group[0]}:29500" \
    -m titan_recover.train "$config" --recover.coordinator_port "$port" --dump_folder "$run_dir" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
kill "$coordinator" 2>/dev/null || true
exit $status
