"""``RecoverTrainer``: TorchTitan's ``Trainer`` with the project's config sections, addressable data, and a mode.

Importing this module activates the platform (see :mod:`titan_recover.platform`) before TorchTitan's trainer is
imported, so on a CPU-only machine TorchTitan runs on CPU + gloo without edits to its files.

The trainer builds one training mode, chosen by ``[recover] mode`` (registered in
:mod:`titan_recover.recover.modes`), and delegates to it at TorchTitan's seams: which steps to train, which local
batches a step reads, the step itself, the forward and backward of a microbatch, and the whole loop (an early
stop). It hands the mode what TorchTitan built (:class:`~titan_recover.recover.modes.base.TrainerParts`), never
itself, and applies what the mode returns (docs/architecture.md).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from titan_recover import platform
from titan_recover.platform import PlatformConfig

platform.activate()

import torch  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titan_recover.data.loader import AddressableDataLoader  # noqa: E402
from titan_recover.recover.config import RecoverConfig  # noqa: E402
from titan_recover.recover.chaos.config import ChaosConfig  # noqa: E402
from titan_recover.recover.modes.base import build_mode, TrainerParts  # noqa: E402


class _TrainState:
    """The trainer's step and tokens seen through TorchTitan's ``Stateful`` protocol only (what its checkpointer
    saves as ``train_state``): how state transfer reads and restores them, with no other way into the trainer."""

    def __init__(self, trainer: Trainer):
        self._trainer = trainer

    def state_dict(self) -> dict:
        return self._trainer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._trainer.load_state_dict(state_dict)


class RecoverTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        platform: PlatformConfig = field(default_factory=PlatformConfig)
        recover: RecoverConfig = field(default_factory=RecoverConfig)
        chaos: ChaosConfig = field(default_factory=ChaosConfig)

    def __init__(self, config: Config):
        super().__init__(config)
        self.mode = build_mode(config, parts=self._parts())
        self.step = self.mode.start(self.step)

    def _parts(self) -> TrainerParts:
        return TrainerParts(
            config=self.config, model_parts=self.model_parts, optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, checkpointer=self.checkpointer, dataloader=self.dataloader,
            metrics_processor=self.metrics_processor, parallel_dims=self.parallel_dims, device=self.device,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            pp_microbatches=self.num_pipeline_parallel_microbatches,
            pp_has_last_stage=self.pp_has_last_stage if self.parallel_dims.pp_enabled else True,
            forward_backward=functools.partial(Trainer.forward_backward_step, self), train_state=_TrainState(self),
        )

    def should_continue_training(self) -> bool:
        return self.mode.should_continue(super().should_continue_training())

    def train_step(self, data_iterator):
        report = self.mode.train_step(self.step, functools.partial(super().train_step, data_iterator))
        if report is not None:
            self.ntokens_seen = report.ntokens_seen
            # read by the project's checkpoint manager when TorchTitan's loop saves this step
            self.checkpointer.writer = report.checkpoint_writer
            if report.checkpoint_now:  # asked for while training on: this step's, whatever the interval says
                self.checkpointer.save_resumable(self.step)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        return self.mode.forward_backward(self.step, input_dict=input_dict, labels=labels,
                                          global_valid_tokens=global_valid_tokens)

    def train(self):
        stop = self.mode.train(super().train)
        if stop is None:
            return
        self.step, self.ntokens_seen = stop.step, stop.ntokens_seen
        saved = self._save_stop(stop) if stop.save else False
        while self.mode.next_stop_save(stop, saved):  # the replica whose turn it was did not write it
            saved = self._save_stop(stop)
        self.mode.stopped(stop, checkpoint_saved=saved)
        raise SystemExit(stop.exit_code)

    def _save_stop(self, stop) -> bool:
        """The stop's checkpoint, one the job resumes from, written by this replica (the mode's choice)."""
        self.checkpointer.writer = True
        return self.checkpointer.save_resumable(stop.step)

    def close(self) -> None:
        if getattr(self, "mode", None) is not None:
            self.mode.close()
        super().close()

    def batch_generator(
        self, data_iterable: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        if not isinstance(self.dataloader, AddressableDataLoader):
            return super().batch_generator(data_iterable)
        # Read the step now: TorchTitan creates this iterator before the loop and advances ``self.step``
        # before the first ``next()``, when a generator body would only start running.
        return self._addressable_batches(first_step=self.step + 1)

    def _addressable_batches(self, first_step: int) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        local_batch = self.config.training.local_batch_size
        chunks = self.num_pipeline_parallel_microbatches
        step = first_step
        while True:
            for n in self.mode.local_batches(step):
                start = time.perf_counter()
                input_dict, labels = self.dataloader.local_batch(n, local_batch)
                elapsed = time.perf_counter() - start
                for c in range(chunks):
                    part = slice(c * local_batch // chunks, (c + 1) * local_batch // chunks)
                    chunk_labels = labels[part]
                    self.metrics_processor.record_batch(chunk_labels.numel(), elapsed / chunks)
                    yield {k: v[part] for k, v in input_dict.items()}, chunk_labels
            step += 1
