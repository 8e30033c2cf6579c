"""The SLURM batch scripts (scripts/slurm_train.sh, scripts/slurm_replicas.sh) run as sbatch would run them, with
SLURM's own commands replaced: ``scontrol`` names the allocation's nodes, ``srun`` starts its command once per node,
concurrently, with that node's ``SLURM_NODEID``. Every launcher gets ``--dry-run``: it does every check, prints what
it would start, and starts nothing, so these tests check what each node's launcher is told and that a bad config
stops every node before any training process, not SLURM itself (docs/deploy.md "SLURM")."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess  # one launcher process per fake node

ROOT = pathlib.Path(__file__).resolve().parents[1]

FAKE_SCONTROL = """\
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(f"node{i}" for i in range(int(__import__("os").environ["SLURM_NNODES"]))))
"""

# srun [options] COMMAND ...: options with a separate value, or --name=value; COMMAND once per node, concurrently.
FAKE_SRUN = """\
import os, subprocess, sys
args = sys.argv[1:]
nodes = int(os.environ["SLURM_NNODES"])
while args and args[0].startswith("-"):
    name = args.pop(0)
    if name in ("--nodes", "--ntasks", "--ntasks-per-node"):
        value = args.pop(0)
        nodes = int(value) if name == "--nodes" else nodes
print("srun " + " ".join(sys.argv[1:len(sys.argv) - len(args)]), flush=True)
procs = [subprocess.Popen(args, env=dict(os.environ, SLURM_NODEID=str(i)), stdout=subprocess.PIPE, text=True)
         for i in range(nodes)]
codes = []
for i, p in enumerate(procs):
    out, _ = p.communicate(timeout=120)
    print("".join(f"node{i}| {line}\\n" for line in out.splitlines()), end="", flush=True)
    codes.append(p.returncode)
sys.exit(max(codes))
"""


@pytest.fixture(scope="module")
def slurm_bin(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("slurm_bin")
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        path = folder / name
        path.write_text(f"#!{sys.executable}\n{text}")
        path.chmod(0o755)
    return folder


def sbatch(slurm_bin: pathlib.Path, script: str, *args: str, nodes: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{slurm_bin}:{os.environ['PATH']}", SLURM_NNODES=str(nodes),
               SLURM_JOB_NODELIST=f"node[0-{nodes - 1}]", SLURM_JOB_ID="4242", SLURM_GPUS_ON_NODE="2",
               SLURM_SUBMIT_DIR=str(ROOT), TITAN_RECOVER_VENV=sys.prefix)
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], env=env, cwd="/", capture_output=True,
                          text=True, timeout=240)


def node_lines(stdout: str, node: int) -> list[str]:
    return [line.split("| ", 1)[1] for line in stdout.splitlines() if line.startswith(f"node{node}| ")]


def test_slurm_train_starts_one_checked_launcher_per_node_joined_by_torchruns_rendezvous(slurm_bin, tmp_path):
    done = sbatch(slurm_bin, "slurm_train.sh", "train_configs/debug_model.toml", "--model.flavor", "tiny",
                  "--parallelism.data_parallel_shard_degree", "4", "--dump_folder", str(tmp_path), "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("srun --nodes 2 --ntasks 2 --ntasks-per-node 1 --kill-on-bad-exit=1"), done.stdout
    for node in range(2):
        (command,) = node_lines(done.stdout, node)  # the launcher's torchrun for this node, nothing started
        assert "-m titan_recover.torchrun --nproc-per-node=2 --nnodes=2 --rdzv-backend=c10d" in command
        assert "--rdzv-endpoint=node0:29500 --rdzv-id=4242" in command
        assert "--node-rank" not in command  # torchrun's c10d rendezvous orders the nodes itself
        assert command.endswith("--model.flavor tiny --parallelism.data_parallel_shard_degree 4 --dump_folder "
                                f"{tmp_path}"), command


def test_slurm_replicas_gives_each_node_its_block_of_the_replica_groups(slurm_bin, tmp_path):
    done = sbatch(slurm_bin, "slurm_replicas.sh", "train_configs/replicas.toml", "--model.flavor", "tiny",
                  "--recover.replicas", "3", "--parallelism.data_parallel_shard_degree", "1", "--nproc-per-node", "1",
                  "--dry-run", nodes=2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--kill-on-bad-exit=0" in done.stdout.splitlines()[0]
    assert "node 0 of 2: replica groups 0-1" in "\n".join(node_lines(done.stdout, 0)), done.stdout
    assert "node 1 of 2: replica group 2" in "\n".join(node_lines(done.stdout, 1)), done.stdout


def test_a_bad_config_stops_every_node_before_any_training_process(slurm_bin, tmp_path):
    done = sbatch(slurm_bin, "slurm_train.sh", "train_configs/debug_model.toml", "--training.stepz", "5",
                  "--dump_folder", str(tmp_path))  # no --dry-run: a config that passed would start torchrun
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("titan_recover: config error:") == 2 and "stepz" in done.stderr, done.stderr
    assert not node_lines(done.stdout, 0) and not node_lines(done.stdout, 1)
