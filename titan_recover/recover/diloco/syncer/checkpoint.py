"""The syncer's files: its checkpoint (global fragments, outer optimizer states, versions, progress) and the final
global model, each written to a temporary file then renamed, so a crash while saving leaves the previous one."""

from __future__ import annotations

import os

import torch


def checkpoint_path(run_dir: str) -> str:
    return os.path.join(run_dir, "syncer", "checkpoint.pt")


def global_model_path(run_dir: str) -> str:
    return os.path.join(run_dir, "diloco_global.pt")


def save_atomically(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict | None:
    """The saved state, or None when there is none (the syncer's first start)."""
    return torch.load(path, weights_only=False) if os.path.exists(path) else None
