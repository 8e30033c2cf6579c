"""TorchTitan checkpoint manager with the resilience layer's load path (docs/scout.md section 4, docs/phoenix.md).

``RecoverCheckpointManager`` is TorchTitan's DCP ``CheckpointManager`` (saving and async modes unchanged),
selected through ``[checkpoint]`` by the config loader like the project's data loader and metrics processor. It
saves only while :attr:`~RecoverCheckpointManager.writer` is set: in sync mode the replica groups share the run's
checkpoint folder and only the lowest member replica of the epoch that committed a step writes it (the trainer sets
``writer`` from each step's report; docs/replica_groups.md "Checkpoints"). Its purge keeps the newest
``keep_latest_k`` *complete* checkpoints (:func:`stale_checkpoints`): a save that never completed (its writer died)
is never counted as one of them, so it cannot push out a good checkpoint. A checkpoint written at once
(:meth:`~RecoverCheckpointManager.save_resumable`: a stop's, or one asked for while training on) is staged in the
writer's own folder and renamed into place complete (:func:`publish`), so that a second writer of the same step
never writes over it. Its ``load`` (called by TorchTitan's
``Trainer.train`` before the first step) differs in two ways:

* which durable checkpoint: with ``load_verified`` on, "the newest" (``load_step = -1``) is the newest checkpoint
  recorded as verified by a clean parameter vote (:func:`titan_recover.recover.scout.verified.step_to_load`),
  announced by a ``checkpoint_choice`` event; an explicit ``load_step`` is the user's choice;
* then, with ``[recover.snapshot] interval > 0`` (a job without replicas), every rank refills from the newest
  in-memory snapshot every rank holds in the keepers, if it is newer than the durable checkpoint and no
  ``load_step`` names a step (:meth:`titan_recover.recover.phoenix.snapshots.Snapshots.restore`; its
  ``snapshot_restored`` event). The same
  :class:`~titan_recover.recover.phoenix.snapshots.Snapshots` (``manager.snapshots``) takes the snapshots during
  training, driven by the trainer.

Run information comes from the config (the loader fills ``load_verified`` and the snapshot section) and the
environment the launcher sets (the run folder and replica of the event log); nothing is installed after
construction. The one thing that changes while training is ``writer``, which the trainer sets from each step's
report.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from titan_recover import platform

platform.activate()  # before any TorchTitan module (the rule every module importing TorchTitan follows)

from torchtitan.components.checkpoint import AsyncMode, CheckpointManager  # noqa: E402
from torchtitan.tools import filesystem  # noqa: E402

from titan_recover.recover.events import EventLog  # noqa: E402
from titan_recover.recover.groups.member import FOUNDING_STEP_ENV, REPLICA_ENV, RUN_DIR_ENV  # noqa: E402
from titan_recover.recover.phoenix.snapshots import (gather_from_ranks, keeper_addresses, snapshot_job,  # noqa: E402
                                                     SnapshotConfig, Snapshots)
from titan_recover.recover.phoenix.state_transfer import TrainingState  # noqa: E402
from titan_recover.recover.scout.verified import METADATA, only_unverified, STEP_DIR, step_to_load  # noqa: E402

logger = logging.getLogger(__name__)

_STAGING_DIR = re.compile(r"^\.saving-(\d+)\.r(\d+)$")
REPORT_WAIT_S = 10.0
"""How long a wait for an asynchronous save waits, once the save completed, for its ``checkpoint_complete`` event:
the done-callback that logs it runs right after, on the thread that completed the write."""


def staging_name(step: int, replica: int) -> str:
    """The folder a resumable checkpoint of ``step`` is written into by ``replica`` before it is published as
    ``step-N``. Hidden, and without ``step-`` in it: TorchTitan's own scans (``re.search(r"step-(\\d+)")``) and the
    project's never take it for a checkpoint."""
    return f".saving-{step}.r{replica}"


def complete(checkpoint_id: str) -> bool:
    """A checkpoint folder whose ``.metadata`` exists: DCP writes it last, once every shard is written."""
    return filesystem.isfile(filesystem.join(checkpoint_id, METADATA))


