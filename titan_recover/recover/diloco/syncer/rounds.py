"""The syncer's rounds (docs/diloco.md, "Rounds"): per fragment, the deltas delivered since its last merge, and
when to merge them: once the quorum delivered (``quorum_size``, ``quorum_reached``) and the adaptive grace window
(``grace_window``) says so. The arrival history behind the window (each learner's interval between deliveries,
each fragment's period between merges) is kept here too."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from titan_recover.recover.diloco.rules import (GraceDecision, grace_window, quorum_reached, quorum_size,
                                                token_weights, Version)
from titan_recover.recover.diloco.syncer.inbox import Delivery

SMOOTHING = 0.5


def ema(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


@dataclass
class Round:
    """The open round of one fragment: deltas delivered since its last merge."""

    deltas: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # learner -> per rank
    tokens: dict[int, int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    bases: dict[int, Version] = field(default_factory=dict)
    first_at: float | None = None
    quorum_at: float | None = None
    decision: GraceDecision | None = None


@dataclass
class Arrivals:
    """What the syncer learned about one learner's deliveries of one fragment."""

    last_at: float | None = None
    interval_s: float | None = None
    tokens: int = 0

    def record(self, now: float, tokens: int) -> None:
        if self.last_at is not None:
            self.interval_s = ema(self.interval_s, now - self.last_at)
        self.last_at, self.tokens = now, tokens


class Rounds:
    """Every fragment's open round and the arrival history. ``period_s[f]``: the smoothed time between fragment
    ``f``'s merges (None until two merges were seen)."""

    def __init__(self, fragments: int, period_s: list[float | None] | None = None):
        self.open = [Round() for _ in range(fragments)]
        self.period_s = list(period_s) if period_s is not None else [None] * fragments
        self.last_merge_at: list[float | None] = [None] * fragments
        self.arrivals: dict[tuple[int, int], Arrivals] = {}  # (learner, fragment)

    def deliver(self, delivery: Delivery, now: float) -> None:
        learner, r = delivery.learner, self.open[delivery.fragment]
        if learner in r.deltas:  # a second delta before its round closed: progress adds up
            for held, new in zip(r.deltas[learner], delivery.deltas):
                held += new
            r.tokens[learner] += delivery.tokens
            r.steps[learner] = max(r.steps[learner], delivery.step)
        else:
            r.deltas[learner], r.tokens[learner], r.steps[learner] = delivery.deltas, delivery.tokens, delivery.step
            r.bases[learner] = delivery.base
        r.first_at = r.first_at or now
        self.arrivals.setdefault((learner, delivery.fragment), Arrivals()).record(now, delivery.tokens)

    def sync_period(self, fragment: int) -> float | None:
        """The fragment's period between merges; before two merges, the median interval of its deliveries."""
        if self.period_s[fragment] is not None:
            return self.period_s[fragment]
        intervals = [a.interval_s for (_, f), a in self.arrivals.items() if f == fragment and a.interval_s]
        return statistics.median(intervals) if intervals else None

    def merge_quorum(self, fragment: int, now: float, alive: set[int], *, min_quorum: int, max_window_s: float,
                     final: bool = False) -> int | None:
        """The round's quorum if it merges now: its quorum delivered and no learner still worth waiting for
        (``final``: whatever was delivered); None to keep waiting (or nothing to merge)."""
        r = self.open[fragment]
        if not r.deltas:
            return None
        quorum = quorum_size(min_quorum, alive, r.deltas)
        if final:
            return quorum
        if not quorum_reached(r.tokens, quorum):
            return None
        expected = alive - set(r.deltas)
        if r.quorum_at is None:
            r.quorum_at = now
            r.decision = self._grace(fragment, now, expected, r.tokens, max_window_s)
        waiting = [j for j in r.decision.waiting_for if j in expected]
        return None if waiting and now < r.quorum_at + r.decision.deadline_s else quorum

    def _grace(self, fragment: int, now: float, expected: set[int], delivered: dict[int, int],
               max_window_s: float) -> GraceDecision:
        period = self.sync_period(fragment)
        if not period:
            return GraceDecision(0.0, (), "merge now: no sync period measured yet")
        pending = {}
        for j in expected:  # its next delivery expected one interval after its last
            seen = self.arrivals.get((j, fragment))
            if seen is not None and seen.interval_s is not None:
                pending[j] = (seen.last_at + seen.interval_s - now, seen.tokens)
        return grace_window(delivered, pending, period, max_window_s)

    def close(self, fragment: int, now: float) -> Round:
        """The fragment merged at ``now``: its round closes (returned) and a new one opens."""
        if self.last_merge_at[fragment] is not None:
            self.period_s[fragment] = ema(self.period_s[fragment], now - self.last_merge_at[fragment])
        self.last_merge_at[fragment] = now
        closed, self.open[fragment] = self.open[fragment], Round()
        return closed


def merge_record(r: Round, *, fragment: int, version: int, generation: int, alive: set[int], quorum: int,
                 min_quorum: int, now: float, final: bool) -> dict:
    """The ``fragment_merged`` event of a round merged into ``version`` (docs/diloco.md, "Log")."""
    learners = sorted(r.deltas)
    weights = token_weights(r.tokens)
    # staleness: global version at merge minus the version the delta was computed from (unknown across syncer
    # generations)
    staleness = {str(i): (version - 1 - r.bases[i][1] if r.bases[i][0] == generation else None) for i in learners}
    decision = r.decision
    return {
        "fragment": fragment, "version": version, "learners": learners,
        "tokens": {str(i): r.tokens[i] for i in learners},
        "weights": {str(i): weights[i] for i in learners}, "staleness": staleness,
        "alive": sorted(alive), "quorum": quorum, "under_quorum": quorum < min_quorum,
        "quorum_wait_s": (r.quorum_at - r.first_at) if r.quorum_at else None,
        "window_s": (now - r.quorum_at) if r.quorum_at else 0.0,
        "window_deadline_s": decision.deadline_s if decision else 0.0,
        "waited_for": list(decision.waiting_for) if decision else [],
        "window_reason": decision.reason if decision else "final merge",
        "final": final,
    }
