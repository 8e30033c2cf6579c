"""A replica's final parameters, for comparing runs bitwise (``[recover] save_final_parameters``, the
``final_parameters`` event)."""

from __future__ import annotations

import hashlib
import os

import torch

from titan_recover.recover.phoenix.state_transfer import local_tensor


def save_final_parameters(model_parts, folder: str, *, replica: int, rank: int) -> None:
    """Every local parameter shard of this rank, by name, to ``folder/replica{i}_rank{k}.pt``."""
    os.makedirs(folder, exist_ok=True)
    shards = {name: local_tensor(p.data).detach().cpu().clone()
              for m in model_parts for name, p in m.named_parameters()}
    path = os.path.join(folder, f"replica{replica}_rank{rank}.pt")
    torch.save(shards, path + ".tmp")
    os.replace(path + ".tmp", path)


def parameter_digest(model_parts) -> str:
    """sha256 of this rank's local parameter shards (bitwise identity across replicas, without copying)."""
    digest = hashlib.sha256()
    for m in model_parts:
        for p in m.parameters():
            digest.update(local_tensor(p.data).detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