def publish(staging: str, target: str) -> bool:
    """Put the complete checkpoint ``staging`` in place as ``target`` (``step-N``) by one rename, so that readers see
    the step's folder either complete or not at all, and a checkpoint in place is never written over: True if
    ``staging`` now stands there; False if a complete checkpoint of the step stood there first (another writer's,
    the same bytes), and ``staging`` is removed. An incomplete ``target`` (a save of the step that died mid-write) is
    set aside and removed first. Local folders only (an object store has no atomic rename)."""
    while True:
        try:
            os.rename(staging, target)
            return True
        except FileNotFoundError:
            if complete(target):  # purged by the writer whose checkpoint of the step stood first
                return False
            raise
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if complete(target):
            filesystem.rmtree(staging)
            return False
        aside = os.path.join(os.path.dirname(target), f".incomplete-{uuid.uuid4().hex[:8]}")  # no step- in it either
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            continue  # set aside by another writer meanwhile
        logger.warning("an incomplete checkpoint folder %s (a save that died) is replaced by a complete one", target)
        filesystem.rmtree(aside)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: the process group's, else torchrun's ``RANK`` / ``WORLD_SIZE``."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def event_source(replicas_in=None) -> tuple[int, int]:
    """``(replica, rank in it)`` this process's events are named by: with ``replicas_in`` (the ``[parallelism]`` of
    a checkpoint-restart job, one torchrun whose replicated dimension is the replicas) from its layout, as the
    mode names its own; else the replica group's (``REPLICA_ENV``, 0 in a plain run) and the rank."""
    rank, world = rank_and_world()
    if replicas_in is None:
        return int(os.environ.get(REPLICA_ENV, "0")), rank
    from titan_recover.config.validate import resolve_layout

    return resolve_layout(replicas_in, world).replica_and_rank(rank)


TRAIN_STATE = "train_state"
"""The key under which TorchTitan's trainer hands itself (step, tokens seen) to the checkpoint manager."""


