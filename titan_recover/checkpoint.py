"""TorchTitan checkpoint manager with the resilience layer's load path (docs/scout.md section 4, docs/phoenix.md).

``RecoverCheckpointManager`` is TorchTitan's DCP ``CheckpointManager`` (saving, purging, async modes unchanged),
selected through ``[checkpoint]`` by the config loader like the project's data loader and metrics processor. Its
``load`` (called by TorchTitan's ``Trainer.train`` before the first step) differs in two ways:

* which durable checkpoint: with ``load_verified`` on, "the newest" (``load_step = -1``) is the newest checkpoint
  recorded as verified by a clean parameter vote (:func:`titan_recover.recover.scout.verified.step_to_load`),
  announced by a ``checkpoint_choice`` event; an explicit ``load_step`` is the user's choice;
* then, with ``[recover.snapshot] interval > 0`` (a job without replicas), every rank refills from the newest
  in-memory snapshot every rank holds in the keepers, if it is newer than the durable checkpoint
  (:meth:`titan_recover.recover.phoenix.snapshots.Snapshots.restore`; its ``snapshot_restored`` event). The same
  :class:`~titan_recover.recover.phoenix.snapshots.Snapshots` (``manager.snapshots``) takes the snapshots during
  training, driven by the trainer.

Run information comes from the config (the loader fills ``load_verified`` and the snapshot section) and the
environment the launcher sets (the run folder and replica of the event log); nothing is installed after
construction.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.checkpoint import CheckpointManager

from titan_recover.recover.events import EventLog
from titan_recover.recover.groups.member import REPLICA_ENV, RUN_DIR_ENV
from titan_recover.recover.phoenix.snapshots import keeper_addresses, SnapshotConfig, Snapshots
from titan_recover.recover.phoenix.state_transfer import TrainingState
from titan_recover.recover.scout.verified import only_unverified, step_to_load

logger = logging.getLogger(__name__)

def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: the process group's, else torchrun's ``RANK`` / ``WORLD_SIZE``."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


TRAIN_STATE = "train_state"
"""The key under which TorchTitan's trainer hands itself (step, tokens seen) to the checkpoint manager."""


def verified_load_step(folder: str, requested: int) -> tuple[int, str | None]:
    """The step to hand to TorchTitan's load (-1: its newest) and why it was chosen (None: ``requested``, the
    user's explicit ``load_step``, is loaded as asked)."""
    if requested != -1:
        return requested, None
    chosen, reason = step_to_load(folder)
    return (-1 if chosen is None else chosen), reason


class RecoverCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        load_verified: bool | None = None
        """Load the newest checkpoint recorded as verified by a clean parameter vote (docs/scout.md section 4)
        instead of TorchTitan's newest when ``load_step = -1``. Unset: on in a replica-group job (``[recover]
        replicas > 1``, ``mode = "sync"``) whose ``[recover.localize] vote`` is on."""

        _snapshot: SnapshotConfig | None = None
        """``[recover.snapshot]``, handed over by the config loader (users set it there, not here): with
        ``interval > 0`` every rank refills from the keepers' snapshots after the durable load."""

    snapshots: Snapshots | None = None
    """This rank's in-memory snapshots with ``[recover.snapshot] interval > 0``: restored by :meth:`load`; the
    ``single`` mode calls ``take(step)`` after a step, ``before_optimizer()`` before every optimizer step, ``wait()``
    at the end."""

    def __init__(self, config: Config, *, model_parts, optimizers, lr_schedulers, states: dict[str, Any],
                 base_folder: str = "", **kwargs):
        self.load_verified = bool(config.load_verified)
        self._train_state = states.get(TRAIN_STATE)
        self._events: EventLog | None = None
        self._run_dir = os.environ.get(RUN_DIR_ENV, base_folder)
        super().__init__(config, model_parts=model_parts, optimizers=optimizers, lr_schedulers=lr_schedulers,
                         states=states, base_folder=base_folder, **kwargs)
        if config._snapshot is not None and config._snapshot.interval > 0:
            self.snapshots = self._connect_snapshots(config._snapshot, model_parts, optimizers, lr_schedulers)

    def _connect_snapshots(self, config: SnapshotConfig, model_parts, optimizers, lr_schedulers) -> Snapshots:
        if self._train_state is None:
            raise ValueError(f"snapshots need the trainer's state: build the checkpoint manager with "
                             f"states={{{TRAIN_STATE!r}: trainer}}, as TorchTitan's trainer does")
        rank, world = rank_and_world()
        state = TrainingState(model_parts, list(optimizers), lr_schedulers, train_state=self._train_state)
        return Snapshots(state, keepers=keeper_addresses(config), rank=rank, ranks=world,
                         local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", world)), events=self.events)

    @property
    def events(self) -> EventLog:
        """The run's event log, as this rank writes it (``<run>/events.jsonl``, source ``replica/rank``)."""
        if self._events is None:
            replica, rank = int(os.environ.get(REPLICA_ENV, "0")), rank_and_world()[0]
            self._events = EventLog(os.path.join(self._run_dir, "events.jsonl"), f"{replica}/{rank}",
                                    replica=replica, rank=rank)
        return self._events

    def load(self, step: int = -1) -> bool:
        """TorchTitan's load (of the verified step, see :meth:`_load`) when checkpointing is enabled, then the
        snapshots' refill when configured. Overrides the public entry (not only ``_load``) because snapshots refill
        a job whose durable checkpointing is off too; TorchTitan's enabled check stays in ``super().load``."""
        loaded = super().load(step)
        if self.snapshots is None:
            return loaded
        durable_step = self._train_state.state_dict()["step"]
        return self.snapshots.restore(durable_step=durable_step) is not None or loaded

    def _load(self, step: int = -1) -> bool:
        if self.load_verified:
            step, reason = verified_load_step(self.folder, step)
            if reason is not None:
                self.events.emit("checkpoint_choice", step=None if step == -1 else step, reason=reason)
                if step == -1 and only_unverified(self.folder):
                    logger.warning("%s", reason)
        return super()._load(step)
