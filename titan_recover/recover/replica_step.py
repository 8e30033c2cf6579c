"""The trainer's side of replica groups: joining, the per-step gradient reduction, stopping cleanly.

Called from :class:`titan_recover.trainer.RecoverTrainer`'s hooks; TorchTitan's trainer does everything else.
Within a replica, gradients are reduced by FSDP2 over the replica's own (shard-only) mesh as usual; across
replicas, after the step's last microbatch, every rank sums its local gradient shards with the same position in
the other member replicas (:class:`~titan_recover.recover.replica_sync.ReplicaSync`) and divides by the number of
replicas that took part.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

import torch
from torch.distributed.tensor import DTensor

from titan_recover.recover.chaos import ChaosMonkey
from titan_recover.recover.events import EventLog
from titan_recover.recover.member import (
    COORDINATOR_ENV,
    Excluded,
    EXIT_EXCLUDED,
    REPLICA_ENV,
    ReplicaMember,
    TooFewReplicas,
)
from titan_recover.recover.replica_sync import ReplicaSync

logger = logging.getLogger(__name__)

RUN_DIR_ENV = "TITAN_RECOVER_RUN_DIR"
EXIT_TOO_FEW = 3


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_parameters(trainer) -> list[torch.Tensor]:
    return [_local(p.data) for m in trainer.model_parts for p in m.parameters()]


def attach_replica_sync(trainer) -> None:
    config = trainer.config
    for name in (REPLICA_ENV, COORDINATOR_ENV):
        if name not in os.environ:
            raise RuntimeError(
                f"[recover] replicas = {config.recover.replicas} but {name} is not set: start replica groups "
                "with ./run_train.sh (or see docs/replica_groups.md for multi-node launches)"
            )
    replica = int(os.environ[REPLICA_ENV])
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    run_dir = os.environ.get(RUN_DIR_ENV, config.dump_folder)
    events = EventLog(os.path.join(run_dir, "events.jsonl"), f"{replica}/{rank}", replica=replica, rank=rank)
    chaos = ChaosMonkey(config.chaos.schedule(config.recover.replicas, world), replica, rank, events)
    member = ReplicaMember(config.recover, replica=replica, rank=rank, ranks_per_replica=world,
                           address=os.environ[COORDINATOR_ENV])
    sync = ReplicaSync(config.recover, member, events, chaos)
    trainer.replica_sync = sync
    trainer.chaos = chaos
    trainer.metrics_processor.step_metrics_fn = lambda: step_metrics(sync)
    try:
        sync.start()
        sync.broadcast_from_lowest(local_parameters(trainer))
    except Excluded as excluded:
        logger.error("%s", excluded)
        os._exit(EXIT_EXCLUDED)

    def before_optimizer(*_args, **_kwargs):
        member.progress(phase="optimizer")
        chaos.maybe_inject(trainer.step, "optimizer")

    trainer.optimizers.register_step_pre_hook(before_optimizer)

    def on_output(_module, _inputs, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            def on_backward(grad):
                member.progress(phase="backward")
                chaos.maybe_inject(trainer.step, "backward")

            output.register_hook(on_backward)

    trainer.model_parts[-1].register_forward_hook(on_output)


def step_metrics(sync: ReplicaSync) -> dict[str, float]:
    metrics = {
        "recover/replicas": sync.participants,
        "recover/epoch": sync.epoch,
        "recover/reduce_s": sync.last_reduce_s,
    }
    if sync.recoveries:
        metrics.update({
            "recover/epoch_changes": len(sync.recoveries),
            "recover/detect_s": sum(r["detect_s"] for r in sync.recoveries),
            "recover/agree_s": sum(r["agree_s"] for r in sync.recoveries),
            "recover/rebuild_s": sum(r["build_s"] for r in sync.recoveries),
        })
    return metrics


def forward_backward_then_reduce(trainer, forward_backward) -> torch.Tensor:
    sync: ReplicaSync = trainer.replica_sync
    sync.member.progress(step=trainer.step, phase="forward")
    trainer.chaos.maybe_inject(trainer.step, "forward")
    loss = forward_backward()
    trainer._step_microbatches += 1
    trainer._step_local_loss += loss.detach().to(torch.float64).cpu().reshape(())
    if trainer._step_microbatches < trainer.gradient_accumulation_steps:
        return loss
    mean_loss = reduce_gradients(trainer, trainer._step_local_loss)
    # TorchTitan logs the sum of this step's returned losses: make that sum the mean over member replicas
    return loss + (mean_loss - trainer._step_local_loss).to(loss.dtype).to(loss.device)


def reduce_gradients(trainer, local_loss: torch.Tensor) -> torch.Tensor:
    """Sum gradients (and the loss) across member replicas, write back gradient / replicas; returns mean loss."""
    grads = [_local(p.grad) for m in trainer.model_parts for p in m.parameters() if p.grad is not None]
    flat = torch.cat([g.detach().reshape(-1).to(torch.float32) for g in grads]
                     + [local_loss.to(torch.float32).reshape(1)])
    start = time.perf_counter()
    summed, replicas = trainer.replica_sync.reduce(trainer.step, flat)
    trainer.replica_sync.last_reduce_s = time.perf_counter() - start  # for the step's metrics
    offset = 0
    with torch.no_grad():
        for g in grads:
            g.copy_(summed[offset : offset + g.numel()].view_as(g).div_(replicas).to(g.dtype))
            offset += g.numel()
    trainer.replica_sync.participants = replicas
    return summed[-1].to(torch.float64) / replicas


def parameter_digest(trainer) -> str:
    """sha256 of this rank's local parameter shards (bitwise identity across replicas, without copying)."""
    digest = hashlib.sha256()
    for t in local_parameters(trainer):
        digest.update(t.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def train_until_done_or_stopped(trainer, train) -> None:
    try:
        train()
        trainer.replica_sync.member.finish()
        trainer.replica_sync.events.emit("final_parameters", step=trainer.step, epoch=trainer.replica_sync.epoch,
                                         sha256=parameter_digest(trainer))
    except Excluded as excluded:
        logger.error("%s", excluded)
        os._exit(EXIT_EXCLUDED)
    except TooFewReplicas as stop:
        committed = trainer.step - 1  # the current step was not committed: parameters are those of step - 1
        trainer.step = committed
        saved = False
        if trainer.config.checkpoint.enable:
            trainer.checkpointer.save(curr_step=committed, last_step=True)
            saved = True
        folder = getattr(trainer.checkpointer, "folder", "checkpoint")
        where = (f"durable checkpoint of step {committed} in {folder}" if saved
                 else "no checkpoint written ([checkpoint] enable = false)")
        trainer.replica_sync.member.finish()
        trainer.replica_sync.events.emit("stopped", step=committed, reason=str(stop), checkpoint_saved=saved)
        logger.error("titan_recover: %s; %s", stop, where)
        raise SystemExit(EXIT_TOO_FEW) from None
