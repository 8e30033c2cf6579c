"""``[recover] mode = "sync"``: replica groups that commit the failure-free global batch at every step.

The mode joins the replica groups (docs/replica_groups.md), makes the parameters equal to the lowest member
replica's, and runs every step itself (docs/invariant.md, docs/architecture.md): the step recovery manager computes
this replica's quota of the step's microbatch ids through the :class:`ReplicaWorker` (TorchTitan's own forward and
backward), the ids of replicas lost during the step, and the reduction with its commit; the committed gradient
goes into ``.grad``; then the rest of TorchTitan's step (clipping, optimizer, schedule, logging) runs as TorchTitan
runs it, except that the clip's total norm is formed deterministically (every replica clips by the same bits) and
``drop`` skips the optimizer on a discarded step.
"""

from __future__ import annotations

from functools import partial
import logging
import math
import os

import torch

from titan_recover import platform

platform.activate()  # before any TorchTitan module that copies the device globals

from torchtitan.distributed import utils as dist_utils  # noqa: E402

from titan_recover.recover.chaos.monkey import ChaosMonkey  # noqa: E402
from titan_recover.recover.events import EventLog  # noqa: E402
from titan_recover.recover.groups.member import (  # noqa: E402
    COORDINATOR_ENV,
    Excluded,
    EXIT_EXCLUDED,
    incarnation_from_env,
    JobOver,
    REPLICA_ENV,
    replica_group_store,
    ReplicaMember,
    RUN_DIR_ENV,
    TooFewReplicas,
)
from titan_recover.recover.groups.keys import newest_published  # noqa: E402
from titan_recover.recover.groups.protocol import active_replicas  # noqa: E402
from titan_recover.recover.groups.replica_sync import ReplicaSync  # noqa: E402
from titan_recover.recover.groups.stop_checkpoint import candidates, SAVED, StopCheckpoint  # noqa: E402
from titan_recover.recover.invariant import grad_norm  # noqa: E402
from titan_recover.recover.invariant.step_recovery import STEP_MANAGERS, StepOutcome  # noqa: E402
from titan_recover.recover.modes.base import Mode, register_mode, StepReport, Stop, TrainerParts  # noqa: E402
from titan_recover.recover.modes.final_parameters import (  # noqa: E402
    parameter_digest,
    save_final_optimizer_state,
    save_final_parameters,
)
from titan_recover.recover.modes.replica_worker import ComputeHooks, local_parameters, ReplicaWorker  # noqa: E402
from titan_recover.recover.phoenix.admission import Admission  # noqa: E402
from titan_recover.recover.phoenix.state_transfer import local_tensor, TrainingState  # noqa: E402
from titan_recover.recover.scout.beacon import Beacon, beacon_path  # noqa: E402
from titan_recover.recover.scout.localize import Localizer  # noqa: E402
from titan_recover.recover.scout.verified import mark_verified, verifies_previous  # noqa: E402

logger = logging.getLogger(__name__)

EXIT_STOPPED = 0
"""Exit code of a rank that stopped because the protocol said so (too few replicas, no coordinator, replicas that
disagree): it did what it was asked, and torchrun reports no failure of its own. The job's verdict is the
launcher's exit code, from the store (docs/replica_groups.md "Processes")."""


def replica_environment(config) -> tuple[int, str, str]:
    """``(replica, coordinator address, run folder)`` the launcher gave this process."""
    for name in (REPLICA_ENV, COORDINATOR_ENV):
        if name not in os.environ:
            raise RuntimeError(
                f"[recover] replicas = {config.recover.replicas} with mode = {config.recover.mode!r} but {name} is "
                "not set: start replica groups with ./run_train.sh (or see docs/replica_groups.md for multi-node "
                "launches)"
            )
    return int(os.environ[REPLICA_ENV]), os.environ[COORDINATOR_ENV], os.environ.get(RUN_DIR_ENV, config.dump_folder)


