"""``RecoverTrainer``: TorchTitan's ``Trainer`` with the project's config sections and addressable data.

Importing this module activates the platform (see :mod:`titan_recover.platform`) before TorchTitan's trainer is
imported, so on a CPU-only machine TorchTitan runs on CPU + gloo without edits to its files.

Hooks overridden (each calls TorchTitan's own implementation for everything it does not change):

* ``batch_generator``: microbatches come from the addressable loader by id, derived from the step counter, so
  the data position is a pure function of ``step`` (checkpoint-exact, and computable by any replica);
* with ``[recover] replicas > 1`` (docs/replica_groups.md, docs/invariant.md): ``__init__`` joins the replica
  groups and makes the parameters equal to the lowest member replica's; the first ``forward_backward_step`` call
  of a step runs the whole step's share of this replica (its quota of global microbatch ids, fetched by address,
  the ids of replicas lost during the step, the reduction across replicas and its commit) and the later calls of
  TorchTitan's accumulation loop add nothing (their batches are placeholders); ``train`` turns "too few replicas
  left" into a durable checkpoint and a clear error;
* with ``[recover] mode = "diloco"`` (docs/diloco.md): the replica group is a learner; ``should_continue_training``
  claims data blocks from the job's counter, the batches are the block's microbatch ids, and after every
  ``train_step`` the learner sends its due fragments and mixes in newer global ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from titan_recover import platform
from titan_recover.platform import PlatformConfig

platform.activate()

import torch  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titan_recover.config.validate import resolve_layout  # noqa: E402
from titan_recover.data.loader import AddressableDataLoader  # noqa: E402
from titan_recover.recover import RecoverConfig  # noqa: E402
from titan_recover.recover.modes import replica_step  # noqa: E402
from titan_recover.recover.phoenix import snapshot  # noqa: E402
from titan_recover.recover.chaos.monkey import ChaosConfig, ChaosMonkey  # noqa: E402
from titan_recover.recover.events import EventLog  # noqa: E402
from titan_recover.recover.groups.member import incarnation_from_env  # noqa: E402
from titan_recover.recover.phoenix.state_transfer import TrainingState  # noqa: E402


def _placeholders() -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """What TorchTitan's accumulation loop iterates in replica mode: the step's data is fetched by id instead."""
    token = torch.zeros((1, 1), dtype=torch.int64)
    while True:
        yield {"input": token}, token


class RecoverTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        platform: PlatformConfig = field(default_factory=PlatformConfig)
        recover: RecoverConfig = field(default_factory=RecoverConfig)
        chaos: ChaosConfig = field(default_factory=ChaosConfig)

    replica_sync = None  # ReplicaSync when [recover] replicas > 1
    replica_step = None  # its per-step state (replica_step.ReplicaStep)
    snapshots = None  # snapshot.Snapshots when [recover.snapshot] interval > 0 (a job without replicas)
    chaos = None  # ChaosMonkey when [chaos] schedules faults
    learner = None  # learner.Learner with [recover] mode = "diloco"
    _job_events = None  # a job without replica groups: its event log until its first step ran

    def __init__(self, config: Config):
        super().__init__(config)
        if config.recover.diloco_mode:
            from titan_recover.recover.diloco.learner import attach_learner

            attach_learner(self)
        elif config.recover.enabled:
            replica_step.attach_replica_sync(self)
        else:
            self._attach_single_job()

    def should_continue_training(self) -> bool:
        if self.learner is not None:
            return self.learner.has_work()
        return super().should_continue_training()

    def _attach_single_job(self) -> None:
        """A job without replica groups (or ``mode = "checkpoint_restart"``): its fault injection, and its in-memory
        snapshots if configured."""
        config = self.config
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        # mode = "checkpoint_restart": the replica groups are the replicated data-parallel dimension, so events
        # name ranks and faults hit them as in the replica-group job
        groups, replica, replica_rank = 1, 0, rank
        if config.recover.checkpoint_restart_mode:
            groups = config.recover.replicas
            replica, replica_rank = resolve_layout(config.parallelism, world).replica_position(rank)
        per_group = world // groups
        events = EventLog(os.path.join(config.dump_folder, "events.jsonl"), f"{replica}/{replica_rank}",
                          replica=replica, rank=replica_rank)
        self._job_events = events
        schedule = config.chaos.schedule(groups, per_group)
        if schedule:
            self.chaos = ChaosMonkey(schedule, replica, replica_rank, events, incarnation=incarnation_from_env(),
                                     run_dir=config.dump_folder)
            self.optimizers.register_step_pre_hook(lambda *_: self.chaos.maybe_inject(self.step, "optimizer"))
        if config.recover.snapshot.interval:
            self.snapshots = snapshot.attach_snapshots(self, events)

    def training_state(self, get_extra=None, set_extra=None) -> TrainingState:
        """Everything a step needs, as this rank holds it (state transfer and snapshots); ``get_extra`` /
        ``set_extra`` add more JSON-able state to the trainer's token count."""
        def extra() -> dict:
            return {"ntokens_seen": self.ntokens_seen, **(get_extra() if get_extra else {})}

        def load_extra(values: dict) -> None:
            self.ntokens_seen = values["ntokens_seen"]
            if set_extra:
                set_extra(values)

        def set_step(step: int) -> None:
            self.step = step

        return TrainingState(self.model_parts, list(self.optimizers), self.lr_schedulers, get_step=lambda: self.step,
                             set_step=set_step, get_extra=extra, set_extra=load_extra)

    def train_step(self, data_iterator):
        if self._job_events is not None:  # a (re)start of a job without replica groups, and the step it resumed
            self._job_events.emit("training_started", console=False, resumed_from=self.step - 1,
                                  incarnation=incarnation_from_env())
            self._job_events = None
        if self.replica_step is not None:
            self.replica_step.begin_step()
        result = super().train_step(data_iterator)
        if self.learner is not None:
            self.learner.after_inner_step(self.step)
        if self.snapshots is not None and self.step % self.config.recover.snapshot.interval == 0:
            self.snapshots.take(self.step)
        return result

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        if self.replica_step is None:
            if self.chaos is None:
                return super().forward_backward_step(
                    input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
                )
            self.chaos.maybe_inject(self.step, "forward")
            start = time.perf_counter()
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
            self.chaos.after_compute(self.step, time.perf_counter() - start)  # a ``slow`` rank sleeps here
            return loss
        return self.replica_step.forward_backward()

    def base_forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        """TorchTitan's forward and backward of one microbatch (replica mode calls it once per microbatch id)."""
        return super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )

    def train(self):
        if self.learner is not None:
            super().train()
            self.learner.finish(timeout_s=self.config.recover.agree_timeout_s)
            return None
        if self.replica_sync is None:
            return super().train()
        return replica_step.train_until_done_or_stopped(self, super().train)

    def close(self) -> None:
        if self.snapshots is not None:
            self.snapshots.wait()  # a send thread still inside the store client at exit would abort the process
        if self.replica_sync is not None:
            self.replica_sync.member.close()
        if self.learner is not None:
            self.learner.close()
            self.learner.member.close()
        super().close()

    def batch_layout(self) -> tuple[int, int]:
        """``(batch_degree, batch_rank)``: data-parallel size and this rank's index (replicate-major)."""
        size, rank = 1, 0
        if self.parallel_dims.dp_enabled:
            mesh = self.parallel_dims.get_mesh("batch")
            size, rank = mesh.size(), mesh.get_local_rank()
        return size, rank

    def microbatch_order(self, step: int) -> Iterator[int]:
        """Local-batch indices ``n`` this rank consumes in ``step`` (1-based), one per gradient-accumulation
        step: ``n = ((step - 1) * A + a) * dp + r``. In HSDP terms (``r = replica * shard_degree + shard``),
        ``n`` is replica microbatch ``g = ((step - 1) * A + a) * replicas + replica`` at shard rank ``shard``,
        the id the ``even`` quota gives that replica in replica mode (which fetches ``n = g * S + shard``)."""
        if self.learner is not None:  # the learner's current data block (docs/diloco.md)
            yield from self.learner.local_batch_indices()
            return
        dp, r = self.batch_layout()
        accumulation = self.gradient_accumulation_steps
        for a in range(accumulation):
            yield ((step - 1) * accumulation + a) * dp + r

    def batch_generator(
        self, data_iterable: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        if not isinstance(self.dataloader, AddressableDataLoader):
            return super().batch_generator(data_iterable)
        if self.config.recover.enabled and not self.config.recover.diloco_mode:
            return _placeholders()
        # Read the step now: TorchTitan creates this iterator before the loop and advances ``self.step``
        # before the first ``next()``, when a generator body would only start running.
        return self._addressable_batches(first_step=self.step + 1)

    def _addressable_batches(self, first_step: int) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        local_batch = self.config.training.local_batch_size
        chunks = self.num_pipeline_parallel_microbatches
        step = first_step
        while True:
            for n in self.microbatch_order(step):
                start = time.perf_counter()
                input_dict, labels = self.dataloader.local_batch(n, local_batch)
                elapsed = time.perf_counter() - start
                for c in range(chunks):
                    part = slice(c * local_batch // chunks, (c + 1) * local_batch // chunks)
                    chunk_labels = labels[part]
                    self.metrics_processor.ntokens_since_last_log += chunk_labels.numel()
                    self.metrics_processor.data_loading_times.append(elapsed / chunks)
                    yield {k: v[part] for k, v in input_dict.items()}, chunk_labels
            step += 1
