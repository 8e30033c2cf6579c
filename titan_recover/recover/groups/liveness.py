"""Liveness from heartbeats (pure, tested without processes or clocks): what a rank's heartbeat thread publishes,
the verdict on a replica, and the coordinator's watch over the beats on its own clock.

Shared by the coordinator (which judges replica groups) and the diloco syncer (which judges learners). See
docs/replica_groups.md, "Liveness".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


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


def encode_group_beat(beats: dict[int, Heartbeat]) -> str:
    """A replica group's beat, as its leader rank relays it: every rank's latest beat, one line each."""
    return "\n".join(f"{rank}|{beat.encode()}" for rank, beat in sorted(beats.items()))


def decode_group_beat(raw: bytes | str) -> dict[int, Heartbeat]:
    """rank -> beat, of the ranks whose beat the leader had read (a rank that never beat is absent)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    beats = {}
    for line in filter(None, text.split("\n")):
        rank, _, beat = line.partition("|")
        beats[int(rank)] = Heartbeat.decode(beat)
    return beats


def absent_beat(incarnation: int) -> Heartbeat:
    """What a watcher records for a rank missing from its group's beat (not yet relayed, or never beat): a beat
    that never changes, so the rank is judged dead ``heartbeat_timeout_s`` after it was first missed, not at once."""
    return Heartbeat(0.0, 0.0, 0, "absent", incarnation)


def group_beats(groups: dict[int, bytes | str], ranks: dict[int, list[int]],
                incarnation: dict[int, int]) -> dict[tuple[int, int], Heartbeat]:
    """(replica, rank) -> beat for the watched ``ranks`` of each group, from the groups' relayed beats; a rank
    missing from its group's beat gets :func:`absent_beat`."""
    beats = {}
    for replica, raw in groups.items():
        relayed = decode_group_beat(raw)
        for rank in ranks[replica]:
            beats[(replica, rank)] = relayed.get(rank) or absent_beat(incarnation.get(replica, 0))
    return beats


@dataclass(frozen=True)
class Liveness:
    """The coordinator's verdict on one replica at one instant."""

    replica: int
    dead_ranks: tuple[int, ...]
    hung_ranks: tuple[int, ...]

    @property
    def alive(self) -> bool:
        return not self.dead_ranks and not self.hung_ranks

    def reason(self, what: str = "replica") -> str:
        """Why it is not alive; ``what`` names the group (a diloco syncer judges learners)."""
        parts = []
        if self.dead_ranks:
            parts.append(f"{what} {self.replica} rank(s) {list(self.dead_ranks)}: no heartbeat")
        if self.hung_ranks:
            parts.append(f"{what} {self.replica} rank(s) {list(self.hung_ranks)}: no progress (hung)")
        return "; ".join(parts)


def judge_liveness(
    replica: int,
    ages: dict[int, tuple[float, float] | None],
    heartbeat_timeout_s: float,
    progress_timeout_s: float,
) -> Liveness:
    """Dead: no heartbeat, or one unchanged for longer than the timeout. Hung: beating, but the main thread made no
    progress. ``ages``: rank -> (seconds its beat has been unchanged, seconds its progress stamp has been unchanged),
    or None for a rank with no beat of its own."""
    dead = tuple(sorted(r for r, a in ages.items() if a is None or a[0] > heartbeat_timeout_s))
    hung = tuple(sorted(r for r, a in ages.items() if a is not None and r not in dead and a[1] > progress_timeout_s))
    return Liveness(replica, dead, hung)


class WatchedTime:
    """Time that counts only while someone was watching: a tick counts the time since the previous tick, at most
    ``max_gap_s``. A watcher that was not scheduled (or whose reads stalled) for longer does not hold that time
    against the watched: deadlines measured this way are stretched by the watcher's own stalls, never shortened."""

    def __init__(self, max_gap_s: float, now: float):
        self.max_gap_s = max_gap_s
        self.elapsed_s = 0.0
        """Counted time since the start."""
        self.unwatched_s = 0.0
        """Time between ticks that was not counted."""
        self._last = now

    def tick(self, now: float) -> float:
        """Count the time since the previous tick; returns the part counted."""
        gap = max(0.0, now - self._last)
        counted = min(gap, self.max_gap_s)
        self.elapsed_s += counted
        self.unwatched_s += gap - counted
        self._last = now
        return counted


