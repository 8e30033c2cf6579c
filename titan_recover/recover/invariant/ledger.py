"""The exactly-once ledger of one step's microbatch ids (pure; the same on every rank of every live replica).

A step's ids ``[(step - 1) * M, step * M)`` are assigned by the quota policy from the members of the epoch in which
the *previous* step committed (every survivor of that commit agrees on it) and the speeds committed with it. When
the coordinator publishes later epochs during the step, :meth:`StepLedger.advance` is applied once per epoch, in
epoch order, whether or not this rank took part in that epoch: the lost replicas' ids (their own and any they had
taken over) are dealt to the survivors. Because every rank applies the same transitions to the same starting
assignment, every rank knows who holds which id without a message. Each replica also sends the ids it actually
accumulated inside the reduction buffer (:meth:`vector`); :meth:`check` verifies the reduced vector, so a step can
only commit with every id counted exactly once (docs/invariant.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from titan_recover.recover.groups.protocol import active_replicas
from titan_recover.recover.invariant.quota import Assignment, assign, get_policy, reassign_orphans


class LedgerError(RuntimeError):
    """The reduced ledger does not hold every microbatch id of the step exactly once."""


@dataclass
class Transition:
    epoch: int
    lost: tuple[int, ...]
    extra: dict[int, tuple[int, ...]]
    reason: str


@dataclass
class StepLedger:
    policy: str
    step: int
    per_step: int
    members: tuple[int, ...]
    """Members of the epoch the assignment starts from."""
    epoch: int
    """That epoch; :meth:`advance` moves it forward."""
    replicas: int
    """Configured (active) replica groups, for policies that also count the dead ones."""
    speeds: Mapping[int, float] = field(default_factory=dict)
    active: int = 0
    """How many members hold quota at the start of the step (the lowest-numbered; the others are spares, which
    take over lost replicas' ids within the step like any survivor). 0: every member."""
    assignment: Assignment = field(init=False)
    transitions: list[Transition] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.members = tuple(sorted(self.members))
        self.redistributes = get_policy(self.policy).redistributes
        self.assignment = assign(self.policy, self.step, self.per_step, active_replicas(self.members, self.active),
                                 self.speeds, replicas=self.replicas)
        self.initial = self.assignment

    @property
    def first(self) -> int:
        return (self.step - 1) * self.per_step

    def ids(self, replica: int) -> tuple[int, ...]:
        """Ids ``replica`` is to accumulate in this step (initial quota, then any taken over)."""
        if replica not in self.members:
            return ()
        return self.assignment.ids.get(replica, ())

    def quota(self, replica: int) -> int:
        """Count of the initial assignment (what the policy gave ``replica`` at the start of the step)."""
        return self.initial.count(replica)

    @property
    def recomputed(self) -> int:
        """Ids taken over from lost replicas in this step (all survivors together)."""
        return sum(len(ids) for t in self.transitions for ids in t.extra.values())

    def advance(self, epoch: int, members: Iterable[int]) -> Transition:
        """Apply the membership of ``epoch`` (the next epoch after :attr:`epoch`); returns who takes what."""
        if epoch != self.epoch + 1:
            raise ValueError(f"ledger of step {self.step} is at epoch {self.epoch}; next is {self.epoch + 1}, not {epoch}")
        members = tuple(sorted(members))
        survivors = tuple(m for m in self.members if m in members)
        lost = tuple(m for m in self.members if m not in members)
        self.epoch = epoch
        if not lost:
            transition = Transition(epoch, (), {}, "no replica of the step lost")
        elif not survivors:
            raise LedgerError(f"step {self.step}: every replica holding its microbatches was lost")
        elif self.redistributes:
            before = self.assignment
            self.assignment = reassign_orphans(self.policy, before, survivors, self.speeds)
            extra = {m: self.assignment.ids[m][len(before.ids.get(m, ())):] for m in survivors}
            transition = Transition(epoch, lost, {m: v for m, v in extra.items() if v}, self.assignment.reason)
        else:
            transition = Transition(epoch, lost, {}, f"replicas {list(lost)} lost: their microbatches are dropped")
        self.members = survivors
        self.transitions.append(transition)
        return transition

    def vector(self, accumulated: Iterable[int]) -> list[float]:
        """This replica's entry of the reduced ledger: 1 at the offset of every id it accumulated."""
        out = [0.0] * self.per_step
        for g in accumulated:
            k = g - self.first
            if not 0 <= k < self.per_step:
                raise LedgerError(f"microbatch {g} is not an id of step {self.step}")
            out[k] += 1.0
        return out

    def expected(self) -> list[float]:
        """The reduced ledger a commit must produce: every id once (or, for ``drop``, the surviving holders')."""
        out = [0.0] * self.per_step
        for m in self.members:
            for g in self.assignment.ids.get(m, ()):
                out[g - self.first] += 1.0
        return out

    def check(self, reduced: Sequence[float]) -> int:
        """Verify the reduced ledger; returns the number of microbatches the step commits."""
        counts = [round(float(c)) for c in reduced]
        expected = self.expected()
        if counts != expected:
            missing = [self.first + k for k, (c, e) in enumerate(zip(counts, expected)) if c < e]
            extra = [self.first + k for k, (c, e) in enumerate(zip(counts, expected)) if c > e]
            raise LedgerError(
                f"step {self.step} epoch {self.epoch}: reduced ledger is not exactly-once (missing ids {missing}, "
                f"counted too often {extra}); members {list(self.members)}, assignment {self.assignment.ids}"
            )
        if self.redistributes and sum(counts) != self.per_step:
            raise LedgerError(f"step {self.step}: {sum(counts)} microbatches reduced, {self.per_step} required")
        return sum(counts)
