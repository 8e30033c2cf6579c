"""One rank's synchronisation with the other replicas: epochs, the gradient reduction and its commit point.

:meth:`ReplicaSync.reduce_once` is the only place a step's cross-replica result is decided. It reduces a buffer
(a *copy* of the local gradients, with the step's ledger) over the fault-tolerant group, then runs the commit
barrier: ``commit`` and the buffer holds the sum; ``abort`` (a fault anywhere in the epoch) and the rank has moved
to the next epoch, where the caller (:mod:`~titan_recover.recover.invariant.step_recovery`) completes the step's microbatches
and tries again. The start-up broadcast goes through the same commit barrier (as step 0), so that every member
agrees on the epoch the first step's quotas start from. :meth:`ReplicaSync.admit_pending` runs the admission of
restarted replicas at a step boundary (docs/phoenix.md): a commit's decision names the ready joiners, the
coordinator publishes the grown epoch, a donor streams the state, and a commit barrier makes it count.
"""

from __future__ import annotations

import logging
import time

import torch

from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.events import EventLog
from titan_recover.recover.ftpg.base import FaultDetected
from titan_recover.recover.ftpg.gloo import PolledGlooGroup as FaultTolerantGroup
from titan_recover.recover.groups.keys import fault_time_and_reason, GroupKeys as Keys, raise_fault_flag
from titan_recover.recover.groups.keys import read_dropped, read_join_requests
from titan_recover.recover.groups.member import ReplicaMember
from titan_recover.recover.groups.protocol import (
    CommitDecision,
    decide_commit,
    decode_admission,
    encode_admission,
    ready_to_join,
)
from titan_recover.recover.phoenix.state_transfer import ChecksumError, transfer, TrainingState

logger = logging.getLogger(__name__)


