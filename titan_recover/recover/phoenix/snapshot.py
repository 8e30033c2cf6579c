"""The trainer's entry to in-memory snapshots (take: :mod:`.snapshots`, keeper process: :mod:`.keeper`)."""

from __future__ import annotations

import os

import torch

from titan_recover.recover.phoenix.snapshots import keeper_addresses, Snapshots


def attach_snapshots(trainer, events) -> Snapshots:
    """Snapshots of ``trainer`` every ``[recover.snapshot] interval`` steps, and their restore right after
    TorchTitan's checkpointer has loaded (or not found) a durable checkpoint."""
    config = trainer.config.recover.snapshot
    keepers = keeper_addresses(config)
    world = torch.distributed.get_world_size()
    snapshots = Snapshots(trainer.training_state(), keepers=keepers, rank=torch.distributed.get_rank(), ranks=world,
                          local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", world)), events=events)
    load = trainer.checkpointer.load

    def load_then_restore(*args, **kwargs):
        loaded = load(*args, **kwargs)
        restored = snapshots.restore(durable_step=trainer.step)
        return loaded or restored is not None

    trainer.checkpointer.load = load_then_restore
    trainer.optimizers.register_step_pre_hook(lambda *_args, **_kwargs: snapshots.before_optimizer())
    return snapshots
