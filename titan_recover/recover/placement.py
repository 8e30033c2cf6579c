"""Which GPUs of this node each replica group gets (docs/replica_groups.md "Device placement"; pure).

TorchTitan places a rank on ``cuda:LOCAL_RANK``, and every replica group is a torchrun of its own whose local ranks
start at 0: without a split, every group would land on the first GPUs of the node. The launcher gives group ``i``
of ``W`` ranks the visible devices ``i W ... (i + 1) W - 1`` through ``CUDA_VISIBLE_DEVICES``, so its local rank
``r`` is its own device. A node with fewer GPUs than groups x ranks is refused before any process starts, unless
``[recover] share_devices`` lets groups share them (tests on a machine with one GPU). The diloco syncer evaluates on
CPU, or on a visible GPU ``[recover.diloco] eval_device`` names, which must not be a group's (same exception).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def visible_devices(count: Callable[[], int], environ: Mapping[str, str] = os.environ) -> list[str]:
    """The devices this node's processes may use: ``CUDA_VISIBLE_DEVICES`` if set (ids or UUIDs, in its order),
    else ``0 ... count() - 1``."""
    listed = environ.get(VISIBLE_ENV)
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(count())]


def group_devices(groups: int, ranks: int, visible: list[str], *, share: bool = False,
                  spares: int = 0) -> list[list[str]]:
    """The devices of each replica group (``groups`` includes ``spares``), ``ranks`` each, in local-rank order.

    Raises ``ValueError`` spelling out the arithmetic when the node has too few devices: fewer than one group needs
    (always), or fewer than all groups need (unless ``share``; groups then take ``ranks`` consecutive devices
    each, wrapping around, so a group's own devices are still distinct)."""
    available = len(visible)
    if ranks > available:
        raise ValueError(f"a replica group of {ranks} processes needs {ranks} GPUs, this node has {available} "
                         f"({VISIBLE_ENV}={','.join(visible) or '(none)'})")
    needed = groups * ranks
    if needed > available and not share:
        spare_note = f" (recover.replicas {groups - spares} + recover.spares {spares})" if spares else ""
        raise ValueError(
            f"{groups} replica groups{spare_note} x {ranks} processes need {needed} GPUs, this node has "
            f"{available}: lower recover.replicas / recover.spares or the parallel degrees of a group, use more "
            "nodes (docs/replica_groups.md), or set recover.share_devices = true to let the groups share GPUs (for "
            "tests: every group's memory then lands on the same devices)")
    return [[visible[(g * ranks + r) % available] for r in range(ranks)] for g in range(groups)]


def shared_devices(groups: list[list[str]]) -> list[str]:
    """The devices more than one replica group got (``groups``: what :func:`group_devices` gave them), in order."""
    owners: dict[str, int] = {}
    for devices in groups:
        for device in dict.fromkeys(devices):
            owners[device] = owners.get(device, 0) + 1
    return [device for device, count in owners.items() if count > 1]


def check_backend_on_shared_devices(backend: str, groups: list[list[str]]) -> None:
    """Replica groups sharing GPUs (``share_devices``) cannot reduce across replicas through NCCL, which refuses a
    communicator with two ranks on one GPU (the cross-replica group's rank ``r`` of two groups that got the same
    device): ValueError saying what to set, for ``nccl`` and for ``auto`` (NCCL on CUDA)."""
    shared = shared_devices(groups)
    if shared and backend in ("nccl", "auto"):
        raise ValueError(
            f"recover.share_devices puts several replica groups on GPU(s) {','.join(shared)}, and [recover.ftpg] "
            f"backend = {backend!r} reduces across the groups through NCCL, which refuses a communicator with two "
            "ranks on one GPU: set recover.ftpg.backend = \"gloo\" (its CUDA path stages through pinned host "
            "memory), or give every group its own GPUs")


def evaluation_device(eval_device: str, groups: list[list[str]], visible: list[str], *, share: bool = False
                      ) -> str | None:
    """The visible device the diloco syncer evaluates on for ``[recover.diloco] eval_device``: None for ``"cpu"``;
    for ``"cuda:N"`` the node's ``N``-th visible device (the syncer inherits the node's ``CUDA_VISIBLE_DEVICES``,
    so ``cuda:N`` names the same device in its process). Raises ``ValueError`` when there is no such device, or,
    unless ``share``, when it is one of the replica groups' (``groups``: what :func:`group_devices` gave them)."""
    if eval_device == "cpu":
        return None
    index = int(eval_device.removeprefix("cuda:"))
    if index >= len(visible):
        raise ValueError(f"recover.diloco.eval_device = {eval_device!r}, but this node has {len(visible)} GPUs "
                         f"({VISIBLE_ENV}={','.join(visible) or '(none)'})")
    device = visible[index]
    owner = next((g for g, devices in enumerate(groups) if device in devices), None)
    if owner is not None and not share:
        used = sum(len(devices) for devices in groups)
        free = f"cuda:{used}" + (f" ... cuda:{len(visible) - 1}" if len(visible) - used > 1 else "")
        choices = f"'cpu' or a GPU no group uses ({free})" if used < len(visible) else "'cpu' (every GPU is a group's)"
        raise ValueError(f"recover.diloco.eval_device = {eval_device!r} is replica group {owner}'s GPU: the syncer "
                         f"would take memory its learner needs; use {choices}, or set recover.share_devices = true")
    return device