class ReplicaSync:
    def __init__(self, config: RecoverConfig, member: ReplicaMember, events: EventLog, chaos=None, *,
                 final_step: int | None = None):
        self.config, self.member, self.events, self.chaos = config, member, events, chaos
        self.groups = config.groups
        """Replica groups of the job (active and spares): the ids a joiner can have."""
        self.final_step = final_step
        """No replica is admitted after this step's commit (the job ends with it)."""
        self.joining = member.incarnation > 0
        """A restarted replica: it waits for admission and receives its state at the start of its first step."""
        self.pending: tuple[int, tuple[int, ...]] | None = None
        """(step, replicas) admitted by the last commit: the transfer runs at the start of the next step."""
        self.group: FaultTolerantGroup | None = None
        # Groups of past epochs, kept alive until the process exits: destroying a gloo group whose peer died can
        # block on its threads (see ftpg). One small group per membership change.
        self._retired: list[FaultTolerantGroup] = []
        self.recoveries: list[dict] = []  # recovery latencies of the current step, for metrics
        self.committed_epoch = -1  # epoch of the last commit (start-up broadcast or step): quotas start from it
        self.committed_members: tuple[int, ...] = ()
        self.verify = None
        """``verify(step, reduced_buffer) -> Refusal | None``: the witnesses' votes, judged between the reduction
        and the commit barrier (docs/scout.md); set by the step recovery manager when localisation is on."""
        self.disagreement: str | None = None
        """Set when this rank stopped the job because replicas disagreed without a majority."""

    @property
    def epoch(self) -> int:
        return self.member.epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self.member.members

    def start(self) -> None:
        """Register, wait for epoch 0, build its group. A restarted replica only registers: it is admitted at a
        step boundary of the running replicas (:meth:`admit_pending`)."""
        self.member.register()
        if self.joining:
            self.events.emit("join_requested", incarnation=self.member.incarnation)
            return
        self.member.wait_for_epoch(-1, self.config.startup_timeout_s + self.config.agree_timeout_s)
        self._build_group()
        self.events.emit("joined", epoch=self.epoch, members=list(self.members))

    def _build_group(self) -> None:
        if self.group is not None:
            self._retired.append(self.group)
        self.group = FaultTolerantGroup(
            self.member.store,
            epoch=self.epoch,
            members=self.members,
            replica=self.member.replica,
            position=self.member.rank,
            timeout_s=self.config.collective_timeout_s,
            on_poll=self.member.progress,
        )

    def members_of(self, epoch: int) -> tuple[int, ...]:
        return self.member.members_of(epoch)

    def catch_up(self, step: int | None) -> None:
        """Before a collective: if the coordinator has moved on (a fault elsewhere), move to its epoch."""
        if self.member.current_epoch() > self.epoch or self.member.store.check([Keys.fault(self.epoch)]):
            self._next_epoch(step)

    def _next_epoch(self, step: int | None) -> None:
        noticed = time.time()
        flag = self.member.store.get(Keys.fault(self.epoch)) if self.member.store.check([Keys.fault(self.epoch)]) else None
        fault_time, reason = fault_time_and_reason(flag) if flag else (noticed, "coordinator moved on")
        old = self.epoch
        epoch, members, why = self.member.wait_for_epoch(old, self.config.agree_timeout_s)
        agreed = time.time()
        self._build_group()
        built = time.time()
        record = {
            "step": step, "from_epoch": old, "epoch": epoch, "members": list(members), "reason": why,
            "fault_raised_at": fault_time, "noticed_at": noticed, "agreed_at": agreed, "built_at": built,
            "detect_s": max(0.0, noticed - fault_time), "agree_s": agreed - noticed, "build_s": built - agreed,
        }
        self.recoveries.append(record)
        self.events.emit("epoch_entered", **record)
        if self.chaos is not None and step is not None:
            self.chaos.maybe_inject(step, "rebuild")

    def broadcast_from_lowest(self, tensors: list[torch.Tensor]) -> None:
        """Make this position's tensors equal to the lowest member replica's (used at start), then commit as
        step 0 so that every member agrees on the epoch the first step starts from."""
        for _ in range(self.config.max_epochs_per_step + 1):
            self.catch_up(step=None)
            # staged in host memory: the fault-tolerant group is gloo, whatever device the parameters live on
            flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])
            try:
                self.group.broadcast_(flat, root_replica=min(self.members))
                decision = self._commit_barrier(0)
            except FaultDetected as fault:
                logger.warning("broadcast failed: %s", fault.reason)
                decision = self._propose(0, "abort")
            if decision == "commit":
                offset = 0
                for t in tensors:
                    t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
                self._committed()
                return
            self._next_epoch(step=0)
        raise RuntimeError(f"start-up broadcast failed in {self.config.max_epochs_per_step + 1} consecutive epochs")

    def _committed(self) -> None:
        self.committed_epoch, self.committed_members = self.epoch, self.members

    def reduce_once(self, step: int, buffer: torch.Tensor, attempt: int = 1) -> bool:
        """Sum ``buffer`` in place over the current epoch's members and run the commit barrier.

        True: committed, ``buffer`` holds the sum. False: aborted, this rank is now in the next epoch (``buffer``
        is garbage). Raises ``TooFewReplicas`` / ``Excluded`` when the next epoch says so.
        """
        self.member.progress(step=step, phase="reduction")
        try:
            if self.chaos is not None:
                self.chaos.maybe_inject(step, "reduction")
            self.group.allreduce_sum_(buffer)
            self.member.progress(phase="commit")
            if self.chaos is not None:
                self.chaos.maybe_inject(step, "commit")
            refusal = self.verify(step, buffer) if self.verify is not None else None
            if refusal is not None:
                decision = self._refuse(step, refusal)
            else:
                decision = self._commit_barrier(step, admit=self.final_step is None or step < self.final_step)
        except FaultDetected as fault:
            logger.warning("step %d epoch %d: %s", step, self.epoch, fault.reason)
            decision = self._propose(step, "abort")
        outcome = CommitDecision.decode(decision)
        if outcome.outcome == "commit":
            self._committed()
            self.events.emit("step_committed", step=step, epoch=self.epoch, members=list(self.members),
                             attempts=attempt, admitted=list(outcome.admitted))
            if outcome.admitted:
                self.pending = (step, outcome.admitted)
            return True
        self._next_epoch(step)
        return False

    def _refuse(self, step: int, refusal) -> str:
        """The votes found corruption: abort before this rank counts itself in the commit barrier (so the count
        can never complete), name the replicas to evict to the coordinator, or stop the job (no majority)."""
        store = self.member.store
        for replica in refusal.evict:
            store.set(Keys.evicted(self.epoch, replica), f"step {step}: {refusal.reason}")
        if refusal.stop is not None:
            self.disagreement = refusal.stop
            store.set(Keys.STOP, refusal.stop)
        raise_fault_flag(store, self.epoch, f"replica {self.member.replica} position {self.member.rank}: "
                                            f"{refusal.reason}")
        return self._propose(step, "abort")

    # ---- admission (docs/phoenix.md) -----------------------------------------------------------------------
    def admit_pending(self, step: int, state: TrainingState) -> None:
        """At the start of ``step``: run the admission decided by the previous commit (members), or wait to be
        admitted and receive the state (a joiner). Returns once the transfer committed, or once it is clear
        that no joiner remains to receive it."""
        if self.joining:
            admitted_after, admitting = self._wait_until_admitted()
        elif self.pending is None:
            self._hold_for_restarts(step)
            return
        else:
            admitted_after, requested = self.pending
            self.pending = None
            before = self.epoch
            self.member.store.compare_set(Keys.admission(before), "", encode_admission(admitted_after, requested))
            self._next_epoch(step)
            admitting = self._admitted_since(before)
            if not admitting:  # a fault came first: the joiners stay ready and are asked again at a later commit
                return
        label = f"admit{admitted_after}"
        for _ in range(self.config.max_epochs_per_step + 1):
            joiners = tuple(m for m in self.members if m in admitting)
            if not joiners:
                return  # every joiner was lost; training goes on as it was
            donors = [m for m in self.members if m not in admitting]
            if not donors:
                raise RuntimeError(f"admission after step {admitted_after}: no member left to donate the state")
            donor = min(donors)
            try:
                if self.member.replica == donor or self.member.replica in joiners:
                    self._transfer(state, donor, joiners, step=admitted_after + 1)
                decision = self._commit_barrier(label)
            except (FaultDetected, ChecksumError) as fault:
                if isinstance(fault, ChecksumError):
                    raise_fault_flag(self.member.store, self.epoch, f"replica {self.member.replica}: {fault}")
                logger.warning("admission after step %d, epoch %d: %s", admitted_after, self.epoch, fault)
                decision = self._propose(label, "abort")
            if decision == "commit":
                self._committed()
                self.joining = False
                self.events.emit("admission_committed", step=admitted_after + 1, epoch=self.epoch, joiners=list(joiners),
                                 donor=donor, members=list(self.members))
                return
            self._next_epoch(step)
        raise RuntimeError(f"admission after step {admitted_after} failed in "
                           f"{self.config.max_epochs_per_step + 1} consecutive epochs")

    def _hold_for_restarts(self, step: int) -> None:
        """``recover.rejoin_wait_s``: hold this step boundary for a dropped group that the launcher restarts
        (it has restarts left, ``recover.max_restarts``) until it asks to join, so that it is admitted at this
        step's commit, or until ``rejoin_wait_s`` after it was dropped."""
        if self.config.rejoin_wait_s <= 0 or (self.final_step is not None and step >= self.final_step):
            return  # no admission after the final step's commit: nothing to wait for
        store, ranks = self.member.store, self.member.ranks_per_replica
        for replica in range(self.groups):
            dropped = None if replica in self.members else read_dropped(store, replica)
            if dropped is None or dropped[0] >= self.config.max_restarts:
                continue  # a member, never dropped, or not restarted again
            incarnation, when = dropped
            deadline = when + self.config.rejoin_wait_s
            started = time.time()
            while time.time() < deadline:
                asked = read_join_requests(store, replica, ranks)
                if asked is not None and all(v > incarnation for v in asked.values()):
                    break
                self.member.progress(step=step, phase="rejoin_wait")
                time.sleep(0.05)
            if time.time() - started > 0.1:
                self.events.emit("rejoin_wait", step=step, replica=replica, dropped_incarnation=incarnation,
                                 waited_s=time.time() - started, ready=time.time() < deadline)

    def _wait_until_admitted(self) -> tuple[int, tuple[int, ...]]:
        started = time.time()
        self.member.wait_for_admission(self.config.startup_timeout_s)
        self._build_group()
        # the admitting epoch may already be behind a newer one (a fault during the admission): look back
        for epoch in range(self.epoch, -1, -1):
            if self.member.store.check([Keys.admitted(epoch)]):
                step, admitting = decode_admission(self.member.store.get(Keys.admitted(epoch)))
                if self.member.replica in admitting:
                    self.events.emit("admitted", epoch=self.epoch, members=list(self.members), after_step=step,
                                     waited_s=time.time() - started)
                    return step, admitting
        raise RuntimeError(f"replica {self.member.replica} is a member of epoch {self.epoch} without an admission")

    def _admitted_since(self, epoch: int) -> tuple[int, ...]:
        admitting: set[int] = set()
        for e in range(epoch + 1, self.epoch + 1):
            if self.member.store.check([Keys.admitted(e)]):
                admitting |= set(decode_admission(self.member.store.get(Keys.admitted(e)))[1])
        return tuple(sorted(admitting))

    def _transfer(self, state: TrainingState, donor: int, joiners: tuple[int, ...], step: int) -> None:
        """Stream the donor's state to the joiners at this shard position, over a group of just them."""
        is_donor = self.member.replica == donor
        group = FaultTolerantGroup(
            self.member.store, epoch=self.epoch, members=tuple(sorted((donor, *joiners))),
            replica=self.member.replica, position=self.member.rank, timeout_s=self.config.collective_timeout_s,
            on_poll=self.member.progress, tag="transfer",
        )
        self._retired.append(group)
        self.member.progress(phase="transfer")
        sent = [0]

        def broadcast(tensor: torch.Tensor) -> None:
            group.broadcast_(tensor, root_replica=donor)
            sent[0] += 1
            if sent[0] == 1 and self.chaos is not None:  # the header's length went out, the state has not
                self.chaos.maybe_inject(step, "transfer")

        start = time.perf_counter()
        stats = transfer(state, broadcast, is_donor=is_donor,
                         broadcast_many=lambda tensors, on_each: group.broadcast_many_(tensors, donor, on_each))
        seconds = time.perf_counter() - start
        self.events.emit("state_transferred", epoch=self.epoch, role="donor" if is_donor else "joiner",
                         donor=donor, joiners=list(joiners), bytes=stats.bytes, chunks=stats.chunks,
                         seconds=seconds, mb_per_s=stats.bytes / 2**20 / max(seconds, 1e-9))

    def _propose(self, step: int | str, proposal: str) -> str:
        stored = self.member.store.compare_set(Keys.decision(self.epoch, step), "", proposal)
        return stored.decode() if isinstance(stored, bytes) else stored

    def _ready_joiners(self) -> tuple[int, ...]:
        """Replicas waiting for admission with a complete, newer incarnation (read by the commit's proposer)."""
        store, ranks = self.member.store, self.member.ranks_per_replica
        requests, dropped = {}, {}
        for replica in range(self.groups):
            asked = None if replica in self.members else read_join_requests(store, replica, ranks)
            if asked is not None:
                requests[replica] = asked
                last = read_dropped(store, replica)
                if last is not None:
                    dropped[replica] = last[0]
        return ready_to_join(self.members, requests, ranks, dropped)

    def _commit_barrier(self, step: int | str, admit: bool = False) -> str:
        store = self.member.store
        key = Keys.reduced(self.epoch, step)
        expected = len(self.members) * self.member.ranks_per_replica
        count = store.add(key, 1)
        deadline = time.monotonic() + self.config.collective_timeout_s
        while True:
            proposal = decide_commit(count, expected, store.check([Keys.fault(self.epoch)]))
            if proposal is None and store.check([Keys.decision(self.epoch, step)]):
                return store.get(Keys.decision(self.epoch, step)).decode()
            if proposal is None and time.monotonic() > deadline:
                raise_fault_flag(store, self.epoch, f"replica {self.member.replica}: commit barrier of step {step} timed out")
                proposal = "abort"
            if proposal == "commit" and admit:
                # the first proposal stored is every member's decision: one writer decides the admission too
                proposal = CommitDecision("commit", self._ready_joiners()).encode()
            if proposal is not None:
                return self._propose(step, proposal)
            self.member.progress()  # waiting for the other members is progress (liveness, hang observer)
            time.sleep(0.002)
            count = store.add(key, 0)