@dataclass
class _Watched:
    beat: Heartbeat
    quiet_s: float = 0.0
    """Watched time since the beat last changed."""
    still_s: float = 0.0
    """Watched time since the main thread's progress stamp last changed."""


class LivenessWatch:
    """The coordinator's view of heartbeats over time: how long it has *watched* each beat stay unchanged.

    A rank is judged on the coordinator's own clock, never on the beat's timestamp (another node's clock), and
    only over time the coordinator was watching: between two looks at most ``max_gap_s`` counts. A coordinator
    or store that stalled (an oversubscribed host: the store's server thread not scheduled for seconds) finds every
    beat unchanged when it looks again, and members' beats queued behind its own request are not in yet; that
    is no evidence against the members, so it is not counted (docs/replica_groups.md "Liveness").
    """

    def __init__(self, heartbeat_timeout_s: float, progress_timeout_s: float, max_gap_s: float):
        self.heartbeat_timeout_s, self.progress_timeout_s = heartbeat_timeout_s, progress_timeout_s
        self.max_gap_s = max_gap_s
        self._watched: dict[tuple[int, int], _Watched] = {}
        self.time: WatchedTime | None = None
        """The watch's own time (None until the first look): ``unwatched_s`` is the stalls it sat out."""

    def look(self, now: float, beats: dict[tuple[int, int], Heartbeat],
             expected: dict[int, int] | None = None) -> float:
        """Record what one read of the store returned at ``now`` (coordinator clock, after the read):
        (replica, rank) -> its beat. ``expected``: replica -> the start (incarnation) watched, if known (default:
        the one last recorded). A beat of an earlier start than that is a stale writer's (a start that was dropped
        and has not ended yet: stopped, frozen with its node, then thawed) and shows nothing of the watched start,
        whose beat counts as unchanged for this look; before, it was taken for the watched start's end and a
        healthy member was declared dead. Returns the time this look counted."""
        if self.time is None:
            self.time = WatchedTime(self.max_gap_s, now)
        counted = self.time.tick(now)
        for key, beat in beats.items():
            seen = self._watched.get(key)
            watched = (expected or {}).get(key[0], seen.beat.incarnation if seen is not None else None)
            if watched is not None and beat.incarnation < watched:
                if seen is None or seen.beat.incarnation != watched:  # nothing of the watched start seen yet
                    self._watched[key] = _Watched(absent_beat(watched))
                else:
                    seen.quiet_s += counted
                    seen.still_s += counted
                continue
            if seen is None or seen.beat.incarnation != beat.incarnation:
                self._watched[key] = _Watched(beat)
                continue
            seen.quiet_s = 0.0 if beat.time != seen.beat.time else seen.quiet_s + counted
            seen.still_s = 0.0 if beat.progress != seen.beat.progress else seen.still_s + counted
            seen.beat = beat
        return counted

    def forget(self, replica: int) -> None:
        """The replica left the job: a later start of it is watched afresh."""
        for key in [k for k in self._watched if k[0] == replica]:
            del self._watched[key]

    def ages(self, replica: int, ranks: Iterable[int], incarnation: int) -> dict[int, tuple[float, float] | None]:
        """rank -> (quiet_s, still_s) of ``replica``'s ``ranks``; None for a rank with no beat of ``incarnation``
        (never beat, or a later start of the group beats under its key: the member is gone)."""
        ages = {}
        for rank in ranks:
            seen = self._watched.get((replica, rank))
            ages[rank] = None if seen is None or seen.beat.incarnation != incarnation else (seen.quiet_s, seen.still_s)
        return ages

    def judge(self, replica: int, ranks: Iterable[int], incarnation: int) -> Liveness:
        return judge_liveness(replica, self.ages(replica, ranks, incarnation), self.heartbeat_timeout_s,
                              self.progress_timeout_s)
