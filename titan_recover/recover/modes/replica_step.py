"""The trainer's side of replica groups: joining, the step's microbatches by id, the reduction, stopping cleanly.

Called from :class:`titan_recover.trainer.RecoverTrainer`'s hooks; TorchTitan's trainer does everything else.
In replica mode TorchTitan's loop still drives the step (zero_grad, its gradient-accumulation calls, clipping, the
optimizer, logging), but its first ``forward_backward_step`` call runs the whole step through
:class:`~titan_recover.recover.invariant.step_recovery.StepRecovery`: this replica's quota of global microbatch ids, fetched
by address, forward and backward with the loss scaled by the constant ``1 / tokens of the global batch``; FSDP2
reduces over the replica's own ranks as usual; across replicas every rank sums its local gradient shards with the
same position in the other member replicas, together with the step's ledger; lost replicas' ids are computed by
survivors in the same step. The gradient written back is the committed sum (docs/invariant.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

import torch

from titan_recover import platform

platform.activate()  # before any TorchTitan module that copies the device globals

from titan_recover.data.loader import AddressableDataLoader  # noqa: E402
from titan_recover.recover.scout.beacon import Beacon, beacon_path  # noqa: E402
from titan_recover.recover.chaos.monkey import ChaosMonkey  # noqa: E402
from titan_recover.recover.scout.consensus import fingerprint  # noqa: E402
from titan_recover.recover.events import EventLog  # noqa: E402
from titan_recover.recover.scout.localize import DISAGREEMENT, Localizer  # noqa: E402
from titan_recover.recover.groups.member import (  # noqa: E402
    COORDINATOR_ENV,
    Excluded,
    EXIT_EXCLUDED,
    incarnation_from_env,
    JobOver,
    REPLICA_ENV,
    ReplicaMember,
    RUN_DIR_ENV,
    TooFewReplicas,
)
from titan_recover.recover.groups.protocol import active_replicas  # noqa: E402
from titan_recover.recover.groups.replica_sync import ReplicaSync  # noqa: E402
from titan_recover.recover.phoenix.state_transfer import local_tensor  # noqa: E402
from titan_recover.recover.invariant.step_recovery import StepOutcome, StepRecovery  # noqa: E402
from titan_recover.recover.scout.verified import attach_verified_load, mark_verified  # noqa: E402

logger = logging.getLogger(__name__)

EXIT_TOO_FEW = 3


def local_parameters(trainer) -> list[torch.Tensor]:
    return [local_tensor(p.data) for m in trainer.model_parts for p in m.parameters()]


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
    groups = config.recover.groups
    incarnation = incarnation_from_env()
    chaos = ChaosMonkey(config.chaos.schedule(groups, world), replica, rank, events, incarnation=incarnation,
                        run_dir=run_dir)
    member = ReplicaMember(config.recover, replica=replica, rank=rank, ranks_per_replica=world,
                           address=os.environ[COORDINATOR_ENV], incarnation=incarnation)
    if config.recover.localize.hang_threshold_s > 0:  # read by the replica's hang observer (docs/scout.md)
        member.beacon = Beacon(beacon_path(run_dir, replica, rank, incarnation))
    sync = ReplicaSync(config.recover, member, events, chaos, final_step=config.training.steps)
    trainer.replica_sync = sync
    if config.checkpoint.enable and config.recover.localize.vote:
        attach_verified_load(trainer.checkpointer, events)  # recovery loads the newest verified checkpoint
    trainer.chaos = chaos
    trainer.replica_step = ReplicaStep(trainer, sync, chaos)
    trainer.metrics_processor.step_metrics_fn = trainer.replica_step.metrics
    try:
        sync.start()
        if not sync.joining:  # a joiner receives the whole state at its first step instead
            sync.broadcast_from_lowest(local_parameters(trainer))
    except Excluded as excluded:
        logger.error("%s", excluded)
        os._exit(EXIT_EXCLUDED)

    def before_optimizer(*_args, **_kwargs):
        member.progress(phase="optimizer")
        chaos.maybe_inject(trainer.step, "optimizer")

    trainer.optimizers.register_step_pre_hook(before_optimizer)
    optimizer_step = trainer.optimizers.step

    def step_unless_discarded(*args, **kwargs):
        """``drop`` discards a step that saw a failure, as torchft does: no optimizer update at all."""
        if trainer.replica_step.discard:
            return None
        return optimizer_step(*args, **kwargs)

    trainer.optimizers.step = step_unless_discarded

    def on_output(_module, _inputs, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            def on_backward(grad):
                member.progress(phase="backward")
                chaos.maybe_inject(trainer.step, "backward")

            output.register_hook(on_backward)

    trainer.model_parts[-1].register_forward_hook(on_output)
    chaos.tensors["parameter"] = lambda: local_parameters(trainer)
    chaos.tensors["gradient"] = lambda: [local_tensor(p.grad) if p.grad is not None else None
                                         for m in trainer.model_parts for p in m.parameters()]
    if any(f.kind == "bitflip" and f.target == "activation" for f in chaos.mine):
        # only when scheduled: no hook on every forward of a run without activation flips
        first_layer = next(m for m in trainer.model_parts[0].children())

        def on_first_output(_module, _inputs, output):
            if isinstance(output, torch.Tensor):
                chaos.on_activation(local_tensor(output))

        first_layer.register_forward_hook(on_first_output)


class ReplicaStep:
    """Replica mode's per-step state on one rank: the local accumulation, the recovery manager, the outcome."""

    def __init__(self, trainer, sync: ReplicaSync, chaos: ChaosMonkey):
        config = trainer.config
        quota = config.recover.quota
        self.trainer, self.sync, self.chaos = trainer, sync, chaos
        if not isinstance(trainer.dataloader, AddressableDataLoader):
            raise ValueError(
                f"[recover] replicas = {config.recover.replicas} needs the addressable data loader (any replica "
                f"computes any microbatch by id), got {type(trainer.dataloader).__name__}; use the project's "
                "[dataloader] (dataset_path = a folder prepared by python -m titan_recover.data.prepare)"
            )
        self.exact = quota.exact
        self.replicas = config.recover.replicas  # active replicas: the ones holding quota
        self.groups = config.recover.groups
        self.per_step = quota.microbatches or self.replicas * trainer.gradient_accumulation_steps
        self.shard_degree, self.shard_rank = 1, 0
        if trainer.parallel_dims.dp_enabled:
            mesh = trainer.parallel_dims.get_mesh("batch")
            self.shard_degree, self.shard_rank = mesh.size(), mesh.get_local_rank()
        self.local_batch = config.training.local_batch_size
        self.tokens_per_microbatch = self.shard_degree * self.local_batch * config.training.seq_len
        # The constant loss scale: every microbatch's summed token loss is divided by the tokens of the whole
        # global batch (the addressable loader's labels are all tokens, none ignored), never by the live replicas.
        self.global_tokens = torch.tensor(self.per_step * self.tokens_per_microbatch, device=trainer.device)
        self.params = [p for m in trainer.model_parts for p in m.parameters() if p.requires_grad]
        self.numel = sum(local_tensor(p).numel() for p in self.params)
        self.dtype = torch.float64 if self.exact else torch.float32
        localize = config.recover.localize
        self.localizer = None
        if localize.witnesses:
            self.localizer = Localizer(localize, replica=sync.member.replica, position=sync.member.rank,
                                       groups=self.groups, events=sync.events)
        self.recovery = StepRecovery(
            quota, replica=sync.member.replica, replicas=self.groups, active=self.replicas, per_step=self.per_step,
            sync=sync,
            compute=self.compute, pack=self.pack, max_epochs_per_step=config.recover.max_epochs_per_step,
            agree_speed=self.agree_speed if torch.distributed.get_world_size() > 1 else None,
            localizer=self.localizer, signature=lambda: fingerprint(local_parameters(trainer)),
        )
        self.outcome: StepOutcome | None = None
        self.discard = False
        self._calls = 0
        self._loss = torch.zeros((), dtype=torch.float64, device=trainer.device)
        self._accumulator: torch.Tensor | None = None
        self.state = trainer.training_state(
            get_extra=lambda: {"speeds": {str(r): v for r, v in self.recovery.speeds.items()}},
            set_extra=self._set_speeds,
        )

    def _set_speeds(self, extra: dict) -> None:
        self.recovery.speeds = {int(r): v for r, v in extra["speeds"].items()}

    def begin_step(self) -> None:
        # a replica admitted after the previous commit receives the state now (a joiner: its whole state, which
        # moves trainer.step to the donors' step)
        self.sync.admit_pending(self.trainer.step, self.state)
        self._calls = 0
        self.discard = False
        self._loss.zero_()
        if self.exact:
            if self._accumulator is None:
                self._accumulator = torch.zeros(self.numel, dtype=torch.float64, device=self.trainer.device)
            self._accumulator.zero_()

    def forward_backward(self) -> torch.Tensor:
        """One of TorchTitan's gradient-accumulation calls: the first runs the whole step, the others add 0 to
        the logged loss. Returns this rank's share of the logged loss (TorchTitan sums shares over the replica's
        ranks: the result is the mean token loss of the committed global batch)."""
        self._calls += 1
        if self._calls > 1:
            return torch.zeros((), device=self.trainer.device)
        trainer = self.trainer
        outcome = self.recovery.run(trainer.step)
        self.outcome = outcome
        if not trainer.metrics_processor.data_loading_times:
            trainer.metrics_processor.data_loading_times.append(0.0)  # a spare loaded nothing; TorchTitan averages
        scale = self.per_step / outcome.committed  # 1 unless `drop` lost microbatches
        summed = outcome.summed
        offset = 0
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = local_tensor(p.grad)
                part = summed[offset : offset + g.numel()].view_as(g)
                g.copy_((part * scale if scale != 1 else part).to(g.dtype))
                offset += g.numel()
        self._note_verified()
        self.discard = outcome.discarded
        if outcome.discarded:
            self.sync.events.emit("step_discarded", step=trainer.step, epoch=self.sync.epoch,
                                  microbatches=outcome.committed)
        return torch.tensor(float(summed[self.numel]) * scale, dtype=torch.float32, device=trainer.device)

    def _note_verified(self) -> None:
        """This step committed after a clean parameter vote, which read the state saved at the previous step:
        that checkpoint is verified (docs/scout.md)."""
        checkpoint, localizer = self.trainer.config.checkpoint, self.localizer
        previous = self.trainer.step - 1
        if (checkpoint.enable and localizer is not None and localizer.config.vote and localizer.clean
                and self.sync.member.rank == 0 and previous > 0 and previous % checkpoint.interval == 0):
            mark_verified(self.trainer.checkpointer.folder, previous)
            self.sync.events.emit("checkpoint_verified", step=previous)

    def compute(self, g: int, witness: str | None = None) -> int | None:
        """Forward and backward of replica microbatch ``g`` (this rank's shard of it), accumulated locally.

        ``witness``: called before anything was accumulated in this step; returns the signature of ``g``'s
        gradient shards and loss. ``"holder"`` keeps the gradient, ``"replay"`` drops it (docs/scout.md)."""
        trainer, member = self.trainer, self.sync.member
        member.progress(step=trainer.step, phase="forward")
        self.chaos.maybe_inject(trainer.step, "forward")
        replay = witness == "replay"
        start = time.perf_counter()
        input_dict, labels = trainer.dataloader.microbatch(
            g, self.shard_rank, shard_degree=self.shard_degree, batch_size=self.local_batch
        )
        loaded = time.perf_counter()
        chunks = trainer.num_pipeline_parallel_microbatches
        inputs, targets = [], []
        for c in range(chunks):
            part = slice(c * self.local_batch // chunks, (c + 1) * self.local_batch // chunks)
            inputs.append({k: v[part].to(trainer.device) for k, v in input_dict.items()})
            targets.append(labels[part].to(trainer.device))
            if not replay:
                trainer.metrics_processor.ntokens_since_last_log += targets[-1].numel()
                trainer.metrics_processor.data_loading_times.append((loaded - start) / chunks)
        pp = trainer.parallel_dims.pp_enabled
        loss = trainer.base_forward_backward_step(
            input_dict=inputs if pp else inputs[0], labels=targets if pp else targets[0],
            global_valid_tokens=self.global_tokens,
        )
        self.chaos.after_backward()
        last_stage = not pp or trainer.pp_has_last_stage
        signature = None
        if witness is not None:
            grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
            signature = fingerprint(grads, extra=[float(loss.detach().sum())] if last_stage else [])
        if replay:
            for p in self.params:
                p.grad = None
            return signature
        if last_stage:
            self._loss += loss.detach().to(torch.float64).sum()
        if self.exact:
            self._move_gradients_to_accumulator()
        self.chaos.after_compute(trainer.step, time.perf_counter() - loaded)
        return signature

    def _move_gradients_to_accumulator(self) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = local_tensor(p).numel()
                if p.grad is not None:
                    g = local_tensor(p.grad)
                    self._accumulator[offset : offset + n].add_(g.reshape(-1))
                    g.zero_()
                offset += n

    def pack(self, tail: list[float]) -> torch.Tensor:
        """The flat buffer reduced across replicas: local accumulation, loss, then ``tail`` (ledger, speeds)."""
        if self.exact:
            local = self._accumulator
        else:
            local = torch.cat([
                (local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))).reshape(-1).to(self.dtype)
                for p in self.params
            ])
        return torch.cat([
            local.detach().cpu().to(self.dtype),
            self._loss.detach().cpu().to(self.dtype).reshape(1),
            torch.tensor(tail, dtype=self.dtype),
        ])

    def agree_speed(self, speed: float) -> float:
        """The replica's speed as one number on all its ranks (their timings differ slightly)."""
        self.chaos.maybe_inject(self.trainer.step, "collective")
        t = torch.tensor([speed], dtype=torch.float64, device=self.trainer.device)
        if self.chaos.desync:  # injected: this rank issues another collective than its peers
            self.chaos.desync = False
            t = torch.zeros(2, dtype=torch.float64, device=self.trainer.device)
        beacon = self.sync.member.beacon
        if beacon is None:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        else:
            with beacon.collective("all_reduce(max)", "replica", t.shape):
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t[0].item())

    def metrics(self) -> dict[str, float]:
        outcome, sync = self.outcome, self.sync
        if outcome is None:
            return {}
        metrics = {
            "recover/replicas": outcome.participants,
            "recover/epoch": sync.epoch,
            "recover/microbatches": outcome.committed,
            "recover/tokens": outcome.committed * self.tokens_per_microbatch,
            "recover/recomputed": outcome.recomputed,
            "recover/computed_here": outcome.mine,
            "recover/attempts": outcome.attempts,
            "recover/discarded": int(outcome.discarded),
            "recover/compute_s": outcome.compute_s,
            "recover/wait_s": outcome.wait_s,
            "recover/recovery_s": outcome.recovery_s,
            "recover/active": len(active_replicas(outcome.quotas, self.replicas)),
            **{f"recover/quota/{r}": outcome.quotas.get(r, 0) for r in range(self.groups)},
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


def save_final_parameters(trainer, folder: str) -> None:
    """Every rank's local parameter shards, by name, to ``folder/replica{i}_rank{k}.pt`` (for comparing runs)."""
    os.makedirs(folder, exist_ok=True)
    member = trainer.replica_sync.member
    shards = {name: local_tensor(p.data).detach().cpu().clone()
              for m in trainer.model_parts for name, p in m.named_parameters()}
    path = os.path.join(folder, f"replica{member.replica}_rank{member.rank}.pt")
    torch.save(shards, path + ".tmp")
    os.replace(path + ".tmp", path)


def parameter_digest(trainer) -> str:
    """sha256 of this rank's local parameter shards (bitwise identity across replicas, without copying)."""
    digest = hashlib.sha256()
    for t in local_parameters(trainer):
        digest.update(t.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def train_until_done_or_stopped(trainer, train) -> None:
    try:
        train()
        if trainer.config.recover.save_final_parameters:
            save_final_parameters(trainer, os.path.join(os.environ.get(RUN_DIR_ENV, trainer.config.dump_folder),
                                                        "final_parameters"))
        trainer.replica_sync.member.finish()
        if trainer.replica_sync.member.beacon is not None:
            trainer.replica_sync.member.beacon.close(done=True)
        trainer.replica_sync.events.emit("final_parameters", step=trainer.step, epoch=trainer.replica_sync.epoch,
                                         sha256=parameter_digest(trainer))
    except Excluded as excluded:
        logger.error("%s", excluded)
        os._exit(EXIT_EXCLUDED)
    except JobOver as over:
        logger.warning("%s", over)
        trainer.replica_sync.member.close()
        trainer.replica_sync.events.emit("join_abandoned", reason=str(over))
        raise SystemExit(0) from None
    except TooFewReplicas as stop:
        committed = trainer.step - 1  # the current step was not committed: parameters are those of step - 1
        trainer.step = committed
        saved = False
        # replicas that disagree without a majority: no replica's state can be trusted, none is saved
        if trainer.config.checkpoint.enable and not str(stop).startswith(DISAGREEMENT):
            trainer.checkpointer.save(curr_step=committed, last_step=True)
            saved = True
        folder = getattr(trainer.checkpointer, "folder", "checkpoint")
        where = (f"durable checkpoint of step {committed} in {folder}" if saved
                 else "no checkpoint written" + ("" if trainer.config.checkpoint.enable else
                                                 " ([checkpoint] enable = false)"))
        trainer.replica_sync.member.finish()
        trainer.replica_sync.events.emit("stopped", step=committed, reason=str(stop), checkpoint_saved=saved)
        logger.error("titan_recover: %s; %s", stop, where)
        raise SystemExit(EXIT_TOO_FEW) from None
