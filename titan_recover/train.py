"""Worker entry point, one per rank under torchrun: ``python -m titan_recover.train CONFIG.toml [overrides]``.

``./run_train.sh`` (through :mod:`titan_recover.launch`) starts these; on a multi-node cluster, run them with
torchrun yourself (see README). The config is rebuilt here from the same file and overrides, identically on every
rank, and checked against this job's world size before TorchTitan starts.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn


SEPARATE_ROUND_STORES_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torchrun's own opt-out of the store its agents share across rendezvous rounds: with it set to 1, every round's
node-rank-0 agent picks a fresh port and the round's rank 0 hosts a fresh store there. The launcher sets it for
every job torchrun restarts (``titan_recover.launch.torchrun_command``)."""


def fresh_store_after_restart(environ=os.environ) -> None:
    """torchrun's restarted workers connect to the agent's store, which outlives the failed round: the process-group
    keys of the dead workers (their gloo addresses) are still there, and a restarted rank that reads a peer's old
    address before the peer republished it connects to a dead port. With torchrun's stores separate per round
    (:data:`SEPARATE_ROUND_STORES_ENV`, as the launcher starts it) there is nothing to do. Otherwise (torchrun
    started by hand), on one node, after a restart, rank 0 hosts a fresh store for this round on a new port,
    announced through the agent's store under a key of this round; on many nodes the nodes' restart counts differ
    (a node whose workers are restarted because another node's failed counts no restart), so no such key is common
    to a round: a job that torchrun may restart is refused at its start with a sentence saying what to set."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    if environ.get("WORLD_SIZE", "1") != environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1")):
        if int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            raise RuntimeError(f"torchrun --max-restarts on several nodes needs {SEPARATE_ROUND_STORES_ENV}=1 in "
                               "torchrun's environment (a fresh store for every rendezvous round; ./run_train.sh "
                               "sets it): the restarted ranks would otherwise meet on the last round's keys")
        return
    attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        return
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    agent = TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=300))
    key = f"titan_recover/restart_{attempt}/master_port"
    if int(environ["RANK"]) == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            agent.set(key, str(probe.getsockname()[1]))
    environ["MASTER_PORT"] = agent.get(key).decode()
    environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts this round's store, the others join it
    print(f"[titan_recover] restart {attempt}: rank {environ['RANK']} uses this round's store on port "
          f"{environ['MASTER_PORT']}", file=sys.stderr, flush=True)


def place_replica_outputs(config) -> None:
    """A replica group's own outputs go under ``<run>/replica_<i>/``; the per-step metrics of all replicas go to
    ``<run>/metrics.jsonl`` (tagged with the replica) and the events to ``<run>/events.jsonl``. The durable
    checkpoints go to the run's folder (``<run>/<checkpoint.folder>``), shared by the groups: the project's checkpoint
    manager writes each checkpoint from one replica only (docs/replica_groups.md "Checkpoints"), and every group,
    a restarted one or the whole job started again, loads from there whichever replica wrote it. In sync mode the
members start no wandb run: node 0's launcher writes the job's one run from ``metrics.jsonl`` and
``events.jsonl``; a diloco learner still starts its own, in the job's group."""
    from torchtitan.tools import filesystem

    from titan_recover.checkpoint import RecoverCheckpointManager
    from titan_recover.recover.groups.member import REPLICA_ENV
    from titan_recover.recover.groups.member import RUN_DIR_ENV

    replica = int(os.environ[REPLICA_ENV])
    run_dir = os.path.abspath(os.environ.setdefault(RUN_DIR_ENV, os.path.abspath(config.dump_folder)))
    if isinstance(config.checkpoint, RecoverCheckpointManager.Config):  # another manager: a folder per group
        config.checkpoint.folder = filesystem.join(run_dir, config.checkpoint.folder)
    config.dump_folder = os.path.join(run_dir, f"replica_{replica}")
    if config.metrics.jsonl_file:
        config.metrics.jsonl_file = os.path.join(run_dir, config.metrics.jsonl_file)
    config.metrics.enable_wandb = False  # the job's one wandb run is node 0's launcher's (recover/job_log.py)


def main(argv: list[str] | None = None) -> NoReturn:
    """Train, then end the process with the run's exit code (:func:`~titan_recover.process_exit.leave`) while the
    trainer is still referenced: freeing it would run the destructors of past epochs' gloo groups, which wait for
    gloo's timeout on a dead peer."""
    from titan_recover.recover.notice import guard_rank, NoticeFile
    from titan_recover.recover.stop_request import listen

    listen()  # a stop request (SIGUSR1) from now on is noted, not the end of the process (recover/stop_request.py)
    # with a preemption grace, the node's notice (a SIGTERM to every process) is not this rank's end (recover/notice.py)
    guard_rank(NoticeFile.inherited(), who=f"titan_recover rank {os.environ.get('RANK', 0)}")
    argv = list(sys.argv[1:] if argv is None else argv)
    toml_path = argv.pop(0) if argv and not argv[0].startswith("--") else None

    from titan_recover.job_config import build_config
    from titan_recover.config.validate import check_batch, check_seed_checkpoint, resolve_layout

    config = build_config(toml_path, argv)
    layout = resolve_layout(config.parallelism, int(os.environ.get("WORLD_SIZE", "1")))
    check_batch(config.training, config.parallelism, layout)
    check_seed_checkpoint(config, layout.world_size)  # the launcher checked it too; a rank started another way
    if config.recover.enabled:
        place_replica_outputs(config)

    fresh_store_after_restart()
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    logger.info(f"titan_recover: {config.model_spec.name}/{config.model_spec.flavor}, {layout}")
    exit_code = run(config)
    from titan_recover.process_exit import leave

    leave(exit_code)


def run(config) -> int:
    """Build the trainer from ``config`` and train (or write the seed checkpoint); the process's exit code. The
    replica protocol's orderly stop (``SystemExit``, too few replicas left) gives its code. A lost store
    (``DistNetworkError``: a store request left unanswered past its bound, ``stores.bounded.BoundedStore``, or past
    etcd's timeout: the job's store's host gone or this one cut off from it; a store's connection closed) gives 1,
    after the traceback and one line saying so (:func:`store_lost`): the rank then ends through ``leave`` like
    any other, not through the interpreter's teardown with connections to a silent peer still open. Any other error
    propagates."""
    import torch
    from torch.distributed import DistNetworkError
    from torchtitan.tools.logging import logger

    trainer = None
    exit_code = 0
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except SystemExit as stop:  # the replica protocol's orderly stop (too few replicas left)
        exit_code = stop.code if isinstance(stop.code, int) else 1
    except DistNetworkError as lost:
        traceback.print_exc()
        print(store_lost(lost), file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return exit_code


def store_lost(error: BaseException, environ=os.environ) -> str:
    """The line a rank ends with after it lost a store: which rank, what went wrong, what now."""
    from titan_recover.recover.groups.member import REPLICA_ENV

    who = f"rank {environ.get('RANK', '0')}"
    if REPLICA_ENV in environ:
        who += f" of replica {environ[REPLICA_ENV]}"
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"[titan_recover] {who}: lost its connection to a store ({reason}); ending this rank (exit 1)"


if __name__ == "__main__":
    main()
