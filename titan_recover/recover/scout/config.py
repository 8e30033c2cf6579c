"""``[recover.localize]``: the settings of SCOUT's localisation (docs/scout.md)."""

from __future__ import annotations

from dataclasses import dataclass

INCONCLUSIVE_ACTIONS = ("stop", "continue")


@dataclass(kw_only=True, slots=True)
class LocalizeConfig:
    """``[recover.localize]``: naming silent corruption and stragglers by consensus among replicas (docs/scout.md)."""

    vote: bool = True
    """Every rank signs its parameter shard and optimizer state (a 32-bit integer sum of their bits) into each
    step's reduction; the members vote by strict majority before the step commits: an outlier replica is evicted
    and its microbatches are computed by the others in the same step."""

    replay_interval: int = 0
    """Every this many steps one sampled microbatch is computed again by the two members after its holder and the
    three gradient-and-loss signatures are voted on: catches corruption of a computation, which the reduction
    would spread to every replica (0: off; needs deterministic kernels, which CPU and TorchTitan's
    ``debug.deterministic`` give)."""

    replay_seed: int = 0
    """Seed of the sampled microbatch (a function of seed and step, the same on every rank)."""

    on_inconclusive: str = "stop"
    """Replicas disagree without a strict majority (two replicas, or a tie): ``stop`` the job without committing
    the step (resume from the newest verified checkpoint), or ``continue`` (report it and commit)."""

    straggler_threshold: float = 3.5
    """Robust z-score (median / MAD over replicas) of time per microbatch above which a replica is slow."""

    straggler_confirm_steps: int = 3
    """Consecutive slow steps that confirm a straggler (and fast ones that clear it)."""

    hang_threshold_s: float = 0.0
    """Start a hang observer process next to every replica group: when a rank's progress beacon has not moved for
    this long it names the rank behind or the diverged collective and writes a report (0: no observer). Must
    exceed the longest step phase (one microbatch's forward and backward, the optimizer step)."""

    end_hung: bool = True
    """The observer ends a hung replica's processes, so that the others treat it as failed (and the launcher may
    restart it)."""

    def __post_init__(self) -> None:
        if self.replay_interval < 0:
            raise ValueError(f"recover.localize.replay_interval must be >= 0 (0: off), got {self.replay_interval}")
        if self.on_inconclusive not in INCONCLUSIVE_ACTIONS:
            raise ValueError(f"recover.localize.on_inconclusive must be one of {', '.join(INCONCLUSIVE_ACTIONS)}, "
                             f"got {self.on_inconclusive!r}")
        if self.hang_threshold_s < 0:
            raise ValueError(f"recover.localize.hang_threshold_s must be >= 0 (0: no observer), got {self.hang_threshold_s}")
        if self.straggler_threshold <= 0 or self.straggler_confirm_steps < 1:
            raise ValueError("recover.localize.straggler_threshold must be > 0 and straggler_confirm_steps >= 1, "
                             f"got {self.straggler_threshold} and {self.straggler_confirm_steps}")

    @property
    def witnesses(self) -> bool:
        """Signatures travel in the reduction (a vote or a replay is on)."""
        return self.vote or self.replay_interval > 0
