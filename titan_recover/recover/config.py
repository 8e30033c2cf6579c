"""``[recover]``: replica groups, the fault-tolerant group across them, and their timeouts.

With ``replicas = 1`` (the default) a run is plain TorchTitan training. With ``replicas = R >= 2`` the launcher
starts a coordinator and R replica groups (see docs/replica_groups.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# (smaller, larger) pairs that must hold strictly; see docs/replica_groups.md "Timeouts".
TIMEOUT_ORDER = (
    ("heartbeat_interval_s", "join_window_s"),
    ("join_window_s", "heartbeat_timeout_s"),
    ("heartbeat_timeout_s", "collective_timeout_s"),
    ("collective_timeout_s", "agree_timeout_s"),
    ("heartbeat_timeout_s", "progress_timeout_s"),
)


@dataclass(kw_only=True, slots=True)
class QuotaConfig:
    """``[recover.quota]``: the step's global microbatches and who computes which (docs/invariant.md)."""

    policy: str = "even"
    """Registered quota policy: ``even`` (equal shares), ``throughput`` (shares proportional to measured speed),
    ``drop`` (baseline with torchft's semantics: a lost replica's microbatches are skipped and the step in which it
    is lost is discarded)."""

    microbatches: int = 0
    """M, replica microbatches per step (global ids ``(step - 1) * M ... step * M - 1``). 0: replicas x gradient
    accumulation steps of one replica, the batch of the same job without failures."""

    exact: bool = False
    """Accumulate every microbatch's gradient and reduce across replicas in float64, cast back once: the committed
    gradient then does not depend on which replica computed which microbatch (bitwise-equal failure runs), at twice
    the gradient memory of the accumulator and twice the bytes reduced."""

    speed_smoothing: float = 0.5
    """Weight of the newest measurement in the speed estimate of each replica (exponential moving average)."""

    def __post_init__(self) -> None:
        from titan_recover.recover.quota import get_policy

        get_policy(self.policy)  # raises, naming the registered policies
        if self.microbatches < 0:
            raise ValueError(f"recover.quota.microbatches must be >= 0 (0: replicas x accumulation), got {self.microbatches}")
        if not 0 < self.speed_smoothing <= 1:
            raise ValueError(f"recover.quota.speed_smoothing must be in (0, 1], got {self.speed_smoothing}")


