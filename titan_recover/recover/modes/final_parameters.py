"""A replica's final training state, for comparing runs bitwise (``[recover] save_final_parameters``, the
``final_parameters`` event): its parameter shards, and its optimizer and learning-rate schedule state."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable

import torch

from titan_recover.recover.phoenix.state_transfer import local_tensor

SCHEDULER_FIELDS = ("last_epoch", "base_lrs", "_last_lr")
"""What a rank's learning-rate schedule is, per scheduler: its position (``last_epoch``, which TorchTitan
checkpoints), the base rates and the rate the last step set. ``_step_count`` is left out: torch keeps it only to
warn about the order of calls, and a schedule restored from a checkpoint restarts it."""


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor``, copied to the host (once, at the end of training: not on a step's path)."""
    return local_tensor(tensor).detach().to("cpu", copy=True)  # one copy, from a device or on the host


def save_final_parameters(model_parts, folder: str, *, replica: int, rank: int) -> None:
    """Every local parameter shard of this rank, by name, to ``folder/replica{i}_rank{k}.pt``."""
    shards = {name: _host_copy(p.data) for m in model_parts for name, p in m.named_parameters()}
    _save(shards, folder, replica=replica, rank=rank)


def optimizer_state(model_parts, optimizers: Iterable[torch.optim.Optimizer], lr_schedulers) -> dict[str, Any]:
    """This rank's optimizer and schedule state as plain values: ``optimizer`` (parameter name -> its state, every
    tensor a local shard on the CPU: AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``), ``param_groups`` (per
    optimizer, each group's hyperparameters, the current ``lr`` among them) and ``lr_schedulers`` (per scheduler,
    :data:`SCHEDULER_FIELDS`)."""
    names = {id(p): name for m in model_parts for name, p in m.named_parameters()}
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for opt in optimizers:
        groups.append([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError("an optimizer holds a parameter that no model part names")
                state[names[id(p)]] = {k: _host_copy(v) if isinstance(v, torch.Tensor) else v
                                       for k, v in opt.state.get(p, {}).items()}
    schedulers = [{k: s.state_dict()[k] for k in SCHEDULER_FIELDS} for s in lr_schedulers]
    return {"optimizer": state, "param_groups": groups, "lr_schedulers": schedulers}


def save_final_optimizer_state(model_parts, optimizers, lr_schedulers, folder: str, *, replica: int,
                               rank: int) -> None:
    """:func:`optimizer_state` of this rank to ``folder/replica{i}_rank{k}.pt``."""
    _save(optimizer_state(model_parts, optimizers, lr_schedulers), folder, replica=replica, rank=rank)


def _save(value, folder: str, *, replica: int, rank: int) -> None:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"replica{replica}_rank{rank}.pt")
    torch.save(value, path + ".tmp")
    os.replace(path + ".tmp", path)


def parameter_digest(model_parts) -> str:
    """sha256 of this rank's local parameter shards (bitwise identity across replicas, without copying)."""
    digest = hashlib.sha256()
    for m in model_parts:
        for p in m.parameters():
            digest.update(local_tensor(p.data).detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