def stale_checkpoints(steps: list[int], complete: list[int], keep: int) -> list[int]:
    """The step folders to purge so that the newest ``keep`` complete checkpoints remain: every folder older than
    the oldest of them. Folders newer than it stay (a save in flight, or one whose writer died, removed once a
    newer complete checkpoint makes it old); with fewer than ``keep`` complete checkpoints nothing is purged."""
    kept = sorted(complete)[-keep:] if keep > 0 else []
    if keep <= 0 or len(kept) < keep:
        return []
    return sorted(s for s in steps if s < kept[0])


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
        initial_load_model_only: bool | None = None
        """TorchTitan's key: load only the model from ``initial_load_path`` (not the optimizer, schedule, step).
        Unset: on when ``initial_load_path`` is set (TorchTitan's default) and off without one, where it has no
        effect; ``true`` without an ``initial_load_path`` is refused (it would do nothing)."""

        load_verified: bool | None = None
        """Load the newest checkpoint recorded as verified by a clean parameter vote (docs/scout.md section 4)
        instead of TorchTitan's newest when ``load_step = -1``. Unset: on in a replica-group job (``[recover]
        replicas > 1``, ``mode = "sync"``) whose ``[recover.localize] vote`` is on."""

        _snapshot: SnapshotConfig | None = None
        """``[recover.snapshot]``, handed over by the config loader (users set it there, not here): with
        ``interval > 0`` every rank refills from the keepers' snapshots after the durable load."""

        _replicas_in: Any = None
        """``[parallelism]`` in checkpoint-restart mode, handed over by the config loader: its replicated
        data-parallel dimension is the job's replicas, and the events are named ``replica/rank in it`` from it, as
        the mode names its own (:meth:`Layout.replica_and_rank`). None: the replica group's (``REPLICA_ENV``)."""

    writer: bool = True
    """This process writes the checkpoints of the steps it trains. The trainer sets it from each step's report:
    in sync mode only the lowest member replica of the committing epoch writes (the others hold the same bytes);
    a skipped save returns False, as TorchTitan's does on a step without a checkpoint."""

    snapshots: Snapshots | None = None
    """This rank's in-memory snapshots with ``[recover.snapshot] interval > 0``: restored by :meth:`load`; the
    ``single`` mode calls ``take(step)`` after a step, ``before_optimizer()`` before every optimizer step, ``wait()``
    at the end."""

    def __init__(self, config: Config, *, model_parts, optimizers, lr_schedulers, states: dict[str, Any],
                 base_folder: str = "", **kwargs):
        self.load_verified = bool(config.load_verified)
        self._full_state_saved: int | None = None
        """The last step whose full training state this manager saved (a stop's checkpoint need not save it again)."""
        self._train_state = states.get(TRAIN_STATE)
        self._events: EventLog | None = None
        self._replicas_in = config._replicas_in
        self._run_dir = os.environ.get(RUN_DIR_ENV, base_folder)
        super().__init__(config, model_parts=model_parts, optimizers=optimizers, lr_schedulers=lr_schedulers,
                         states=states, base_folder=base_folder, **kwargs)
        if config._snapshot is not None and config._snapshot.interval > 0:
            folder = os.path.join(base_folder, config.folder)  # TorchTitan's folder, set only when it is enabled
            self.snapshots = self._connect_snapshots(config._snapshot, model_parts, optimizers, lr_schedulers, folder)

    def _connect_snapshots(self, config: SnapshotConfig, model_parts, optimizers, lr_schedulers,
                           folder: str) -> Snapshots:
        if self._train_state is None:
            raise ValueError(f"snapshots need the trainer's state: build the checkpoint manager with "
                             f"states={{{TRAIN_STATE!r}: trainer}}, as TorchTitan's trainer does")
        rank, world = rank_and_world()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        state = TrainingState(model_parts, list(optimizers), lr_schedulers, train_state=self._train_state)
        keepers = keeper_addresses(config, gather=gather_from_ranks, local_ranks=local_ranks)
        snapshots = Snapshots(state, keepers=keepers, rank=rank, ranks=world, local_ranks=local_ranks,
                              events=self.events, job=snapshot_job(folder))
        logger.info("rank %d: snapshots go to node %d's keeper %s (of %d)", rank, snapshots.buddy,
                    keepers[snapshots.buddy], len(keepers))
        return snapshots

    @property
    def events(self) -> EventLog:
        """The run's event log, as this rank writes it (``<run>/events.jsonl``, source ``replica/rank``)."""
        if self._events is None:
            replica, rank = event_source(self._replicas_in)
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
        if step != -1 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            # a step asked for by name (checkpoint.load_step) is what the user wants, not a newer snapshot; the
            # snapshots this job holds belong to the timeline it rolls back from. torchrun's restarts pass the same
            # step: they refill from the snapshots taken since
            logger.info("checkpoint.load_step = %d asked for: the keepers' snapshots of this job are discarded", step)
            self.snapshots.discard()
            return loaded
        durable_step = self._train_state.state_dict()["step"]
        return self.snapshots.restore(durable_step=durable_step) is not None or loaded

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """TorchTitan's save on the checkpoint writer; nothing elsewhere."""
        if not self.writer:
            return False
        if not last_step and getattr(self, "_full_state_saved", None) == curr_step:
            return True  # saved already, on request (save_resumable): the same state
        pending = getattr(self, "save_future", None)
        saved = super()._save(curr_step, last_step)
        if saved and not last_step:
            self._full_state_saved = curr_step  # the full training state (a last step's may be model-only)
            future = getattr(self, "save_future", None)
            if future is not None and future is not pending:  # an asynchronous save: its write goes on
                self._report_complete(curr_step, future)
        return saved

    def _report_complete(self, step: int, future: Future) -> None:
        """Log ``checkpoint_complete`` once the background write of an asynchronous save of ``step`` succeeded (the
        checkpoint is then complete: a restart can load it), with ``write_s``, the seconds it took after the save's
        blocking part returned. A failure before then restarts from the checkpoint before: the simulator's
        ``checkpoint_write_s`` (docs/simulator.md)."""
        returned, events, reported = time.monotonic(), self.events, threading.Event()

        def done(f) -> None:  # on the thread that completed the write
            try:
                if not f.cancelled() and f.exception() is None:
                    events.emit("checkpoint_complete", console=False, step=step,
                                write_s=round(time.monotonic() - returned, 3))
            finally:
                reported.set()

        self._reported = reported
        future.add_done_callback(done)

    def _wait_for_saving(self) -> None:
        """TorchTitan's wait for the last asynchronous save, then for its ``checkpoint_complete`` to be logged: a
        future wakes the threads waiting for it before it runs its done-callbacks, so without this the event could
        come after the wait (or never, at the end of a job). Bounded by :data:`REPORT_WAIT_S`: a log that does not
        get written holds nothing up."""
        super()._wait_for_saving()
        reported, self._reported = getattr(self, "_reported", None), None
        if reported is not None and not reported.wait(REPORT_WAIT_S):
            logger.warning("an asynchronous save completed but its checkpoint_complete event was not logged within "
                           "%.0f s; going on without it", REPORT_WAIT_S)

    def save_resumable(self, step: int) -> bool:
        """A checkpoint of ``step`` the job resumes from, written now on the checkpoint writer (a stop's, or one
        requested while the job trains on): the full
        training state, synchronously, whatever the interval says, and whatever ``last_save_model_only`` /
        ``last_save_in_hf`` / ``export_dtype`` say: those shape TorchTitan's final export (``save(last_step=True)``),
        whose model-only folder a later start could not load (TorchTitan loads the full state of any step but 0).
        False where nothing is written (checkpoints off or load-only, or not the writer)."""
        if not self.enable or self.load_only or not self.writer:
            return False
        self.maybe_wait_for_saving()
        if getattr(self, "_full_state_saved", None) == step:  # this step's full state is saved: the same state
            logger.info("the checkpoint of step %d, saved already, is the one to resume from", step)
            return True
        logger.info("saving a full checkpoint of step %d to resume from", step)
        target = self._create_checkpoint_id(step)
        if filesystem.is_remote(target):  # no atomic rename on an object store: written in place
            self.dcp_save(self._flattened_model_states_sd(), checkpoint_id=target, async_mode=AsyncMode.DISABLED,
                          enable_garbage_collection=True)
        else:
            self._save_staged(step, target)
        self._full_state_saved = step
        self._purge_stale_checkpoints()
        return True

    def _save_staged(self, step: int, target: str) -> None:
        """Write ``step`` into this replica's staging folder, then (rank 0, once DCP returned: every shard and the
        metadata are written) publish it as ``target``. Two writers of the same step (a stop's writer named lost
        that still saves, and the next in turn) then never write into one folder, and one that dies mid-save leaves
        the other's checkpoint as it was (docs/replica_groups.md "Checkpoints")."""
        replica = int(os.environ.get(REPLICA_ENV, "0"))
        staging = filesystem.join(self.folder, staging_name(step, replica))
        self.dcp_save(self._flattened_model_states_sd(), checkpoint_id=staging, async_mode=AsyncMode.DISABLED,
                      enable_garbage_collection=True)
        if rank_and_world()[0] == 0 and not publish(staging, target):
            logger.info("the checkpoint of step %d was in place already (another replica's, the same state): "
                        "this replica's copy is removed", step)

    def _purge_stale_checkpoints(self) -> None:
        """TorchTitan's purge (rank 0, ``keep_latest_k > 0``, through its purge thread), counting only complete
        checkpoints (:func:`stale_checkpoints`)."""
        if not self._should_purge():
            return
        names = filesystem.listdir(self.folder)
        steps = [int(m.group(1)) for name in names if (m := STEP_DIR.match(name))]
        done = [s for s in steps if complete(self._create_checkpoint_id(s))]
        for step in stale_checkpoints(steps, done, self.keep_latest_k):
            self.purge_queue.put(self._create_checkpoint_id(step))
        for name in names:  # a staging folder whose writer died, of a step no newer than a complete checkpoint
            if (m := _STAGING_DIR.match(name)) and done and int(m.group(1)) <= max(done):
                self.purge_queue.put(filesystem.join(self.folder, name))

    def _load(self, step: int = -1) -> bool:
        founding = os.environ.get(FOUNDING_STEP_ENV)
        if founding is not None:  # a start made after losing every replica: the step every group loads
            step = int(founding)
            self.events.emit("checkpoint_choice", step=step, reason=f"step {step}, chosen by the coordinator for "
                             "every group's restart after losing every replica")
            return super()._load(step)
        if self.load_verified:
            step, reason = verified_load_step(self.folder, step)
            if reason is not None:
                self.events.emit("checkpoint_choice", step=None if step == -1 else step, reason=reason)
                if step == -1 and only_unverified(self.folder):
                    logger.warning("%s", reason)
        return super()._load(step)
