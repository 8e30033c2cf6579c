"""The replica-group protocol's store keys and its pure decisions (tested without processes or clocks).

See docs/replica_groups.md for the contract these implement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


class Keys:
    """Store keys of the protocol, in one place."""

    EPOCH = "epoch"
    STOP = "stop"
    FINISHED = "finished"

    @staticmethod
    def register(replica: int, rank: int) -> str:
        return f"register/{replica}/{rank}"

    @staticmethod
    def done(replica: int, rank: int) -> str:
        return f"done/{replica}/{rank}"

    @staticmethod
    def heartbeat(replica: int, rank: int) -> str:
        return f"hb/{replica}/{rank}"

    @staticmethod
    def members(epoch: int) -> str:
        return f"epoch/{epoch}/members"

    @staticmethod
    def fault(epoch: int) -> str:
        return f"fault/e{epoch}"

    @staticmethod
    def join(epoch: int, replica: int, rank: int) -> str:
        return f"join/e{epoch}/{replica}/{rank}"

    @staticmethod
    def reduced(epoch: int, step: int | str) -> str:
        return f"reduced/e{epoch}/s{step}"

    @staticmethod
    def decision(epoch: int, step: int | str) -> str:
        return f"decision/e{epoch}/s{step}"

    @staticmethod
    def group_prefix(epoch: int, position: int, tag: str = "") -> str:
        return f"ftpg/e{epoch}/p{position}" + (f"/{tag}" if tag else "")

    @staticmethod
    def join_request(replica: int, rank: int) -> str:
        """Written by a restarted (or late) replica's rank when it waits for admission: its incarnation."""
        return f"join_request/{replica}/{rank}"

    @staticmethod
    def dropped(replica: int) -> str:
        """``"{incarnation}|{time}"``: the start of ``replica`` last removed from an epoch, and when (the launcher
        ends it and may restart it)."""
        return f"dropped/{replica}"

    @staticmethod
    def admission(epoch: int) -> str:
        """Members ask the coordinator to admit replicas after a commit in ``epoch``: ``"{step}|{replicas}"``."""
        return f"admission/e{epoch}"

    @staticmethod
    def admitted(epoch: int) -> str:
        """Published with an epoch that admits replicas: ``"{step}|{replicas}"`` (the step they enter after)."""
        return f"admitted/e{epoch}"

    @staticmethod
    def evicted(epoch: int, replica: int) -> str:
        """Members of ``epoch`` voted ``replica`` out (its state or computation is corrupt): the reason. The
        coordinator leaves it out of the next epoch (docs/scout.md)."""
        return f"evicted/e{epoch}/{replica}"


@dataclass(frozen=True)
class Heartbeat:
    """What a rank's heartbeat thread publishes."""

    time: float
    """Wall time of the beat (the process is alive)."""
    progress: float
    """Wall time of the main thread's last progress (it is not hung)."""
    step: int
    phase: str
    incarnation: int = 0
    """Which start of the replica beats: a restarted replica's beat says nothing about the one that died."""

    def encode(self) -> str:
        return f"{self.time:.6f},{self.progress:.6f},{self.step},{self.incarnation},{self.phase}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "Heartbeat":
        text = raw.decode() if isinstance(raw, bytes) else raw
        t, p, step, incarnation, phase = text.split(",", 4)
        return cls(float(t), float(p), int(step), phase, int(incarnation))


@dataclass(frozen=True)
class Liveness:
    """The coordinator's verdict on one replica at one instant."""

    replica: int
    dead_ranks: tuple[int, ...]
    hung_ranks: tuple[int, ...]

    @property
    def alive(self) -> bool:
        return not self.dead_ranks and not self.hung_ranks

    def reason(self) -> str:
        parts = []
        if self.dead_ranks:
            parts.append(f"replica {self.replica} rank(s) {list(self.dead_ranks)}: no heartbeat")
        if self.hung_ranks:
            parts.append(f"replica {self.replica} rank(s) {list(self.hung_ranks)}: no progress (hung)")
        return "; ".join(parts)


def judge_liveness(
    replica: int,
    beats: dict[int, Heartbeat | None],
    now: float,
    heartbeat_timeout_s: float,
    progress_timeout_s: float,
) -> Liveness:
    """Dead: no heartbeat or one older than the timeout. Hung: beating, but the main thread made no progress."""
    dead = tuple(sorted(r for r, b in beats.items() if b is None or now - b.time > heartbeat_timeout_s))
    hung = tuple(
        sorted(r for r, b in beats.items() if b is not None and r not in dead and now - b.progress > progress_timeout_s)
    )
    return Liveness(replica, dead, hung)


