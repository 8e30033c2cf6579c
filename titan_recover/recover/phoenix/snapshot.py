"""The trainer's entry to in-memory snapshots, kept for ``titan_recover/trainer.py`` until it takes them itself.

The snapshots live in :mod:`~titan_recover.recover.phoenix.snapshots` (take, restore) and
:mod:`~titan_recover.recover.phoenix.keeper` (the keeper process); the project's checkpoint manager builds a rank's
:class:`~titan_recover.recover.phoenix.snapshots.Snapshots` and restores them when TorchTitan's trainer loads.
"""

from __future__ import annotations

from titan_recover.recover.phoenix.snapshots import Snapshots


def attach_snapshots(trainer, events=None) -> Snapshots:
    """The snapshots the checkpoint manager built for ``trainer`` (``[recover.snapshot] interval > 0``), with the
    wait for a snapshot's copy before every optimizer step. ``events`` is unused: the snapshots write to the
    manager's event log (the same file and source)."""
    snapshots = getattr(trainer.checkpointer, "snapshots", None)
    if snapshots is None:
        raise RuntimeError("[recover.snapshot] interval > 0 needs the project's checkpoint manager "
                           "(titan_recover.checkpoint.RecoverCheckpointManager, which the config loader selects)")
    trainer.optimizers.register_step_pre_hook(lambda *_args, **_kwargs: snapshots.before_optimizer())
    return snapshots
