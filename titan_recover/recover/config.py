"""``[recover]``: replica groups, the fault-tolerant group across them, and their timeouts.

The subsections are declared next to their components and composed here: ``[recover.quota]`` and
``[recover.step]`` (invariant/), ``[recover.ftpg]`` (ftpg/), ``[recover.snapshot]`` (phoenix/),
``[recover.localize]`` (scout/), ``[recover.diloco]`` (diloco/).

With ``replicas = 1`` (the default) a run is plain TorchTitan training. With ``replicas = R >= 2`` the launcher
starts a coordinator and R replica groups (see docs/replica_groups.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_recover.recover.diloco.config import DilocoConfig
from titan_recover.recover.ftpg.base import FTPGConfig
from titan_recover.recover.invariant.quota import QuotaConfig
from titan_recover.recover.invariant.step_recovery import StepConfig
from titan_recover.recover.phoenix.snapshots import SnapshotConfig
from titan_recover.recover.scout.config import LocalizeConfig

# (smaller, larger) pairs that must hold strictly; see docs/replica_groups.md "Timeouts".
TIMEOUT_ORDER = (
    ("heartbeat_interval_s", "join_window_s"),
    ("join_window_s", "heartbeat_timeout_s"),
    ("heartbeat_timeout_s", "collective_timeout_s"),
    ("collective_timeout_s", "agree_timeout_s"),
    ("heartbeat_timeout_s", "progress_timeout_s"),
    ("heartbeat_interval_s", "coordinator_timeout_s"),
    ("coordinator_timeout_s", "agree_timeout_s"),
)


def check_store_url(url: str) -> None:
    """``[recover] store``: an etcd URL (ValueError with :func:`parse_store_url`'s message otherwise)."""
    from titan_recover.recover.stores import parse_store_url

    try:
        address = parse_store_url(url)
    except ValueError as e:
        raise ValueError(f"recover.store: {e}") from None
    if address.kind != "etcd":
        raise ValueError(f"recover.store = {url!r}: the TCPStore is embedded in the launcher, not named here; leave "
                         "recover.store empty for it (on many nodes it is at --rdzv-endpoint) or name an etcd "
                         "cluster: etcd://HOST:PORT[,HOST:PORT...][/PREFIX]")


MODE_NAMES = ("single", "sync", "diloco", "checkpoint_restart")
"""Registered in :mod:`titan_recover.recover.modes` under these names."""


@dataclass(kw_only=True, slots=True)
class RecoverConfig:
    """``[recover]``: resilience across replica groups."""

    replicas: int = 1
    """Replica groups, each a full model copy sharded inside by TorchTitan (its own torchrun). 1: plain run."""

    mode: str = "sync"
    """The registered training mode (docs/architecture.md). ``single``: plain TorchTitan training of one replica
    (what ``sync`` means with ``replicas = 1``). ``sync``: every step commits the same global batch across replica groups (docs/invariant.md). ``diloco``:
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

    share_devices: bool = False
    """On a GPU node every replica group gets its own GPUs (group ``i`` of ``W`` ranks: visible devices
    ``i W ... (i + 1) W - 1``), and a node with fewer GPUs than groups x ranks is refused. ``true`` lets groups
    share GPUs instead (tests on a machine with fewer GPUs; every group's memory then lands on the same devices;
    groups sharing a GPU need ``[recover.ftpg] backend = "gloo"``: NCCL refuses two ranks of a communicator on one)."""

    coordinator_port: int = 0
    """TCP port of the job's embedded store on one node (hosted by the launcher; the coordinator and every rank are
    its clients); 0 picks a free one. On many nodes the store is at ``--rdzv-endpoint`` instead (docs/deploy.md)."""

    store: str = ""
    """Where the job's store lives. ``""``: a TCPStore embedded in the launcher (of node 0, at ``--rdzv-endpoint``
    on many nodes, at ``127.0.0.1:coordinator_port`` on one); the job ends with that launcher. ``"etcd://HOST:PORT[,
    HOST:PORT...][/PREFIX]"``: an etcd cluster that nobody of the job hosts; each job's keys live under their own
    prefix, and every node runs a standby coordinator that takes over when the leading one is lost
    (docs/deploy.md)."""

    coordinator_restarts: int = 3
    """How often the launcher restarts a coordinator that died or hung; a restarted coordinator resumes the
    job's state from the store while the replicas train on. With none left the job stops with the last committed
    step (docs/replica_groups.md "Coordinator restarts")."""

    coordinator_timeout_s: float = 10.0
    """A coordinator whose beat in the store stayed unchanged this long is hung: the launcher kills and restarts
    it. Must be below ``agree_timeout_s`` (how long members wait for an epoch), so a replacement can decide in time."""

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

    preemption_grace_s: float = 0.0
    """0: ``SIGTERM`` ends the job at once, as torchrun does. Above 0: ``SIGTERM`` to the job's first process (the
    launcher; what Kubernetes, ``docker stop`` or systemd send before they kill a job) is a preemption notice: the
    job stops with a durable checkpoint of its last committed step, as on ``SIGUSR1``, and exits 143; whatever still
    runs this many seconds after it, or at a second ``SIGTERM``, is ended as ``SIGTERM`` ends it. With replica groups
    on many nodes, a notice to a node whose loss the job survives (node 1 and up on the embedded store, any node on
    etcd) makes that node's groups leave at once, as a lost node's do, and the others train on. The same ``SIGTERM``
    sent to every process of the node at once (SLURM) is that notice too: no process dies of it. Set it below the
    platform's own grace (Kubernetes ``terminationGracePeriodSeconds``, 30 s by default; ``docker stop``, 10 s); it
    needs ``[checkpoint] enable`` (docs/deploy.md "Preemption")."""

    save_final_parameters: bool = False
    """At the end, every rank writes its local parameter shards to ``<run>/final_parameters/`` and its optimizer and
    learning-rate schedule state to ``<run>/final_optimizer/`` (to compare runs bitwise)."""

    quota: QuotaConfig = field(default_factory=QuotaConfig)
    step: StepConfig = field(default_factory=StepConfig)
    ftpg: FTPGConfig = field(default_factory=FTPGConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    localize: LocalizeConfig = field(default_factory=LocalizeConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"recover.replicas must be >= 1, got {self.replicas}")
        if self.mode not in MODE_NAMES:
            raise ValueError(f"recover.mode must be one of {', '.join(MODE_NAMES)}, got {self.mode!r}")
        if self.mode == "single" and self.replicas > 1:
            raise ValueError(f"recover.mode = \"single\" trains one replica, got recover.replicas = {self.replicas}; "
                             "set mode = \"sync\" (or \"diloco\", \"checkpoint_restart\") for replica groups")
        if self.mode == "diloco":
            self._check_diloco()
        if self.mode == "checkpoint_restart" and self.spares:
            raise ValueError("recover.mode = \"checkpoint_restart\" restarts the whole job on a failure: there is no "
                             "share for a spare to take over; set recover.spares = 0")
        if self.store:
            check_store_url(self.store)
        if not 0 <= self.coordinator_port <= 65535:
            raise ValueError(f"recover.coordinator_port must be a TCP port, 0 ... 65535 (0: a free one), got "
                             f"{self.coordinator_port}")
        if self.rejoin_wait_s < 0:
            raise ValueError(f"recover.rejoin_wait_s must be >= 0, got {self.rejoin_wait_s}")
        if self.preemption_grace_s < 0:
            raise ValueError(f"recover.preemption_grace_s must be >= 0 (0: SIGTERM ends the job at once), got "
                             f"{self.preemption_grace_s}")
        if self.spares < 0 or self.max_restarts < 0 or self.coordinator_restarts < 0:
            raise ValueError(f"recover.spares, recover.max_restarts and recover.coordinator_restarts must be >= 0, "
                             f"got {self.spares}, {self.max_restarts} and {self.coordinator_restarts}")
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
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "join_window_s", "collective_timeout_s",
                     "agree_timeout_s", "progress_timeout_s", "startup_timeout_s", "coordinator_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"recover.{name} must be > 0, got {getattr(self, name)}")
        for smaller, larger in TIMEOUT_ORDER:
            if not getattr(self, smaller) < getattr(self, larger):
                raise ValueError(
                    f"recover.{smaller} ({getattr(self, smaller)}) must be smaller than recover.{larger} "
                    f"({getattr(self, larger)}): required order is heartbeat_interval_s < join_window_s < "
                    "heartbeat_timeout_s < collective_timeout_s < agree_timeout_s, heartbeat_timeout_s < "
                    "progress_timeout_s and heartbeat_interval_s < coordinator_timeout_s < agree_timeout_s "
                    "(docs/replica_groups.md)"
                )

    def _check_diloco(self) -> None:
        if self.replicas < 2:
            raise ValueError("recover.mode = \"diloco\" needs learners: set recover.replicas >= 2")
        if self.spares:
            raise ValueError("recover.spares is for the synchronous mode: a diloco learner never waits for "
                             "another, so there is no share to take over; set recover.spares = 0")
        if self.preemption_grace_s:
            raise ValueError("recover.preemption_grace_s stops a synchronous job with a checkpoint of its last step; "
                             "a diloco job's state is its syncer's checkpoint (recover.diloco.checkpoint_interval_s) "
                             "and SIGTERM ends it at once: set recover.preemption_grace_s = 0")
        if self.diloco.min_quorum > self.replicas:
            raise ValueError(f"recover.diloco.min_quorum ({self.diloco.min_quorum}) cannot exceed "
                             f"recover.replicas ({self.replicas})")
        if self.diloco.syncer_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"recover.diloco.syncer_timeout_s ({self.diloco.syncer_timeout_s}) must be larger "
                             f"than recover.heartbeat_interval_s ({self.heartbeat_interval_s}), how often the "
                             "syncer beats")

    @property
    def resolved_mode(self) -> str:
        """The mode that runs: ``sync`` with one replica is ``single``."""
        return "single" if self.mode == "sync" and self.replicas == 1 else self.mode

    @property
    def enabled(self) -> bool:
        """Replica groups that survive each other (sync or diloco): the launcher's coordinator and one torchrun per
        group."""
        return self.resolved_mode in ("sync", "diloco")

    @property
    def checkpoint_restart_mode(self) -> bool:
        return self.resolved_mode == "checkpoint_restart"

    @property
    def diloco_mode(self) -> bool:
        return self.resolved_mode == "diloco"

    @staticmethod
    def from_dict(fields: dict) -> "RecoverConfig":
        """The inverse of ``dataclasses.asdict`` (how the launcher hands the section to its child processes)."""
        return RecoverConfig(**{**fields, "quota": QuotaConfig(**fields.get("quota", {})),
                                "step": StepConfig(**fields.get("step", {})),
                                "ftpg": FTPGConfig(**fields.get("ftpg", {})),
                                "snapshot": SnapshotConfig(**fields.get("snapshot", {})),
                                "localize": LocalizeConfig(**fields.get("localize", {})),
                                "diloco": DilocoConfig(**fields.get("diloco", {}))})

    @property
    def groups(self) -> int:
        """Replica groups the launcher starts: the active ones and the spares."""
        return self.replicas + self.spares
