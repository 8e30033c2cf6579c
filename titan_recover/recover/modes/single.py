"""``single`` and ``checkpoint_restart``: TorchTitan's own step, with fault injection and in-memory snapshots.

``single`` is a job without replica groups (``[recover] replicas = 1``): faults scheduled in ``[chaos]`` fire at
its phases and, with ``[recover.snapshot] interval``, every rank's state goes to a keeper's memory after each
interval (restored by the checkpoint manager when torchrun restarts the job, docs/phoenix.md).
``checkpoint_restart`` is the baseline of docs/evidence.md: the replica groups are TorchTitan's replicated
data-parallel dimension, so events and faults name a rank by (replica, rank) as in the replica-group job.
Both stop with a checkpoint of the current step when asked by ``SIGUSR1`` (a scheduler's warning before the time
limit), or by ``SIGTERM`` with ``[recover] preemption_grace_s`` (:mod:`~titan_recover.recover.stop_request`).
"""

from __future__ import annotations

import os
import time

import torch

from titan_recover import platform
from titan_recover.recover.chaos.monkey import ChaosMonkey
from titan_recover.recover.events import EventLog
from titan_recover.recover.groups.member import incarnation_from_env
from titan_recover.recover.modes.base import Mode, register_mode, Stop, TrainerParts
from titan_recover.recover.stop_request import describe, listen, StopAgreement, stopped_marker


def forward_backward_with_faults(parts: TrainerParts, chaos: ChaosMonkey | None, step: int, batch: dict):
    """TorchTitan's forward and backward of one microbatch, with the faults scheduled at phase ``forward`` fired
    before it and a ``slow`` rank's delay after it (measured on the device's clock: its work done)."""
    if chaos is None:
        return parts.forward_backward(**batch)
    chaos.maybe_inject(step, "forward")
    if chaos.slowed:
        platform.synchronize(parts.device)
    start = time.perf_counter()
    loss = parts.forward_backward(**batch)
    if chaos.slowed:
        platform.synchronize(parts.device)
    chaos.after_compute(time.perf_counter() - start)  # a ``slow`` rank sleeps here
    return loss


@register_mode("single")
class SingleMode(Mode):
    def __init__(self, config, *, parts: TrainerParts):
        super().__init__(config, parts=parts)
        world = torch.distributed.get_world_size()
        groups, replica, rank = self.replica_and_rank(torch.distributed.get_rank(), world)
        self.events = EventLog(os.path.join(config.dump_folder, "events.jsonl"), f"{replica}/{rank}",
                               replica=replica, rank=rank)
        self.step = 0
        self._started = False
        self.chaos = None
        schedule = config.chaos.schedule(groups, world // groups)
        if schedule:
            self.chaos = ChaosMonkey(schedule, replica, rank, self.events, incarnation=incarnation_from_env(),
                                     run_dir=config.dump_folder)
            parts.optimizers.register_step_pre_hook(lambda *_: self.chaos.maybe_inject(self.step, "optimizer"))
        # the checkpoint manager built the snapshots (it restores them when TorchTitan loads); a snapshot being
        # copied must be through before the optimizer changes what it copies
        self.snapshots = getattr(parts.checkpointer, "snapshots", None)
        if self.snapshots is not None:
            parts.optimizers.register_step_pre_hook(lambda *_args, **_kwargs: self.snapshots.before_optimizer())
        self.stop_signal, self.stop_agreement = listen(), StopAgreement(parts.device)
        self.stop_after: int | None = None
        """The step the ranks agreed to stop after (a stop request), or None."""

    def replica_and_rank(self, rank: int, world: int) -> tuple[int, int, int]:
        """``(groups, replica, rank in the replica)`` this rank's events and faults are named by."""
        return 1, 0, rank

    def train_step(self, step: int, titan_step) -> None:
        self.step = step
        if not self._started:  # a (re)start of the job, and the step it resumed from
            self.events.emit("training_started", console=False, resumed_from=step - 1,
                             incarnation=incarnation_from_env())
            self._started = True
        titan_step()
        if self.snapshots is not None and step % self.config.recover.snapshot.interval == 0:
            self.snapshots.take(step)
        if self.stop_agreement.poll(self.stop_signal.requested) and self.stop_after is None:
            self.stop_after = step

    def should_continue(self, scheduled: bool) -> bool:
        return scheduled and self.stop_after is None

    def train(self, run) -> Stop | None:
        """TorchTitan's loop; after a stop request every rank agreed on, a stop with a checkpoint of that step
        (exit 0 for torchrun, which would otherwise restart the job; its wrapper exits 128 + the signal)."""
        run()
        if self.stop_after is None or self.stop_after >= self.config.training.steps:
            return None  # the budget was trained (a request at the last step changes nothing)
        marker = stopped_marker()
        if marker is not None:  # the agent exits 138 (stopped), not 0 (trained)
            open(marker, "a").close()
        reason = f"stop requested ({describe(self.stop_signal.cause)}): stopping after step {self.stop_after}"
        ntokens_seen = self.parts.train_state.state_dict()["ntokens_seen"]
        return Stop(step=self.stop_after, ntokens_seen=ntokens_seen, reason=reason,
                    save=bool(self.config.checkpoint.enable), exit_code=0)

    def stopped(self, stop: Stop, checkpoint_saved: bool) -> None:
        folder = getattr(self.parts.checkpointer, "folder", "checkpoint")
        where = (f"checkpoint of step {stop.step} in {folder}: the job resumes from it" if checkpoint_saved else
                 "no checkpoint written (enable [checkpoint] to resume from the step a stop ends at)")
        self.events.emit("stopped", step=stop.step, reason=stop.reason, checkpoint_saved=checkpoint_saved)
        print(f"[titan_recover] {stop.reason}; {where}", flush=True)

    def forward_backward(self, step: int, **batch) -> torch.Tensor:
        return forward_backward_with_faults(self.parts, self.chaos, step, batch)

    def close(self) -> None:
        if self.snapshots is not None:
            self.snapshots.wait()  # a send thread still inside the store client at exit would abort the process


@register_mode("checkpoint_restart")
class CheckpointRestartMode(SingleMode):
    def replica_and_rank(self, rank: int, world: int) -> tuple[int, int, int]:
        from titan_recover.config.validate import resolve_layout

        replica, rank_in_replica = resolve_layout(self.config.parallelism, world).replica_and_rank(rank)
        return self.config.recover.replicas, replica, rank_in_replica
