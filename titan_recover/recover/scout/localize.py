"""One rank's witness duties in replica mode (docs/scout.md): sign, vote, replay, watch for stragglers.

The signatures travel inside the step's reduction buffer, so the vote costs no message of its own: the buffer's
evidence section has two slots per replica group (parameters, replay), each ``(low 16 bits, high 16 bits,
present)``; a rank fills its own replica's slots and zeros elsewhere, so the sum over the members *is* the gather.
After the reduction every member's rank ``p`` holds every member's signature of rank ``p``
and decides the same votes from the same numbers (:meth:`Localizer.judge`); a rank that finds an outlier refuses
the commit before it counts itself in the commit barrier, so no member can commit that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from titan_recover.recover.scout.config import LocalizeConfig
from titan_recover.recover.scout.consensus import (
    join_signature,
    replay_plan,
    ReplayPlan,
    split_signature,
    StragglerDetector,
    Verdict,
    vote,
)

SLOT = 3
"""Floats per signature slot: low half, high half, present."""
DISAGREEMENT = "replicas disagree"
"""How a stop for lack of a majority begins (the state at that step is trusted by nobody: no checkpoint of it)."""


@dataclass(frozen=True)
class Refusal:
    """Why a step must not commit: replicas to evict, or a stop (no strict majority)."""

    evict: tuple[int, ...]
    stop: str | None
    reason: str


class Localizer:
    def __init__(self, config: LocalizeConfig, *, replica: int, rank: int, groups: int, events):
        self.config = config
        self.replica, self.rank, self.groups = replica, rank, groups
        self.events = events
        self.size = 2 * SLOT * groups if config.witnesses else 0
        """Floats this rank adds to the reduction buffer."""
        self.detector = StragglerDetector(config.straggler_threshold, config.straggler_confirm_steps)
        self.plan: ReplayPlan | None = None
        self.clean = True
        """The last judged reduction's votes were clean."""
        self.votes = 0
        self.refusals = 0

    # ---- before the reduction --------------------------------------------------------------------------
    def replay_for(self, step: int, holders: dict[int, tuple[int, ...]], members: Sequence[int]) -> ReplayPlan | None:
        """The step's replay (every ``replay_interval`` steps), from the plan's ``replica -> ids``."""
        interval = self.config.replay_interval
        self.plan = None
        if interval and step % interval == 0:
            holder_of = {g: r for r, ids in holders.items() for g in ids}
            self.plan = replay_plan(step, self.config.replay_seed, sorted(holder_of), holder_of, members)
        return self.plan

    def evidence(self, parameters: int | None, replay: int | None) -> list[float]:
        """This rank's part of the buffer's evidence section."""
        out = [0.0] * self.size
        if not self.size:
            return out
        for base, signature in ((0, parameters if self.config.vote else None), (SLOT * self.groups, replay)):
            if signature is not None:
                at = base + SLOT * self.replica
                out[at : at + SLOT] = [*split_signature(signature), 1.0]
        return out

    # ---- after the reduction -----------------------------------------------------------------------------
    def _signatures(self, evidence: Sequence[float], base: int, witnesses: Sequence[int]) -> dict[int, int]:
        found = {}
        for w in witnesses:
            at = base + SLOT * w
            if evidence[at + 2] > 0.5:
                found[w] = join_signature(evidence[at], evidence[at + 1])
        return found

    def judge(self, step: int, members: Sequence[int], evidence: Sequence[float]) -> Refusal | None:
        """The votes of this rank over the reduced evidence; None if the step may commit."""
        verdicts: list[tuple[str, Verdict]] = []
        if self.config.vote:
            signed = self._signatures(evidence, 0, members)
            if len(signed) >= 2:
                verdicts.append(("parameters", vote(signed, f"parameter signatures at rank {self.rank}")))
        plan = self.plan
        if plan is not None:
            signed = self._signatures(evidence, SLOT * self.groups, [w for w in plan.witnesses if w in members])
            if len(signed) >= 2:
                verdicts.append(("replay", vote(
                    signed, f"replay of microbatch {plan.microbatch} at rank {self.rank} (holder "
                            f"{plan.holder}, replayed by {list(plan.replayers)})")))
        self.votes += len(verdicts)
        self.clean = all(v.clean for _, v in verdicts)
        if self.clean:
            return None
        evict: set[int] = set()
        stop = None
        for what, verdict in verdicts:
            evidence_json = {str(k): v for k, v in verdict.evidence.items()}
            if verdict.decision == "attributed":
                evict |= set(verdict.outliers)
                for replica in verdict.outliers:
                    self.events.emit("corruption_attributed", step=step, what=what, replica=replica,
                                     rank=self.rank, evidence=evidence_json, reason=verdict.reason)
            elif verdict.decision == "inconclusive":
                self.events.emit("vote_inconclusive", step=step, what=what, rank=self.rank,
                                 evidence=evidence_json, reason=verdict.reason, action=self.config.on_inconclusive)
                if self.config.on_inconclusive == "stop":
                    stop = (f"{DISAGREEMENT} at step {step} and no strict majority says which is right "
                            f"({verdict.reason}); the step was not committed. Resume from the newest verified "
                            "checkpoint, or add replicas or spares so that a majority can decide")
        if not evict and stop is None:
            return None  # inconclusive, told to continue
        self.refusals += 1
        reason = "; ".join(v.reason for _, v in verdicts if not v.clean)
        return Refusal(tuple(sorted(evict)), stop, reason)

    def observe_speeds(self, step: int, speeds: Sequence[float]) -> None:
        """Committed microbatches per second per replica -> time per microbatch -> straggler changes."""
        seconds = {r: 1.0 / s for r, s in enumerate(speeds) if s > 0}
        for change in self.detector.observe(step, seconds):
            if self.rank == 0:  # one report per replica, not one per rank
                self.events.emit(f"straggler_{change.state}", step=step, replica=change.replica, z=change.z,
                                 seconds_per_microbatch=change.seconds_per_microbatch, median=change.median)
