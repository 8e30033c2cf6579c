"""``[recover.diloco]``: the settings of Decoupled DiLoCo (docs/diloco.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class DilocoConfig:
    """``[recover.diloco]``: Decoupled DiLoCo, learners that never wait for each other (docs/diloco.md)."""

    inner_steps: int = 50
    """H: every fragment is sent to the syncer once every H inner steps of a learner."""

    fragments: int = 4
    """F: the parameters are split into F contiguous fragments whose syncs are staggered over the H steps."""

    outer_lr: float = 0.7
    """Learning rate of the syncer's outer optimizer (SGD with Nesterov momentum)."""

    outer_momentum: float = 0.9
    """Nesterov momentum of the outer optimizer (0: plain SGD)."""

    min_quorum: int = 2
    """A fragment's round merges once this many learners delivered a delta (fewer when fewer are alive)."""

    max_window_s: float = 30.0
    """Longest grace window after the quorum: a later learner is never waited for longer than this."""

    checkpoint_interval_s: float = 60.0
    """The syncer writes its state (global fragments, outer optimizer, versions, progress) this often: a syncer
    crash costs at most this much of merged progress."""

    eval_interval_s: float = 30.0
    """The syncer evaluates the global model on the validation slice this often (0: only at start and end)."""

    eval_microbatches: int = 4
    """Size of the validation slice, in replica microbatches: the ids right after the job's training budget."""

    eval_device: str = "cpu"
    """Where the syncer evaluates the global model: ``"cpu"``, or ``"cuda:N"``, the node's ``N``-th visible GPU, one
    that no learner uses (the launcher refuses a learner's GPU unless ``recover.share_devices``). A bare ``"cuda"``
    is refused: it would be ``cuda:0``, the first learner's."""

    syncer_max_restarts: int = 3
    """How often the launcher restarts a syncer that crashed (it resumes from its checkpoint)."""

    syncer_port: int = 0
    """TCP port of the syncer's store; 0 picks a free one (its address is published through the coordinator)."""

    syncer_timeout_s: float = 60.0
    """A syncer whose beat in the job's store stayed unchanged this long is hung: the launcher kills it and restarts
    it from its checkpoint. It beats once per pass of its loop, so this bounds its longest pass: a merge, a
    checkpoint write, an evaluation of the global model (raise it for a large model's validation slice)."""

    def __post_init__(self) -> None:
        for name in ("inner_steps", "fragments", "min_quorum", "eval_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"recover.diloco.{name} must be >= 1, got {getattr(self, name)}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError("recover.diloco.outer_lr must be > 0 and outer_momentum in [0, 1), got "
                             f"{self.outer_lr} and {self.outer_momentum}")
        if self.syncer_timeout_s <= 0:
            raise ValueError(f"recover.diloco.syncer_timeout_s must be > 0, got {self.syncer_timeout_s}")
        for name in ("max_window_s", "checkpoint_interval_s", "eval_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"recover.diloco.{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_interval_s == 0:
            raise ValueError("recover.diloco.checkpoint_interval_s must be > 0: it bounds what a syncer crash costs")
        if not re.fullmatch(r"cpu|cuda:\d+", self.eval_device):
            raise ValueError("recover.diloco.eval_device must be 'cpu' or 'cuda:N' (N: a visible GPU no learner "
                             f"uses), got {self.eval_device!r}")
        if self.syncer_max_restarts < 0:
            raise ValueError(f"recover.diloco.syncer_max_restarts must be >= 0, got {self.syncer_max_restarts}")
