"""Verified durable checkpoints (docs/scout.md section 4).

A checkpoint of step ``s`` holds the state after step ``s``'s optimizer step; the parameter vote of step ``s + 1``
reads exactly that state on every member. When step ``s + 1`` commits with the vote on, every rank's vote was
clean (any refusal aborts the commit for every member), so rank 0 of the replica that writes the checkpoints (the
lowest member of the committing epoch) records ``s`` in ``<checkpoint folder>/verified_steps.json``, provided the
replica that wrote checkpoint ``s`` is a member of that epoch (:func:`verifies_previous`). On load, the newest checkpoint whose step is recorded there is the one
loaded (by :class:`titan_recover.checkpoint.RecoverCheckpointManager`); a folder with checkpoints but no record (a
run without votes) loads TorchTitan's newest, with a warning.
The final step of a run has no next vote: its checkpoint stays unverified.
"""

from __future__ import annotations

import json
import logging
import os
import re

logger = logging.getLogger(__name__)

LEDGER = "verified_steps.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
"""A checkpoint's folder under the checkpoint folder, as TorchTitan names it: ``step-N``."""
METADATA = ".metadata"
"""The file DCP writes last, once every shard of a checkpoint is written: a folder holding it is complete."""


def verifies_previous(step: int, interval: int, clean: bool, previous_writer: int | None,
                      members: tuple[int, ...] | list[int]) -> bool:
    """Whether step ``step``, committed by ``members`` after a ``clean`` vote, verifies the checkpoint of the step
    before it: that step saved a checkpoint (a multiple of ``interval``) and the replica that wrote it
    (``previous_writer``, None where unknown, e.g. on the first step after a start) voted in the clean vote. A
    writer evicted by this step's vote wrote a state the majority did not hold; the clean vote of the epoch without
    it says nothing about that checkpoint."""
    previous = step - 1
    return (clean and previous > 0 and previous % interval == 0 and previous_writer is not None
            and previous_writer in members)


def read_verified(folder: str) -> list[int]:
    try:
        with open(os.path.join(folder, LEDGER)) as fh:
            return sorted(json.load(fh)["steps"])
    except FileNotFoundError:
        return []


def mark_verified(folder: str, step: int) -> None:
    """Add ``step`` to the folder's record (written to a temporary file and renamed: never half-written)."""
    os.makedirs(folder, exist_ok=True)
    steps = sorted(set(read_verified(folder)) | {step})
    path = os.path.join(folder, LEDGER)
    with open(path + ".tmp", "w") as fh:
        json.dump({"steps": steps}, fh)
    os.replace(path + ".tmp", path)


def complete_checkpoints(folder: str) -> list[int]:
    """Steps with a complete DCP checkpoint (its ``.metadata`` is written last), as TorchTitan loads them."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(folder, name, METADATA)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def only_unverified(folder: str) -> bool:
    """Checkpoints and a verification record exist, but no checkpoint is verified: recovery falls back to the
    newest, unverified one (worth a warning)."""
    available = complete_checkpoints(folder)
    return (bool(available) and os.path.exists(os.path.join(folder, LEDGER))
            and not any(s in available for s in read_verified(folder)))


def step_to_load(folder: str) -> tuple[int | None, str]:
    """The checkpoint step recovery should load (None: TorchTitan's own choice) and why."""
    available = complete_checkpoints(folder)
    verified = [s for s in read_verified(folder) if s in available]
    if verified:
        newer = [s for s in available if s > verified[-1]]
        return verified[-1], (f"newest verified checkpoint, step {verified[-1]}"
                              + (f" (unverified newer: {newer})" if newer else ""))
    if only_unverified(folder):
        return None, f"no verified checkpoint among {available}: loading the newest, unverified"
    return None, "no verification record: TorchTitan's newest checkpoint"
