"""The step recovery manager: one replica's part of a step, from its quota to the commit (docs/invariant.md).

:meth:`StepRecovery.run` computes this replica's quota of the step's microbatch ids, then loops: catch up with the
epochs the coordinator has published (each applied to the :class:`~titan_recover.recover.invariant.ledger.StepLedger` in
order, computing any ids taken over from lost replicas on top of the preserved local accumulation), reduce the
accumulation together with the ledger over the fault-tolerant group, and commit, or, on abort, go round again in
the new epoch. ``max_epochs_per_step`` bounds the loop. Whatever phase a failure hits, the step commits with every
id accumulated exactly once, which :meth:`StepLedger.check` verifies on the reduced ledger before the gradient is
used.

The manager does not know about models or tensors' meaning: the trainer gives it ``compute(g, witness=None)``
(forward and backward of microbatch ``g``, accumulating locally; with ``witness`` it also returns the signature of
that microbatch's gradient and loss, and ``"replay"`` leaves nothing accumulated) and ``pack(tail)`` (the flat
buffer to reduce: the local accumulation followed by ``tail``). With a
:class:`~titan_recover.recover.scout.localize.Localizer` the tail carries the witnesses' signatures too and the sync
judges them before the commit (docs/scout.md). It talks to a :class:`~titan_recover.recover.groups.replica_sync.ReplicaSync`
(``catch_up``, ``epoch``, ``members_of``, ``reduce_once``, ``committed_epoch``, ``committed_members``,
``recoveries``, ``events``), which tests replace with a fake.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from titan_recover.recover.config import QuotaConfig
from titan_recover.recover.invariant.ledger import StepLedger
from titan_recover.recover.scout.localize import Localizer
from titan_recover.recover.groups.protocol import active_replicas
from titan_recover.recover.invariant.quota import get_policy


@dataclass
class StepOutcome:
    """What one committed step did (the same on every rank of every member, except the timings)."""

    step: int
    summed: torch.Tensor
    """The reduced buffer: the summed accumulation, then the ledger and speeds (see :meth:`StepRecovery.run`)."""
    committed: int
    """Microbatches committed (M, or fewer with ``drop``)."""
    participants: int
    quotas: dict[int, int]
    """Initial quota per replica (live replicas only)."""
    recomputed: int
    """Ids taken over from lost replicas in this step, all survivors together."""
    mine: int
    """Ids this replica computed (its quota and what it took over)."""
    attempts: int
    discarded: bool
    """``drop`` only: some member saw a failure in this step, which is discarded (the optimizer must not step)."""
    compute_s: float = 0.0
    wait_s: float = 0.0
    """Time in the committed reduction (all-reduce + commit barrier, waiting for the slowest member included)."""
    recovery_s: float = 0.0
    """Time in failed reductions, epoch changes and microbatches taken over."""


@dataclass
class StepRecovery:
    config: QuotaConfig
    replica: int
    replicas: int
    per_step: int
    sync: object
    compute: Callable[..., int | None]
    pack: Callable[[list[float]], torch.Tensor]
    max_epochs_per_step: int = 8
    active: int = 0
    """Replicas holding quota (``[recover] replicas``); members beyond them are spares. 0: every member."""
    agree_speed: Callable[[float], float] | None = None
    """Make this replica's ranks agree on its measured speed (a max over the replica's own ranks)."""
    speeds: dict[int, float] = field(default_factory=dict)
    """Smoothed microbatches per second per replica, updated from every commit (identical on every rank)."""
    degraded: bool = False
    """Capacity was lost (a replica lost, or fewer than ``active`` replicas holding quota) and has not come back."""
    localizer: Localizer | None = None
    """Signatures, votes, replays and stragglers (docs/scout.md); None: none."""
    signature: Callable[[], int] | None = None
    """This rank's parameter signature (read just before each reduction: the state the step's update applies to)."""

    def __post_init__(self) -> None:
        self.policy = get_policy(self.config.policy)
        self._holding: tuple[int, ...] = ()
        self.evidence_size = self.localizer.size if self.localizer is not None else 0
        if self.evidence_size:
            end = -1  # the evidence sits just before the failure flag
            self.sync.verify = lambda step, buffer: self.localizer.judge(
                step, self.sync.members, buffer[end - self.evidence_size : end].tolist())

    def plan(self, step: int) -> StepLedger:
        sync = self.sync
        if not self.policy.redistributes:
            # no ids move between replicas: start from the newest membership, as torchft's per-step quorum does
            sync.catch_up(step)
            epoch, members = sync.epoch, sync.members
        else:
            # every survivor of the last commit agrees on its epoch; later epochs are applied in order below
            epoch, members = sync.committed_epoch, sync.committed_members
        return StepLedger(self.config.policy, step, self.per_step, members, epoch, self.active or self.replicas,
                          dict(self.speeds), active=self.active)

    def tail_size(self) -> int:
        """Entries after the local accumulation and loss: ledger (M), speeds (R), evidence (signatures, see
        :class:`~titan_recover.recover.scout.localize.Localizer`), failures seen (1)."""
        return self.per_step + self.replicas + self.evidence_size + 1

    def run(self, step: int) -> StepOutcome:
        sync = self.sync
        sync.recoveries = []
        ledger = self.plan(step)
        quotas = {m: ledger.quota(m) for m in ledger.members}
        self._note_capacity(step, ledger)
        done: list[int] = []
        own = list(ledger.ids(self.replica))
        replay_signature = None
        plan = None
        if self.localizer is not None:
            plan = self.localizer.replay_for(step, ledger.assignment.ids, ledger.members)
        if plan is not None and self.replica in plan.replayers:
            # first, while nothing is accumulated: the replayed gradient is signed and dropped
            replay_signature = self.compute(plan.microbatch, witness="replay")
        start = time.perf_counter()
        if plan is not None and plan.microbatch in own:  # the holder computes it first too, and keeps it
            own.remove(plan.microbatch)
            replay_signature = self.compute(plan.microbatch, witness="holder")
            done.append(plan.microbatch)
        for g in own:
            self.compute(g)
            done.append(g)
        compute_s = time.perf_counter() - start
        speed = len(done) / compute_s if done and compute_s > 0 else 0.0
        if self.agree_speed is not None and self.policy.uses_speeds:
            speed = self.agree_speed(speed)
        speeds = [0.0] * self.replicas
        speeds[self.replica] = speed
        recovery_s = 0.0
        failed = False
        for attempt in range(1, self.max_epochs_per_step + 2):
            recovering = time.perf_counter()
            sync.catch_up(step)
            changed = ledger.epoch < sync.epoch
            failed = failed or changed or attempt > 1
            while ledger.epoch < sync.epoch:
                transition = ledger.advance(ledger.epoch + 1, sync.members_of(ledger.epoch + 1))
                mine = transition.extra.get(self.replica, ())
                if transition.lost:
                    sync.events.emit("microbatches_reassigned", step=step, epoch=transition.epoch,
                                     lost=list(transition.lost), taken=list(mine),
                                     extra={str(m): list(v) for m, v in transition.extra.items()},
                                     reason=transition.reason)
                for g in mine:
                    self.compute(g)
                    done.append(g)
            if changed or attempt > 1:
                recovery_s += time.perf_counter() - recovering
            evidence = []
            if self.evidence_size:
                evidence = self.localizer.evidence(self.signature() if self.signature else None, replay_signature)
            buffer = self.pack(ledger.vector(done) + speeds + evidence + [1.0 if failed else 0.0])
            reducing = time.perf_counter()
            committed = sync.reduce_once(step, buffer, attempt)
            if committed:
                wait_s = time.perf_counter() - reducing
                tail = buffer[-self.tail_size():].tolist()
                count = ledger.check(tail[: self.per_step])
                measured = tail[self.per_step : self.per_step + self.replicas]
                self._update_speeds(measured)
                if self.localizer is not None:
                    self.localizer.observe_speeds(step, measured)
                # the reduced failure flag is the same for every member, so all discard or none (torchft's
                # should_commit is such an all-reduce of errors too)
                saw_failure = tail[-1] > 0
                if ledger.transitions and any(t.lost for t in ledger.transitions):
                    self.degraded = True
                elif self.degraded and len(self._holding) >= (self.active or len(self._holding)):
                    self.degraded = False
                    sync.events.emit("full_strength", step=step, epoch=sync.epoch, holding=list(self._holding))
                return StepOutcome(
                    step=step, summed=buffer, committed=count, participants=len(sync.members), quotas=quotas,
                    recomputed=ledger.recomputed, mine=len(done), attempts=attempt,
                    discarded=saw_failure and not self.policy.redistributes,
                    compute_s=compute_s, wait_s=wait_s, recovery_s=recovery_s,
                )
            recovery_s += time.perf_counter() - reducing
        raise RuntimeError(
            f"step {step}: the reduction failed in {self.max_epochs_per_step + 1} consecutive epochs "
            f"(recover.max_epochs_per_step = {self.max_epochs_per_step}); giving up"
        )

    def _note_capacity(self, step: int, ledger: StepLedger) -> None:
        """Spare promotions and lost capacity, from who holds quota at the start of the step."""
        holding = active_replicas(ledger.members, self.active)
        promoted = [m for m in holding if m >= (self.active or self.replicas) and m not in self._holding]
        if promoted and self._holding:
            self.sync.events.emit("spare_promoted", step=step, epoch=ledger.epoch, spares=promoted,
                                  holding=list(holding))
        if self.active and len(holding) < self.active:
            self.degraded = True
        self._holding = holding

    def _update_speeds(self, measured: list[float]) -> None:
        alpha = self.config.speed_smoothing
        for replica, speed in enumerate(measured):
            if speed <= 0:
                continue
            old = self.speeds.get(replica)
            self.speeds[replica] = speed if old is None else alpha * speed + (1 - alpha) * old