@dataclass(frozen=True)
class MembershipDecision:
    members: tuple[int, ...]
    removed: tuple[int, ...]
    reason: str


def decide_members(
    current: Iterable[int],
    joined: dict[int, set[int]],
    ranks_per_replica: int,
    excluded: Iterable[int] = (),
) -> MembershipDecision:
    """Next epoch's members: current members all of whose ranks joined and that are not excluded (hung/dead).

    ``joined`` maps replica -> ranks that wrote their join key. A replica with a missing rank leaves: a replica is
    the unit of failure, and its ranks cannot train without each other.
    """
    current = sorted(current)
    excluded = set(excluded)
    members, reasons = [], []
    for replica in current:
        missing = sorted(set(range(ranks_per_replica)) - joined.get(replica, set()))
        if replica in excluded:
            reasons.append(f"replica {replica} declared failed")
        elif missing:
            reasons.append(f"replica {replica} rank(s) {missing} did not join")
        else:
            members.append(replica)
    removed = tuple(r for r in current if r not in members)
    return MembershipDecision(tuple(members), removed, "; ".join(reasons) or "all members joined")


def all_joined(current: Iterable[int], joined: dict[int, set[int]], ranks_per_replica: int) -> bool:
    return all(len(joined.get(r, ())) == ranks_per_replica for r in current)


def decide_commit(reduced_count: int, expected: int, fault_seen: bool) -> str | None:
    """A rank's proposal at the commit barrier: ``commit`` once every member rank finished the reduction,
    ``abort`` if a fault was seen first, ``None`` to keep waiting. The stored first proposal is final."""
    if reduced_count >= expected:
        return "commit"
    if fault_seen:
        return "abort"
    return None


def encode_members(members: Iterable[int], reason: str) -> str:
    return ",".join(str(m) for m in members) + "|" + reason


def decode_members(raw: bytes | str) -> tuple[tuple[int, ...], str]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    members, _, reason = text.partition("|")
    return tuple(int(m) for m in members.split(",") if m), reason


# ---- admission of restarted and spare replicas (docs/phoenix.md) ----------------------------------------------


@dataclass(frozen=True)
class CommitDecision:
    """The stored value of ``decision/e{e}/s{t}``: the outcome, and the replicas admitted after this commit."""

    outcome: str
    admitted: tuple[int, ...] = ()

    def encode(self) -> str:
        if self.admitted and self.outcome != "commit":
            raise ValueError("only a commit admits replicas")
        return self.outcome + ("+" + ",".join(str(r) for r in self.admitted) if self.admitted else "")

    @classmethod
    def decode(cls, raw: bytes | str) -> "CommitDecision":
        text = raw.decode() if isinstance(raw, bytes) else raw
        outcome, _, admitted = text.partition("+")
        if outcome not in ("commit", "abort"):
            raise ValueError(f"not a commit decision: {text!r}")
        return cls(outcome, tuple(int(r) for r in admitted.split(",") if r))


def ready_to_join(
    members: Iterable[int],
    registered: dict[int, dict[int, int]],
    ranks_per_replica: int,
    dropped_incarnation: dict[int, int],
) -> tuple[int, ...]:
    """Replicas that may be admitted at the next commit: not members, every rank registered with one and the same
    incarnation, and that incarnation newer than the one dropped (a rank of the dropped incarnation that is still
    shutting down must not be mistaken for the restarted replica). ``registered``: replica -> rank -> incarnation."""
    members = set(members)
    ready = []
    for replica, ranks in sorted(registered.items()):
        if replica in members or sorted(ranks) != list(range(ranks_per_replica)):
            continue
        incarnations = set(ranks.values())
        if len(incarnations) == 1 and incarnations.pop() > dropped_incarnation.get(replica, -1):
            ready.append(replica)
    return tuple(ready)


def encode_admission(step: int, replicas: Iterable[int]) -> str:
    return f"{step}|" + ",".join(str(r) for r in replicas)


def decode_admission(raw: bytes | str) -> tuple[int, tuple[int, ...]]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    step, _, replicas = text.partition("|")
    return int(step), tuple(int(r) for r in replicas.split(",") if r)


def active_replicas(members: Iterable[int], active: int) -> tuple[int, ...]:
    """The members that hold quota: the ``active`` lowest-numbered ones. Spares are numbered after the active
    replicas, so a spare holds quota exactly while an active replica is missing (promotion), and goes back to
    standby when the restarted replica is admitted again. ``active = 0``: every member."""
    members = tuple(sorted(members))
    return members[:active] if active else members
