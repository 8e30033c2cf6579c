"""The syncer's files: its checkpoint (global fragments, outer optimizer states, versions, progress) and the final
global model, each written to a temporary file then renamed, so a crash while saving leaves the previous one.

Each syncer start writes its checkpoint under its own generation (``syncer/checkpoint.g<generation>.pt``) and, once
saved, deletes those of earlier generations; a start resumes from the newest generation's. Generations are given
out one by one by the job's store (by the leader only, with standby syncers), so a syncer that lost its role and
saves once more before it notices writes an older generation's file, which the next start does not choose: it
never replaces the state of the syncer that took over."""

from __future__ import annotations

import os
import re

import torch

_CHECKPOINT = re.compile(r"checkpoint\.g(\d+)\.pt")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "syncer")


def checkpoint_path(run_dir: str, generation: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f"checkpoint.g{generation}.pt")


def saved_generations(run_dir: str) -> list[int]:
    """The generations whose checkpoint is in ``run_dir``, oldest first."""
    folder = checkpoint_dir(run_dir)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(m.group(1)) for m in map(_CHECKPOINT.fullmatch, names) if m)


def global_model_path(run_dir: str) -> str:
    return os.path.join(run_dir, "diloco_global.pt")


def save_atomically(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(state: dict, run_dir: str, generation: int) -> None:
    """Save this generation's checkpoint, then delete every earlier generation's."""
    save_atomically(state, checkpoint_path(run_dir, generation))
    for older in saved_generations(run_dir):
        if older < generation:
            try:
                os.remove(checkpoint_path(run_dir, older))
            except FileNotFoundError:  # deleted by another start meanwhile
                pass


def load_checkpoint(run_dir: str) -> dict | None:
    """The newest generation's saved state, or None when there is none (the syncer's first start)."""
    generations = saved_generations(run_dir)
    if not generations:
        return None
    return torch.load(checkpoint_path(run_dir, generations[-1]), weights_only=False)