@dataclass(kw_only=True, slots=True)
class SnapshotConfig:
    """``[recover.snapshot]``: in-memory snapshots of a job without replicas (docs/phoenix.md)."""

    interval: int = 0
    """Every this many steps each rank's state goes to the host memory of its buddy node's keeper (0: off). For
    ``[recover] replicas = 1`` (replicas restore from each other); with ``max_restarts > 0`` torchrun restarts the
    job after a rank dies and every rank refills from the keepers instead of from disk."""

    keepers: list[str] = field(default_factory=list)
    """Keeper addresses ``HOST:PORT`` in node order for multi-node jobs (start ``python -m
    titan_recover.recover.snapshot --port P`` on every node); empty: the launcher starts one on this node."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"recover.snapshot.interval must be >= 0 (0: off), got {self.interval}")
        bad = [k for k in self.keepers if not k.rpartition(":")[2].isdigit() or not k.rpartition(":")[0]]
        if bad:
            raise ValueError(f"recover.snapshot.keepers must be HOST:PORT addresses, got {bad}")


INCONCLUSIVE_ACTIONS = ("stop", "continue")


@dataclass(kw_only=True, slots=True)
class LocalizeConfig:
    """``[recover.localize]``: naming silent corruption and stragglers by consensus among replicas (docs/scout.md)."""

    vote: bool = True
    """Every rank signs its parameter shard (a 32-bit integer sum of its bits) into each step's reduction; the
    members vote by strict majority before the step commits: an outlier replica is evicted and its microbatches
    are computed by the others in the same step."""

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


MODES = ("sync", "diloco", "checkpoint_restart")


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

    syncer_max_restarts: int = 3
    """How often the launcher restarts a syncer that crashed (it resumes from its checkpoint)."""

    syncer_port: int = 0
    """TCP port of the syncer's store; 0 picks a free one (its address is published through the coordinator)."""

    def __post_init__(self) -> None:
        for name in ("inner_steps", "fragments", "min_quorum", "eval_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"recover.diloco.{name} must be >= 1, got {getattr(self, name)}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError("recover.diloco.outer_lr must be > 0 and outer_momentum in [0, 1), got "
                             f"{self.outer_lr} and {self.outer_momentum}")
        for name in ("max_window_s", "checkpoint_interval_s", "eval_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"recover.diloco.{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_interval_s == 0:
            raise ValueError("recover.diloco.checkpoint_interval_s must be > 0: it bounds what a syncer crash costs")
        if self.syncer_max_restarts < 0:
            raise ValueError(f"recover.diloco.syncer_max_restarts must be >= 0, got {self.syncer_max_restarts}")


@dataclass(kw_only=True, slots=True)
class RecoverConfig:
    """``[recover]``: resilience across replica groups."""

    replicas: int = 1
    """Replica groups, each a full model copy sharded inside by TorchTitan (its own torchrun). 1: plain run."""

    mode: str = "sync"
    """``sync``: every step commits the same global batch across replica groups (docs/invariant.md). ``diloco``:
    each replica group is a learner with its own optimizer and a syncer merges their deltas without ever waiting
    for all of them (docs/diloco.md, ``[recover.diloco]``). ``checkpoint_restart``: the baseline the others are
    measured against (docs/evidence.md): the same job as one torchrun whose replica groups are TorchTitan's
    replicated data-parallel dimension (``data_parallel_replicate_degree = replicas``), any failure restarting the
    whole job (``max_restarts`` times) from TorchTitan's newest checkpoint (``[checkpoint]``)."""

    min_replicas: int = 1
    """Below this many live replicas the job stops with a durable checkpoint and a clear message."""

    spares: int = 0
    """Extra replica groups started as warm spares (docs/phoenix.md): members that hold no quota and apply every
    committed step, so that one takes over a lost replica's share at the next step with no state to move."""

    max_restarts: int = 0
    """How often the launcher restarts a replica group that crashed or was dropped; a restarted group is admitted
    at a step boundary and receives its state from a live replica's memory (docs/phoenix.md)."""

    rejoin_wait_s: float = 0.0
    """How long the running replicas hold a step boundary for a group the launcher is restarting, so that it is
    admitted at the next commit (torchft's quorum join timeout plays this part). 0: never wait; a restarted group
    is admitted at the first commit after it is ready."""

    coordinator_port: int = 0
    """TCP port of the coordinator's store; 0 picks a free one (single node). Fix it for multi-node jobs."""

    heartbeat_interval_s: float = 0.1
    """How often every rank writes its heartbeat and looks for a fault flag."""

    heartbeat_timeout_s: float = 2.0
    """A rank whose heartbeat is older than this is dead (killed or stopped): its replica is dropped."""

    join_window_s: float = 0.5
    """After a fault, how long the coordinator waits for live ranks to join the next epoch."""

    collective_timeout_s: float = 30.0
    """Upper bound of one collective across replicas."""

    agree_timeout_s: float = 60.0
    """How long a rank waits for the coordinator to publish the next epoch's members."""

    progress_timeout_s: float = 120.0
    """A rank whose main thread made no progress for this long is hung: its replica is dropped."""

    startup_timeout_s: float = 300.0
    """How long the coordinator waits for all replicas to register before forming epoch 0 without the missing."""

    max_epochs_per_step: int = 8
    """Bound on membership changes within one step, so an endless failure loop becomes a clear error."""

    save_final_parameters: bool = False
    """At the end, every rank writes its local parameter shards to ``<run>/final_parameters/`` (to compare runs)."""

    quota: QuotaConfig = field(default_factory=QuotaConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    localize: LocalizeConfig = field(default_factory=LocalizeConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"recover.replicas must be >= 1, got {self.replicas}")
        if self.mode not in MODES:
            raise ValueError(f"recover.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "diloco":
            if self.replicas < 2:
                raise ValueError("recover.mode = \"diloco\" needs learners: set recover.replicas >= 2")
            if self.spares:
                raise ValueError("recover.spares is for the synchronous mode: a diloco learner never waits for "
                                 "another, so there is no share to take over; set recover.spares = 0")
            if self.diloco.min_quorum > self.replicas:
                raise ValueError(f"recover.diloco.min_quorum ({self.diloco.min_quorum}) cannot exceed "
                                 f"recover.replicas ({self.replicas})")
        if self.mode == "checkpoint_restart" and self.spares:
            raise ValueError("recover.mode = \"checkpoint_restart\" restarts the whole job on a failure: there is no "
                             "share for a spare to take over; set recover.spares = 0")
        if self.rejoin_wait_s < 0:
            raise ValueError(f"recover.rejoin_wait_s must be >= 0, got {self.rejoin_wait_s}")
        if self.spares < 0 or self.max_restarts < 0:
            raise ValueError(f"recover.spares and recover.max_restarts must be >= 0, got {self.spares} and "
                             f"{self.max_restarts}")
        if self.snapshot.interval and self.replicas > 1:
            raise ValueError("recover.snapshot.interval is for a job without replicas (recover.replicas = 1): with "
                             "replicas, a restarted replica receives its state from a live one (docs/phoenix.md)")
        if self.snapshot.interval and not self.snapshot.keepers and not self.max_restarts:
            raise ValueError("recover.snapshot.interval needs recover.max_restarts > 0: snapshots refill a job that "
                             "torchrun restarts after a rank died")
        if self.spares and self.replicas < 2:
            raise ValueError("recover.spares needs replica groups: set recover.replicas >= 2 (a single replica's "
                             "rank failures are covered by [recover.snapshot], not by spares)")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(
                f"recover.min_replicas must be between 1 and recover.replicas ({self.replicas}), "
                f"got {self.min_replicas}"
            )
        if self.max_epochs_per_step < 1:
            raise ValueError(f"recover.max_epochs_per_step must be >= 1, got {self.max_epochs_per_step}")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "join_window_s", "collective_timeout_s",
                     "agree_timeout_s", "progress_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"recover.{name} must be > 0, got {getattr(self, name)}")
        for smaller, larger in TIMEOUT_ORDER:
            if not getattr(self, smaller) < getattr(self, larger):
                raise ValueError(
                    f"recover.{smaller} ({getattr(self, smaller)}) must be smaller than recover.{larger} "
                    f"({getattr(self, larger)}): required order is heartbeat_interval_s < join_window_s < "
                    "heartbeat_timeout_s < collective_timeout_s < agree_timeout_s, and heartbeat_timeout_s < "
                    "progress_timeout_s (docs/replica_groups.md)"
                )

    @property
    def enabled(self) -> bool:
        """Replica groups that survive each other (sync or diloco): the launcher's coordinator and one torchrun per
        group."""
        return self.replicas > 1 and self.mode != "checkpoint_restart"

    @property
    def checkpoint_restart_mode(self) -> bool:
        return self.mode == "checkpoint_restart"

    @property
    def diloco_mode(self) -> bool:
        return self.enabled and self.mode == "diloco"

    @staticmethod
    def from_dict(fields: dict) -> "RecoverConfig":
        """The inverse of ``dataclasses.asdict`` (how the launcher hands the section to its child processes)."""
        return RecoverConfig(**{**fields, "quota": QuotaConfig(**fields.get("quota", {})),
                                "snapshot": SnapshotConfig(**fields.get("snapshot", {})),
                                "localize": LocalizeConfig(**fields.get("localize", {})),
                                "diloco": DilocoConfig(**fields.get("diloco", {}))})

    @property
    def groups(self) -> int:
        """Replica groups the launcher starts: the active ones and the spares."""
        return self.replicas + self.spares
