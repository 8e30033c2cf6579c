"""The replica-group protocol's pure decisions and value encodings (tested without processes or clocks).

The next epoch's members, the commit decision and admission of joiners. Liveness from heartbeats is in
:mod:`~titan_recover.recover.groups.liveness`; the store keys these values live under are in
:mod:`~titan_recover.recover.groups.keys`. See docs/replica_groups.md for the contract these implement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable


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
    """The stored value of ``decision/e{e}/s{t}``: the outcome, the replicas admitted after this commit, and whether
    the committed step's durable checkpoint is written now (``checkpoint``: one was requested, e.g. by a node that
    left on a preemption notice; docs/replica_groups.md "Checkpoints")."""

    outcome: str
    admitted: tuple[int, ...] = ()
    checkpoint: bool = False

    def encode(self) -> str:
        if (self.admitted or self.checkpoint) and self.outcome != "commit":
            raise ValueError("only a commit admits replicas or asks for a checkpoint")
        return (self.outcome + ("!" if self.checkpoint else "")
                + ("+" + ",".join(str(r) for r in self.admitted) if self.admitted else ""))

    @classmethod
    def decode(cls, raw: bytes | str) -> "CommitDecision":
        text = raw.decode() if isinstance(raw, bytes) else raw
        outcome, _, admitted = text.partition("+")
        checkpoint = outcome.endswith("!")
        outcome = outcome.removesuffix("!")
        if outcome not in ("commit", "abort"):
            raise ValueError(f"not a commit decision: {text!r}")
        return cls(outcome, tuple(int(r) for r in admitted.split(",") if r), checkpoint)


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


def encode_admission(step: int, replicas: Iterable[int], incarnations: Iterable[int] | None = None) -> str:
    """``step|replicas`` (the members' ``admission/e{e}``), or ``step|replicas|incarnations`` (the coordinator's
    ``admitted/e{e}``: which start of each replica it admitted)."""
    text = f"{step}|" + ",".join(str(r) for r in replicas)
    return text if incarnations is None else text + "|" + ",".join(str(n) for n in incarnations)


def decode_admission(raw: bytes | str) -> tuple[int, tuple[int, ...]]:
    """(step, replicas) of :func:`encode_admission`'s value."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    step, _, rest = text.partition("|")
    replicas = rest.partition("|")[0]
    return int(step), tuple(int(r) for r in replicas.split(",") if r)


def admitted_incarnations(raw: bytes | str) -> dict[int, int]:
    """Replica -> the start of it an ``admitted/e{e}`` value admitted (empty for a value without them)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    _, _, rest = text.partition("|")
    replicas, _, incarnations = rest.partition("|")
    if not incarnations:
        return {}
    return dict(zip((int(r) for r in replicas.split(",") if r), (int(n) for n in incarnations.split(","))))


def active_replicas(members: Iterable[int], active: int) -> tuple[int, ...]:
    """The members that hold quota: the ``active`` lowest-numbered ones. Spares are numbered after the active
    replicas, so a spare holds quota exactly while an active replica is missing (promotion), and goes back to
    standby when the restarted replica is admitted again. ``active = 0``: every member."""
    members = tuple(sorted(members))
    return members[:active] if active else members


# ---- the coordinator's state, kept in the store so that a restarted coordinator resumes it --------------------


@dataclass(frozen=True)
class DurableState:
    """What a job that lost every replica restarts from: a complete checkpoint's step, and why that one (the
    newest verified, or the newest)."""

    step: int
    why: str


@dataclass(frozen=True)
class CoordinatorState:
    """What the coordinator knows that members do not report: the epoch it publishes (or is publishing) and its
    members, the incarnation of each member, the incarnation of each replica last dropped, the replicas declared
    failed but not yet removed. Written to the store *before* the epoch it describes is published (a write-ahead
    record): a coordinator restarted between the two finishes the publication instead of deciding again, so
    members never see two different member lists for one epoch (docs/replica_groups.md "Coordinator restarts")."""

    epoch: int
    members: tuple[int, ...]
    reason: str
    removed: tuple[int, ...] = ()
    admitted: tuple[int, tuple[int, ...]] | None = None
    """(step, replicas) when the epoch admits replicas after ``step``'s commit."""
    incarnation: dict[int, int] | None = None
    dropped: dict[int, int] | None = None
    excluded: tuple[int, ...] = ()
    stop: str = ""
    """Set when the epoch leaves fewer than ``min_replicas``: the message members stop with."""
    cold: bool = False
    """The epoch is empty because no live member held the state: every group restarts from the newest durable
    state and founds the next epoch."""
    durable_step: int | None = None
    """With ``cold``: the checkpoint step every group restarts from."""

    def encode(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": list(self.members), "reason": self.reason,
                           "removed": list(self.removed),
                           "admitted": None if self.admitted is None else [self.admitted[0], list(self.admitted[1])],
                           "incarnation": {str(k): v for k, v in (self.incarnation or {}).items()},
                           "dropped": {str(k): v for k, v in (self.dropped or {}).items()},
                           "excluded": list(self.excluded), "stop": self.stop, "cold": self.cold,
                           "durable_step": self.durable_step})

    @classmethod
    def decode(cls, raw: bytes | str) -> "CoordinatorState":
        d = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        admitted = d["admitted"]
        return cls(d["epoch"], tuple(d["members"]), d["reason"], tuple(d["removed"]),
                   None if admitted is None else (admitted[0], tuple(admitted[1])),
                   {int(k): v for k, v in d["incarnation"].items()}, {int(k): v for k, v in d["dropped"].items()},
                   tuple(d["excluded"]), d["stop"], d["cold"], d["durable_step"])


def founders(epoch_registered: dict[int, dict[int, int]], founding: dict[int, int], ranks_per_replica: int
             ) -> tuple[tuple[int, ...], bool]:
    """After a cold restart: the replicas ready to found the next epoch, and whether every replica is accounted
    for (ready, or not restarted). ``founding``: replica -> the incarnation its launcher started for the cold
    restart (-1: none; absent: not yet told); ``epoch_registered``: replica -> rank -> registered incarnation. Only
    the start the launcher named founds: an older start still registering (a joiner started before the cold
    restart, with an older checkpoint loaded) never does."""
    ready = tuple(sorted(
        replica for replica, incarnation in founding.items() if incarnation >= 0
        and sorted(epoch_registered.get(replica, {})) == list(range(ranks_per_replica))
        and set(epoch_registered[replica].values()) == {incarnation}))
    settled = all(incarnation < 0 or replica in ready for replica, incarnation in founding.items())
    return ready, settled


def resume_action(state: CoordinatorState | None, published_epoch: int) -> str:
    """What a (re)started coordinator does, from its stored state and the epoch members can read (``-1``: none):

    - ``form_first``: no epoch was published and none is being published: form epoch 0;
    - ``finish``: the state describes the epoch after the published one (the previous coordinator died while
      publishing it): publish it as recorded;
    - ``resume``: the state describes the published epoch: watch it.
    """
    if state is None:
        if published_epoch >= 0:
            raise ValueError(f"epoch {published_epoch} is published but the coordinator's state is missing")
        return "form_first"
    if state.epoch == published_epoch + 1:
        return "finish"
    if state.epoch == published_epoch:
        return "resume"
    raise ValueError(f"the coordinator's state describes epoch {state.epoch}, and epoch {published_epoch} is "
                     "published: the store holds another job's keys")