@register_mode("sync")
class SyncMode(Mode):
    def __init__(self, config, *, parts: TrainerParts):
        super().__init__(config, parts=parts)
        from titan_recover.data.loader import AddressableDataLoader

        recover = config.recover
        if not isinstance(parts.dataloader, AddressableDataLoader):
            raise ValueError(
                f"[recover] replicas = {recover.replicas} needs the addressable data loader (any replica computes "
                f"any microbatch by id), got {type(parts.dataloader).__name__}; use the project's [dataloader] "
                "(dataset_path = a folder prepared by python -m titan_recover.data.prepare)"
            )
        self.replica, address, self.run_dir = replica_environment(config)
        self.rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.step = 0
        self.committed_tokens = 0
        """Tokens of the global batches committed before the step being trained."""
        self.stop_turns: StopCheckpoint | None = None
        """After a stop that saves a checkpoint: who writes it, in turn (:meth:`_stop_turns`)."""
        self.previous_writer: int | None = None
        """The replica that wrote the checkpoint of the step before the one being trained, if it saved one (None
        before this process's first commit)."""
        incarnation = incarnation_from_env()
        self.events = EventLog(os.path.join(self.run_dir, "events.jsonl"), f"{self.replica}/{self.rank}",
                               replica=self.replica, rank=self.rank)
        self.chaos = ChaosMonkey(config.chaos.schedule(recover.groups, world), self.replica, self.rank, self.events,
                                 incarnation=incarnation, run_dir=self.run_dir)
        self.member = ReplicaMember(recover, replica=self.replica, rank=self.rank, ranks_per_replica=world,
                                    address=address, incarnation=incarnation,
                                    group_store=partial(replica_group_store, recover.agree_timeout_s) if world > 1
                                    else None)
        if recover.localize.hang_threshold_s > 0:  # read by the replica's hang observer (docs/scout.md)
            self.member.beacon = Beacon(beacon_path(self.run_dir, self.replica, self.rank, incarnation))
        self.sync = ReplicaSync(recover, self.member, self.events, self.chaos, final_step=config.training.steps,
                                device=parts.device)
        self.admission = Admission(self.sync)
        self._build_step(recover, world)
        self._install_fault_points()

    def _build_step(self, recover, world: int) -> None:
        """The worker, the localizer and the step recovery manager of this rank."""
        parts = self.parts
        self.per_step = recover.quota.microbatches or recover.replicas * parts.gradient_accumulation_steps
        chaos, member = self.chaos, self.member
        hooks = ComputeHooks(before=lambda step: (member.progress(step=step, phase="forward"),
                                                  chaos.maybe_inject(step, "forward")),
                             after_backward=chaos.after_backward,
                             after=lambda _step, seconds: chaos.after_compute(seconds),
                             timed=lambda: chaos.slowed)
        self.worker = ReplicaWorker(parts, per_step=self.per_step, exact=recover.quota.exact, hooks=hooks,
                                    reports_final=recover.step.overlap_reduction)
        self.localizer = None
        if recover.localize.witnesses:
            self.localizer = Localizer(recover.localize, replica=self.replica, rank=self.rank,
                                       groups=recover.groups, events=self.events)
        self._all_reduce_max = chaos.collective(self._replica_all_reduce_max)
        self.recovery = STEP_MANAGERS.get(recover.step.manager)(
            recover.quota, config=recover.step, replica=self.replica, groups=recover.groups,
            active=recover.replicas, per_step=self.per_step, sync=self.sync, worker=self.worker,
            agree_speed=self._agree_speed if world > 1 else None, localizer=self.localizer,
            signature=self.worker.state_signature,
            dtype=torch.float64 if recover.quota.exact else torch.float32,
        )
        self.state = TrainingState(parts.model_parts, list(parts.optimizers), parts.lr_schedulers,
                                   train_state=parts.train_state, extra={"quota": self.recovery})

    def _install_fault_points(self) -> None:
        """Liveness and fault injection at the phases TorchTitan's components expose hooks for."""
        parts, chaos, member = self.parts, self.chaos, self.member

        def before_optimizer(*_args, **_kwargs):
            member.progress(phase="optimizer")
            chaos.maybe_inject(self.step, "optimizer")

        parts.optimizers.register_step_pre_hook(before_optimizer)

        def on_output(_module, _inputs, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                def on_backward(_grad):
                    member.progress(phase="backward")
                    chaos.maybe_inject(self.step, "backward")

                output.register_hook(on_backward)

        parts.model_parts[-1].register_forward_hook(on_output)
        chaos.tensors["parameter"] = lambda: local_parameters(parts.model_parts)
        chaos.tensors["gradient"] = lambda: [local_tensor(p.grad) if p.grad is not None else None
                                             for m in parts.model_parts for p in m.parameters()]
        if any(f.kind == "bitflip" and f.target == "activation" for f in chaos.mine):
            # only when scheduled: no hook on every forward of a run without activation flips
            first_layer = next(m for m in parts.model_parts[0].children())
            first_layer.register_forward_hook(
                lambda _module, _inputs, output: chaos.on_activation(local_tensor(output))
                if isinstance(output, torch.Tensor) else None)

    def start(self, step: int) -> int:
        """Register with the coordinator; a member of epoch 0 starts from the lowest member replica's parameters
        (a restarted replica receives the whole state at its first step instead)."""
        try:
            self.sync.start()
            if not self.sync.joining:
                self.sync.broadcast_from_lowest(local_parameters(self.parts.model_parts))
        except Excluded as excluded:
            logger.error("%s", excluded)
            os._exit(EXIT_EXCLUDED)
        except TooFewReplicas as stop:  # the job stopped before this start trained a step: nothing to save
            logger.error("stopping before training: %s", stop)
            self.events.emit("stopped", step=step, reason=str(stop), checkpoint_saved=False)
            self.member.finish()
            raise SystemExit(EXIT_STOPPED) from None
        return step

    # ---- collectives inside the replica --------------------------------------------------------------------
    def _replica_all_reduce_max(self, tensor: torch.Tensor) -> None:
        beacon = self.member.beacon
        if beacon is None:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
            return
        with beacon.collective("all_reduce(max)", "replica", tensor.shape):
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
            # on NCCL the call returns once the collective is queued: the rank is inside it until it completed (a
            # hang observer that saw it leave at once would take its wait for a stalled rank elsewhere)
            platform.synchronize(tensor.device)

    def _agree_speed(self, speed: float) -> float:
        """The replica's speed as one number on all its ranks (their timings differ slightly)."""
        self.chaos.maybe_inject(self.step, "collective")
        t = torch.tensor([speed], dtype=torch.float64, device=self.parts.device)
        self._all_reduce_max(t)
        return float(t[0].item())

    # ---- the step ------------------------------------------------------------------------------------------
    def local_batches(self, step: int):
        raise RuntimeError("mode \"sync\" runs its own step and fetches microbatches by id (ReplicaWorker); "
                           "TorchTitan's batch iterator is never read")

    def train_step(self, step: int, titan_step) -> StepReport:
        self.step = step  # the step being trained (a stop during the admission below returns to step - 1)
        self.committed_tokens = self.parts.train_state.state_dict()["ntokens_seen"]
        # a replica admitted after the previous commit receives the state now (a joiner: its whole state, which
        # moves the trainer's step and tokens to the donors')
        self.admission.admit_pending(step, self.state)
        train_state = self.parts.train_state.state_dict()
        self.committed_tokens = train_state["ntokens_seen"]
        step = self.step = train_state["step"]
        parts = self.parts
        parts.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        lr_metrics = parts.lr_schedulers.get_metrics()
        self.worker.begin_step(step)
        outcome = self.recovery.run(step)
        writer = self._checkpoint_writer()
        if writer:
            self._note_verified(step)
        self.previous_writer = min(self.sync.committed_members)
        self.worker.write_gradient(outcome.reduced.gradient, self.per_step / outcome.committed)
        grad_norm = self._optimizer_step(step, outcome)
        tokens = train_state["ntokens_seen"] + outcome.committed * self.worker.tokens_per_microbatch
        if parts.metrics_processor.should_log(step):
            self._log(step, outcome, grad_norm, {"n_tokens_seen": tokens, **lr_metrics})
        now = self.sync.checkpoint_requested and self.config.checkpoint.enable
        if now and writer:  # the trainer writes it next (StepReport.checkpoint_now)
            self.events.emit("checkpoint_on_request", step=step)
        return StepReport(ntokens_seen=tokens, checkpoint_writer=writer, checkpoint_now=now)

    def _checkpoint_writer(self) -> bool:
        """This replica writes the durable checkpoint of the step just committed, and its verification record:
        the lowest member of the epoch that committed it. Every member holds the same bytes after a commit, so one
        copy is enough; its ranks each write their shard, as TorchTitan's DCP does, into the run's checkpoint
        folder, shared by the replica groups (docs/replica_groups.md "Checkpoints")."""
        return self.replica == min(self.sync.committed_members)

    def _stop_turns(self, step: int) -> StopCheckpoint:
        """At a stop: who writes the stop's checkpoint of ``step``, in turn: those left in the epoch the coordinator
        formed with the stop (published before the stop itself, so every survivor reads the same one) that hold the
        last committed state, lowest first (:func:`~titan_recover.recover.groups.stop_checkpoint.candidates`)."""
        epoch = newest_published(self.member.store, self.sync.epoch)
        turns = candidates(self.member.members_of(epoch), self.sync.committed_members)
        return StopCheckpoint(self.member.store, step=step, candidates=turns, replica=self.replica, rank=self.rank,
                              stall_timeout_s=self.config.recover.agree_timeout_s)

    def _optimizer_step(self, step: int, outcome: StepOutcome) -> torch.Tensor:
        """Clip, step the optimizer and the schedule, as TorchTitan's ``Trainer.train_step`` does; ``drop``
        discards a step that saw a failure, as torchft does: no optimizer update at all. The clip is TorchTitan's
        with the total norm formed from exact per-rank partials (``invariant/grad_norm.py``), so that every
        replica clips the committed gradient by the same bits (docs/invariant.md)."""
        parts = self.parts
        norm = grad_norm.clip_grad_norm_([p for m in parts.model_parts for p in m.parameters()],
                                         self.config.training.max_norm, foreach=True, device=parts.device)
        parts.checkpointer.maybe_wait_for_staging()
        if outcome.discarded:
            self.events.emit("step_discarded", step=step, epoch=self.sync.epoch, microbatches=outcome.committed)
        else:
            parts.optimizers.step()
        parts.lr_schedulers.step()
        return norm

    def _log(self, step: int, outcome: StepOutcome, grad_norm: torch.Tensor, extra: dict) -> None:
        """TorchTitan's step log: the committed batch's mean token loss, the largest mean loss of a rank's share
        (over what each replica computed, then over the replica's ranks, as TorchTitan's ``global_max_loss`` over
        data-parallel ranks) and the global tokens seen; plus this mode's ``recover/*`` metrics."""
        parts, reduced = self.parts, outcome.reduced
        # float32, as TorchTitan logs it; the values are on the host already (the reduced buffer)
        loss = torch.tensor(reduced.loss * self.per_step / outcome.committed, dtype=torch.float32)
        max_loss = torch.tensor(max(reduced.losses), dtype=torch.float32)
        if parts.parallel_dims.dp_cp_enabled:  # this rank's share: sum and max over the replica's ranks
            loss_mesh = parts.parallel_dims.get_optional_mesh("loss")
            avg = dist_utils.dist_sum(loss.to(parts.device), loss_mesh)
            top = dist_utils.dist_max(max_loss.to(parts.device), loss_mesh)
        else:
            avg, top = float(loss), float(max_loss)
        if not math.isfinite(avg):
            raise RuntimeError(f"Loss is not finite (global_avg_loss={avg}) at step {step}. Stopping training.")
        parts.metrics_processor.log(step, avg, top, float(grad_norm.item()),
                                    extra_metrics={**extra, **self.metrics(outcome)})

    def _note_verified(self, step: int) -> None:
        """This step committed after a clean parameter vote, which read the state saved at the previous step:
        that checkpoint is verified if its writer voted (docs/scout.md). Called on the checkpoint writer only (one
        record per run)."""
        checkpoint, localizer = self.config.checkpoint, self.localizer
        if (checkpoint.enable and localizer is not None and localizer.config.vote and self.rank == 0
                and verifies_previous(step, checkpoint.interval, localizer.clean, self.previous_writer,
                                      self.sync.committed_members)):
            mark_verified(self.parts.checkpointer.folder, step - 1)
            self.events.emit("checkpoint_verified", step=step - 1)

    def metrics(self, outcome: StepOutcome) -> dict[str, float]:
        sync, groups = self.sync, self.config.recover.groups
        metrics = {
            "recover/replicas": outcome.participants,
            "recover/epoch": sync.epoch,
            "recover/microbatches": outcome.committed,
            "recover/tokens": outcome.committed * self.worker.tokens_per_microbatch,
            "recover/recomputed": outcome.recomputed,
            "recover/computed_here": outcome.mine,
            "recover/attempts": outcome.attempts,
            "recover/overlapped": int(outcome.overlapped),
            "recover/discarded": int(outcome.discarded),
            "recover/compute_s": outcome.compute_s,
            "recover/wait_s": outcome.wait_s,
            "recover/recovery_s": outcome.recovery_s,
            "recover/active": len(active_replicas(outcome.quotas, self.config.recover.replicas)),
            **{f"recover/quota/{r}": outcome.quotas.get(r, 0) for r in range(groups)},
        }
        if self.localizer is not None:
            metrics.update({"recover/votes_total": self.localizer.votes,
                            "recover/refusals_total": self.localizer.refusals,
                            "recover/stragglers": len(self.localizer.detector.stragglers)})
        if sync.recoveries:
            metrics.update({
                "recover/epoch_changes": len(sync.recoveries),
                "recover/detect_s": sum(r["detect_s"] for r in sync.recoveries),
                "recover/agree_s": sum(r["agree_s"] for r in sync.recoveries),
                "recover/rebuild_s": sum(r["build_s"] for r in sync.recoveries),
            })
        return metrics

    # ---- the whole run -------------------------------------------------------------------------------------
    def train(self, run) -> Stop | None:
        try:
            run()
            self._finished()
        except Excluded as excluded:
            logger.error("%s", excluded)
            os._exit(EXIT_EXCLUDED)
        except JobOver as over:
            logger.warning("%s", over)
            self.member.close()
            self.events.emit("join_abandoned", reason=str(over))
            raise SystemExit(0) from None
        except TooFewReplicas as stop:
            # the current step was not committed: the parameters are those of the step before; replicas that
            # disagree without a majority leave no state anyone can trust, so none is saved
            if self.config.checkpoint.enable and not stop.untrusted:
                self.stop_turns = self._stop_turns(self.step - 1)
            save = self.stop_turns is not None and self.stop_turns.mine
            if save:
                self.chaos.maybe_inject(self.step - 1, "stop_save")
            return Stop(step=self.step - 1, ntokens_seen=self.committed_tokens, reason=str(stop), save=save,
                        exit_code=EXIT_STOPPED)
        return None

    def _finished(self) -> None:
        if self.config.recover.save_final_parameters:
            parts = self.parts
            save_final_parameters(parts.model_parts, os.path.join(self.run_dir, "final_parameters"),
                                  replica=self.replica, rank=self.rank)
            save_final_optimizer_state(parts.model_parts, parts.optimizers, parts.lr_schedulers,
                                       os.path.join(self.run_dir, "final_optimizer"), replica=self.replica,
                                       rank=self.rank)
        self.member.finish()
        if self.member.beacon is not None:
            self.member.beacon.close(done=True)
        self.events.emit("final_parameters", step=self.step, epoch=self.sync.epoch,
                         sha256=parameter_digest(self.parts.model_parts))

    def next_stop_save(self, stop: Stop, saved: bool) -> bool:
        """The writer reports its save's outcome; a candidate that did not write waits for it, and writes if the
        turn passes to it (the writer's save failed, or the coordinator found the writer lost)."""
        turns = self.stop_turns
        if turns is None or self.replica not in turns.candidates:
            return False
        if turns.mine:
            outcome = turns.report(saved)
            if outcome != SAVED and saved:
                logger.warning("titan_recover: replica %d saved the checkpoint of step %d after it was named lost; the "
                               "next replica in turn writes it again, and the first complete copy published stands",
                               self.replica, stop.step)
            return False
        turn = turns.await_turn()
        if turn.mine:
            logger.warning("titan_recover: the checkpoint of step %d passes to replica %d (%s)", stop.step,
                           self.replica, turns.history())
            self.events.emit("stop_checkpoint_handover", step=stop.step, writer=self.replica,
                             handovers=[list(h) for h in turns.handovers])
            self.chaos.maybe_inject(stop.step, "stop_save")
        return turn.mine

    def stopped(self, stop: Stop, checkpoint_saved: bool) -> None:
        folder = getattr(self.parts.checkpointer, "folder", "checkpoint")
        turn = self.stop_turns.last if self.stop_turns is not None else None
        if checkpoint_saved:
            where = f"durable checkpoint of step {stop.step} in {folder}"
        elif turn is not None and turn.written_by is not None:
            where = f"replica {turn.written_by} wrote the durable checkpoint of step {stop.step} in {folder}"
        elif turn is not None and turn.reason:
            where = turn.reason
        else:
            where = "no checkpoint written" + ("" if self.config.checkpoint.enable else " ([checkpoint] enable = false)")
        self.member.finish()
        self.events.emit("stopped", step=stop.step, reason=stop.reason, checkpoint_saved=checkpoint_saved)
        logger.error("titan_recover: %s; %s", stop.reason, where)

    def close(self) -> None:
        self.member.close()

