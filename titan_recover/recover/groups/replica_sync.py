"""One rank's synchronisation with the other replicas: epochs, the gradient reduction and its commit point.

:meth:`ReplicaSync.reduce_once` is the only place a step's cross-replica result is decided. It reduces the local
gradients in place, with the step's ledger beside them, over the fault-tolerant group (the caller keeps a backup),
then runs the commit barrier: ``commit`` and the tensors hold the sums; ``abort`` (a fault anywhere in the epoch) and the rank has moved
to the next epoch, where the caller (:mod:`~titan_recover.recover.invariant.step_recovery`) completes the step's
microbatches and tries again. The start-up broadcast goes through the same commit barrier (as step 0), so that
every member agrees on the epoch the first step's quotas start from. A commit's decision also names the replicas
ready to join (:attr:`ReplicaSync.pending`); their admission at the next step boundary is
:class:`~titan_recover.recover.phoenix.admission.Admission`'s (docs/phoenix.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, TYPE_CHECKING

import torch

from titan_recover.recover.events import EventLog
from titan_recover.recover.ftpg.base import build_group, FaultDetected, FaultTolerantGroup
from titan_recover.recover.groups.collect import KeyCollector
from titan_recover.recover.groups.keys import (
    checkpoint_requests,
    fault_time_and_reason,
    GroupKeys,
    raise_fault_flag,
    read_dropped,
    read_join_requests,
    vote_out,
)
from titan_recover.recover.groups.member import (
    pass_on,
    propose_decision,
    ReplicaMember,
)
from titan_recover.recover.groups.protocol import CommitDecision, decide_commit, ready_to_join
from titan_recover.recover.stores import read_keys

if TYPE_CHECKING:
    from titan_recover.recover.config import RecoverConfig

logger = logging.getLogger(__name__)


class ReplicaSync:
    def __init__(self, config: RecoverConfig, member: ReplicaMember, events: EventLog, chaos=None, *,
                 final_step: int | None = None, device: torch.device | str = "cpu"):
        self.config, self.member, self.events, self.chaos = config, member, events, chaos
        self.device = torch.device(device)
        """Where the tensors this rank reduces live (``[recover.ftpg] backend = "auto"`` follows it)."""
        self.groups = config.groups
        """Replica groups of the job (active and spares): the ids a joiner can have."""
        self.final_step = final_step
        """No replica is admitted after this step's commit (the job ends with it)."""
        self.joining = member.incarnation > 0
        """A restarted replica: it waits for admission and receives its state at the start of its first step."""
        self.pending: tuple[int, tuple[int, ...]] | None = None
        """(step, replicas) admitted by the last commit: the transfer runs at the start of the next step."""
        self.checkpoint_requested = False
        """The last decision asked for the committed step's durable checkpoint (a requested one, not the interval's)."""
        self.group: FaultTolerantGroup | None = None
        self._moving: str | None = None
        """The current commit barrier's progress counter (:meth:`commit_barrier`), or None."""
        self.recoveries: list[dict] = []  # recovery latencies of the current step, for metrics
        self.committed_epoch = -1  # epoch of the last commit (start-up broadcast or step): quotas start from it
        self.committed_members: tuple[int, ...] = ()
        self._looks = 0
        """Looks at the fault flag so far (:meth:`catch_up`): every rank of a group takes the same ones."""
        self._collected: tuple[int, tuple[int, int | str] | None] = (0, None)
        """The leader: looks up to this one are deleted from the group's store, and the group's last barrier that
        every rank counted in at (its keys go at the next one: :meth:`_collect_group_keys`)."""
        self.collector = KeyCollector(member.store)
        """Deletes the keys no member can read any more after each commit this rank stores (groups/collect.py)."""

    @property
    def epoch(self) -> int:
        return self.member.epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self.member.members

    def start(self) -> None:
        """Register, wait for epoch 0, build its group. A restarted replica only registers: it is admitted at a
        step boundary of the running replicas (:class:`~titan_recover.recover.phoenix.admission.Admission`),
        unless its launcher started it to found the epoch after a cold restart (then it starts as in epoch 0)."""
        self.member.register()
        after = -1
        if self.joining:
            founding = self._founding_epoch()
            if founding is None:
                self.events.emit("join_requested", incarnation=self.member.incarnation)
                return
            # every replica was lost: this start was made to found the next epoch from the newest durable state
            self.joining, after = False, founding
            self.events.emit("founding", cold_epoch=founding, incarnation=self.member.incarnation)
        self.member.wait_for_epoch(after, self.config.startup_timeout_s + self.config.agree_timeout_s)
        self.build_group()
        self.events.emit("joined", epoch=self.epoch, members=list(self.members))

    def _founding_epoch(self) -> int | None:
        """The empty epoch ``R`` of a cold restart if this start is the one its launcher made to found epoch
        ``R + 1`` (docs/replica_groups.md "Losing every replica"), else None (a joiner)."""
        store = self.member.store
        cold = read_keys(store, [GroupKeys.COLD_RESTART])[0]
        if cold is None:
            return None
        founder = read_keys(store, [GroupKeys.founding(int(cold), self.member.replica)])[0]  # collected on etcd
        return int(cold) if founder is not None and int(founder) == self.member.incarnation else None

    def build_group(self, members: tuple[int, ...] | None = None, tag: str = "",
                    host: bool = False) -> FaultTolerantGroup:
        """A fault-tolerant group of this rank in ``members`` of the current epoch (default: all of
        them, which becomes :attr:`group`), with the backend ``[recover.ftpg]`` names. ``host``: a group of host
        tensors (gloo, whatever the configured backend), such as a state transfer's. The epoch's group closes the one
        it replaces; whoever builds a side group closes it when done (a group closes off this thread: ftpg)."""
        config = self.config.ftpg
        if host and config.resolved_backend(torch.device("cpu")) != "gloo":
            config = dataclasses.replace(config, backend="gloo")
        group = build_group(config, self.member.store, epoch=self.epoch,
                            members=self.members if members is None else members, replica=self.member.replica,
                            rank=self.member.rank, timeout_s=self.config.collective_timeout_s,
                            device="cpu" if host else self.device, on_poll=self.member.progress,
                            fault_seen=self.member.fault_seen if self.member.watches_faults else None, tag=tag)
        if members is None:
            if self.group is not None:
                self.group.close()  # the previous epoch's: its threads, connections, device buffers go
            self.group = group
        return group

    def members_of(self, epoch: int) -> tuple[int, ...]:
        """Members of ``epoch``, one this rank entered or went past (a ledger's transitions)."""
        return self.member.entered_members_of(epoch)

    def catch_up(self, step: int | None) -> None:
        """Before a collective: if a fault was flagged in this rank's epoch (elsewhere), move to the coordinator's
        next epoch. The coordinator leaves an epoch only after its flag, or to admit joiners, which every member
        enters by itself at the same step boundary (:class:`~titan_recover.recover.phoenix.admission.Admission`).
        The group looks as one (:meth:`look`), so that its ranks take the same transitions between their
        collectives inside the replica."""
        if self.look():
            self.next_epoch(step)

    def look(self) -> bool:
        """Whether this rank's epoch is flagged, the same answer on every rank of its group: the leader (or the one
        rank) looks, at what its heartbeat thread saw, else with one request to the job's store, and passes its
        answer on in the group's store (``look/{n}``); the group's other ranks take it from there."""
        self._looks += 1
        member, local, key = self.member, self.member.group_store, GroupKeys.look(self._looks)
        if local is not None and not member.leader:
            return self._look_of_leader(key)
        flagged = member.fault_seen(self.epoch) or member.store.check([GroupKeys.fault(self.epoch)])
        if local is not None:
            local.set(key, f"{self.epoch} {'move' if flagged else 'stay'}")
        return flagged

    def _look_of_leader(self, key: str) -> bool:
        """A rank other than the leader: its leader's answer (:meth:`look`), waited for in the group's store."""
        member = self.member
        answer = member.from_leader(key, self.config.agree_timeout_s, waiting_for="look at the fault flag",
                                    bound="recover.agree_timeout_s")
        epoch, _, answer = answer.decode().partition(" ")
        if int(epoch) != self.epoch:  # the group's ranks took different transitions: never go on
            raise RuntimeError(f"replica {member.replica} rank {member.rank} is in epoch {self.epoch} and its "
                               f"group's leader in epoch {epoch} at the same look at the fault flag")
        return answer == "move"

    def next_epoch(self, step: int | None) -> None:
        noticed = time.time()
        flag = self.member.fault_flag(self.epoch)  # None: an admission, or the leader's mirror is not in yet
        fault_time = fault_time_and_reason(flag)[0] if flag else noticed
        old = self.epoch
        epoch, members, why = self.member.wait_for_epoch(old, self.config.agree_timeout_s)
        agreed = time.time()
        self.build_group()
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
        """Make this rank's tensors equal to the lowest member replica's (used at start), then commit as
        step 0 so that every member agrees on the epoch the first step starts from. Each tensor travels in its
        own dtype and on its own device; it is received into a copy, written only once the broadcast committed
        (a broadcast that fails half-way leaves every member's tensors as they were)."""
        for _ in range(self.config.step.max_epochs_per_step + 1):
            self.catch_up(step=None)
            received = [t.detach().clone() for t in tensors]
            try:
                self.group.broadcast_many_(received, root_replica=min(self.members))
                decision = self.commit_barrier(0)
            except FaultDetected as fault:
                logger.warning("broadcast failed: %s", fault.reason)
                decision = self.propose(0, "abort")
            if decision == "commit":
                with torch.no_grad():
                    for t, value in zip(tensors, received):
                        t.copy_(value)
                self.mark_committed()
                return
            self.next_epoch(step=0)
        raise RuntimeError(f"start-up broadcast failed in {self.config.step.max_epochs_per_step + 1} consecutive epochs")

    def mark_committed(self) -> None:
        self.committed_epoch, self.committed_members = self.epoch, self.members

    def collective(self) -> tuple[int, Callable]:
        """The current epoch and its group's ``allreduce_many_``: what an overlapped reduction issues on its own
        thread (:mod:`~titan_recover.recover.invariant.overlap`), to be finished by :meth:`reduce_once`."""
        return self.epoch, self.group.allreduce_many_

    def reduce_once(self, step: int, tensors: list[torch.Tensor], attempt: int = 1, verify=None,
                    before_piece=None, pending=None) -> bool:
        """Sum ``tensors`` in place over the current epoch's members (one collective; ``before_piece``: see
        :meth:`~titan_recover.recover.ftpg.base.FaultTolerantGroup.allreduce_many_`) and run the commit barrier.
        ``pending``: that collective is already under way (an overlapped reduction of this epoch's
        :meth:`collective`): wait for it instead of issuing one.

        ``verify(reduced_tensors) -> Refusal | None``: the witnesses' votes, judged between the reduction and the
        commit barrier (docs/scout.md).

        True: committed, ``tensors`` hold the sums. False: aborted, this rank is now in the next epoch (the tensors
        are garbage). Raises ``TooFewReplicas`` / ``Excluded`` when the next epoch says so.
        """
        self.member.progress(step=step, phase="reduction")
        try:
            if self.chaos is not None:
                self.chaos.maybe_inject(step, "reduction")
            if pending is None:
                self.group.allreduce_many_(tensors, before_piece)
            elif pending.epoch != self.epoch:
                raise RuntimeError(f"step {step}: an overlapped reduction of epoch {pending.epoch} was finished "
                                   f"in epoch {self.epoch}")
            else:
                pending.join()
            self.member.progress(phase="commit")
            if self.chaos is not None:
                self.chaos.maybe_inject(step, "commit")
            refusal = verify(tensors) if verify is not None else None
            if refusal is not None:
                decision = self._refuse(step, refusal)
            else:
                decision = self.commit_barrier(step, admit=self.final_step is None or step < self.final_step)
        except FaultDetected as fault:
            logger.warning("step %d epoch %d: %s", step, self.epoch, fault.reason)
            decision = self.propose(step, "abort")
        outcome = CommitDecision.decode(decision)
        self.checkpoint_requested = outcome.checkpoint
        if outcome.outcome == "commit":
            self.mark_committed()
            self.events.emit("step_committed", step=step, epoch=self.epoch, members=list(self.members),
                             attempts=attempt, admitted=list(outcome.admitted))
            if outcome.admitted:
                self.pending = (step, outcome.admitted)
            return True
        self.next_epoch(step)
        return False

    def _refuse(self, step: int, refusal) -> str:
        """The votes found corruption: abort before this rank counts itself in the commit barrier (so the count
        can never complete), name the replicas to evict to the coordinator, or stop the job (no majority)."""
        store = self.member.store
        vote_out(store, self.epoch, refusal.evict, f"step {step}: {refusal.reason}")
        if refusal.stop is not None:
            store.set(GroupKeys.STOP_UNTRUSTED, "1")
            store.set(GroupKeys.STOP, refusal.stop)
        raise_fault_flag(store, self.epoch, f"replica {self.member.replica} rank {self.member.rank}: "
                                            f"{refusal.reason}")
        return self.propose(step, "abort")

    def propose(self, step: int | str, proposal: str) -> str:
        """Store ``proposal`` as the step's decision unless one is stored; the stored one is every member's
        decision: returned, and passed on to this rank's group (its ranks and leader waiting for it wake)."""
        return propose_decision(self.member.store, self.member.group_store, self.epoch, step, proposal)

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

    def commit_barrier(self, step: int | str, admit: bool = False, moving: str | None = None) -> str:
        """Every rank of every member finished the step's reduction: ``commit``; a fault came first: ``abort``.
        One leader rank per group takes part for its group (docs/replica_groups.md "The step"): the
        group's other ranks count themselves in in the group's own store and wait there for the decision, the
        leader waits for them, then counts the group in in the job's store; the last group in proposes
        ``commit``, a leader that saw a fault proposes ``abort``, the others block on the step's decision key
        until it is stored (by the last group, or ``abort`` by the heartbeat thread of a rank that sees the fault
        flag meanwhile) and pass it on to their group. ``collective_timeout_s`` without a decision (at either
        level) raises the flag and aborts; with ``moving`` (a counter in the job's store, such as a state
        transfer's), only ``collective_timeout_s`` in which neither a decision came nor the counter moved. The
        first proposal stored is every member's decision."""
        self._moving = moving
        self.member.waiting_on = (self.epoch, step)  # before looking at the flag: a flag after is answered there
        try:
            if self.member.group_store is not None and not self.member.leader:
                return self._follow(step)
            if self.member.group_store is not None:
                decided = self._wait_for_group(step)
                if decided is not None:
                    return decided
                self._collect_group_keys(step)
            return self._count_in(step, admit)
        finally:
            self.member.waiting_on = None

    def _follow(self, step: int | str) -> str:
        """A rank other than the leader: count in in the group's store, wait there for the passed-on decision."""
        local, ranks = self.member.group_store, self.member.ranks_per_replica
        if self._fault_seen():
            return self.propose(step, "abort")
        if local.add(GroupKeys.reduced(self.epoch, step), 1) == ranks - 1:
            local.set(GroupKeys.group_ready(self.epoch, step), "in")  # the leader's wait ends
        self.member.progress()
        decided = GroupKeys.decision(self.epoch, step)
        if self._await(local, decided):
            return local.get(decided).decode()
        return self._timed_out(step, "its group's decision")

    def _wait_for_group(self, step: int | str) -> str | None:
        """The leader: wait until the group's other ranks are in (None: count the group in) or a decision was
        passed on to the group already (returned)."""
        local = self.member.group_store
        if not self._await(local, GroupKeys.group_ready(self.epoch, step)):
            return self._timed_out(step, "its group's ranks")
        decided = GroupKeys.decision(self.epoch, step)
        return local.get(decided).decode() if local.check([decided]) else None

    def _collect_group_keys(self, step: int | str) -> None:
        """The leader, once every rank of its group counted in at ``step``: they are past the group's previous such
        barrier and every look before this one, so those keys leave the group's store (deleted by the heartbeat
        thread, off the step's path). A barrier decided before every rank was in (an abort) keeps its keys."""
        looked, previous = self._collected
        keys = [GroupKeys.look(n) for n in range(looked + 1, self._looks + 1)]
        if previous is not None:
            keys += [GroupKeys.reduced(*previous), GroupKeys.decision(*previous), GroupKeys.group_ready(*previous)]
        self._collected = (self._looks, (self.epoch, step))
        self.member.discard(keys)

    def _count_in(self, step: int | str, admit: bool) -> str:
        """The leader (or the one rank) counts its group in in the job's store."""
        store = self.member.store
        key, decided = GroupKeys.reduced(self.epoch, step), GroupKeys.decision(self.epoch, step)
        proposal = decide_commit(store.add(key, 1), len(self.members), self._fault_seen())
        if proposal is None:
            self.member.progress()
            if not self._await(store, decided):
                return self._timed_out(step, "the other groups")
            decision = store.get(decided).decode()
            pass_on(self.member.group_store, self.epoch, step, decision)
            return decision
        requested = served = 0
        if proposal == "commit":
            # the first proposal stored is every member's decision: one writer decides the admission and a
            # requested checkpoint too
            requested, served = checkpoint_requests(store)
            proposal = CommitDecision("commit", self._ready_joiners() if admit else (),
                                      checkpoint=requested > served).encode()
        decision = self.propose(step, proposal)
        stored = CommitDecision.decode(decision) if decision == proposal else None
        if stored is not None and stored.outcome == "commit":
            self.collector.after_commit(self.epoch, step)  # this rank stored the commit: every member is in it
            if stored.checkpoint:  # before this group counts in at the next step
                store.add(GroupKeys.CHECKPOINT_SERVED, requested - served)  # the one writer of this counter
        return decision

    def _await(self, store, key: str) -> bool:
        """Wait for ``key`` in ``store``: ``collective_timeout_s``, again as long as the barrier's ``moving``
        counter (in the job's store) changed meanwhile; False once a wait ended with it standing still."""
        timeout = self.config.collective_timeout_s
        if self._moving is None:
            return self.member.wait_alive(store, key, timeout)
        seen = self.member.store.add(self._moving, 0)
        while not self.member.wait_alive(store, key, timeout):
            now = self.member.store.add(self._moving, 0)
            if now == seen:
                return False
            seen = now
        return True

    def _timed_out(self, step: int | str, waiting_for: str) -> str:
        raise_fault_flag(self.member.store, self.epoch, f"replica {self.member.replica} rank {self.member.rank}: "
                                                        f"commit barrier of step {step} timed out waiting for "
                                                        f"{waiting_for}")
        return self.propose(step, "abort")

    def _fault_seen(self) -> bool:
        if self.member.watches_faults:
            return self.member.fault_seen(self.epoch)
        return self.member.store.check([GroupKeys.fault(self.epoch)])
