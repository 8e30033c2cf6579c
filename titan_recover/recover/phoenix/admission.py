"""Admission of restarted replicas at a step boundary (docs/phoenix.md "Admission").

A commit's decision names the replicas ready to join (:attr:`ReplicaSync.pending`); at the start of the next step
the members ask the coordinator to admit them, the coordinator publishes the grown epoch, the lowest member that
is not joining streams the whole training state to the joiners over a fault-tolerant group of just them
(:func:`~titan_recover.recover.phoenix.state_transfer.transfer`), and a commit barrier makes it count. A donor or
joiner lost mid-transfer aborts it; the next epoch tries again with whoever is left. A restarted replica waits here
until it is admitted and receives its state.
"""

from __future__ import annotations

import logging
import time

import torch

from titan_recover.recover.ftpg.base import FaultDetected
from titan_recover.recover.groups.keys import GroupKeys, raise_fault_flag, read_dropped, read_join_requests, vote_out
from titan_recover.recover.groups.protocol import decode_admission, decode_members, encode_admission, encode_members
from titan_recover.recover.groups.replica_sync import ReplicaSync
from titan_recover.recover.phoenix.state_transfer import ChecksumError, transfer, TrainingState

logger = logging.getLogger(__name__)

REJOIN_POLL_S = 0.1
"""How often a group's leader looks whether a dropped group's new start asked to join, while it holds a step
boundary for it (``recover.rejoin_wait_s``): two requests to the job's store per look."""


class Admission:
    """One rank's part in admitting replicas, over its :class:`ReplicaSync`."""

    def __init__(self, sync: ReplicaSync):
        self.sync = sync
        self._last_held: int | None = None
        """The leader: the last step boundary it held and said so in its group's store (``held/s{step}``)."""
        self._hold_ends: dict[tuple[int, int], float] = {}
        """(replica, dropped incarnation) -> when, on this process's monotonic clock, the hold for it ends."""

    def admit_pending(self, step: int, state: TrainingState) -> None:
        """At the start of ``step``: run the admission decided by the previous commit (members), or wait to be
        admitted and receive the state (a joiner). Returns once the transfer committed, or once it is clear
        that no joiner remains to receive it."""
        sync = self.sync
        if sync.joining:
            admitted_after, admitting = self._wait_until_admitted()
        elif sync.pending is None:
            self._hold_for_restarts(step)
            return
        else:
            admitted_after, requested = sync.pending
            sync.pending = None
            before = sync.epoch
            sync.member.store.compare_set(GroupKeys.admission(before), "", encode_admission(admitted_after, requested))
            sync.next_epoch(step)
            admitting = self._admitted_since(before)
            if not admitting:  # a fault came first: the joiners stay ready and are asked again at a later commit
                return
        attempts = sync.config.step.max_epochs_per_step + 1
        for _ in range(attempts):
            joiners = tuple(m for m in sync.members if m in admitting)
            if not joiners:
                return  # every joiner was lost; training goes on as it was
            if self._attempt(state, admitted_after, joiners, admitting):
                return
            sync.next_epoch(step)
        failed = f"admission after step {admitted_after} failed in {attempts} consecutive epochs"
        if sync.joining:  # its launcher restarts it (recover.max_restarts) and it asks again
            raise RuntimeError(f"replica {sync.member.replica}: {failed}; this joiner ends")
        self._evict_joiners(step, tuple(m for m in sync.members if m in admitting), failed)

    def _evict_joiners(self, step: int, joiners: tuple[int, ...], failed: str) -> None:
        """An admission that keeps failing is the joiners' (a joiner holds no state anyone needs): the members
        vote them out of the epoch, as after corruption (docs/scout.md: their names, the marker, the flag), and
        train on without them; the launcher restarts them while they have restarts."""
        sync = self.sync
        if not joiners:
            return
        store, epoch = sync.member.store, sync.epoch
        vote_out(store, epoch, joiners, f"step {step}: {failed}")
        raise_fault_flag(store, epoch, f"replica {sync.member.replica} rank {sync.member.rank}: {failed}: leaving "
                                       f"out replica(s) {list(joiners)}")
        logger.error("%s: leaving out replica(s) %s, which the launcher restarts while they have restarts", failed,
                     list(joiners))
        sync.next_epoch(step)

    def _attempt(self, state: TrainingState, admitted_after: int, joiners: tuple[int, ...],
                 admitting: tuple[int, ...]) -> bool:
        """One epoch's try: the lowest member not joining donates; True once the commit barrier committed."""
        sync = self.sync
        donors = [m for m in sync.members if m not in admitting]
        if not donors:
            raise RuntimeError(f"admission after step {admitted_after}: no member left to donate the state")
        donor, label = min(donors), f"admit{admitted_after}"
        try:
            if sync.member.replica == donor or sync.member.replica in joiners:
                self._transfer(state, donor, joiners, step=admitted_after + 1)
            decision = sync.commit_barrier(label, moving=GroupKeys.transferred(sync.epoch))
        except (FaultDetected, ChecksumError) as fault:
            if isinstance(fault, ChecksumError):
                raise_fault_flag(sync.member.store, sync.epoch, f"replica {sync.member.replica}: {fault}")
            logger.warning("admission after step %d, epoch %d: %s", admitted_after, sync.epoch, fault)
            decision = sync.propose(label, "abort")
        if decision != "commit":
            return False
        sync.mark_committed()
        sync.joining = False
        sync.events.emit("admission_committed", step=admitted_after + 1, epoch=sync.epoch, joiners=list(joiners),
                         donor=donor, members=list(sync.members))
        return True

    def _hold_for_restarts(self, step: int) -> None:
        """``recover.rejoin_wait_s``: hold this step boundary for a dropped group that the launcher restarts
        (it has restarts left, ``recover.max_restarts``) until it asks to join, so that it is admitted at this
        step's commit, or until ``rejoin_wait_s`` after it was dropped. The group's leader (or its one rank) looks
        in the job's store and, done, says so in its group's store (``held/s{step}``), where the other ranks wait."""
        sync = self.sync
        if sync.config.rejoin_wait_s <= 0 or (sync.final_step is not None and step >= sync.final_step):
            return  # no admission after the final step's commit: nothing to wait for
        outside = [replica for replica in range(sync.groups) if replica not in sync.members]
        if not outside:
            return  # every group is a member: no request at all (the same on every rank of the group)
        member, local = sync.member, sync.member.group_store
        if local is not None and not member.leader:
            self._held_by_leader(step)
            return
        for replica in outside:
            self._hold_for(replica, step)
        if local is not None:
            local.set(GroupKeys.held(step), "1")
            if self._last_held is not None:  # its ranks read it before that step's commit, which is past
                member.discard([GroupKeys.held(self._last_held)])
            self._last_held = step

    def _hold_for(self, replica: int, step: int) -> None:
        """Hold for ``replica`` (not a member) if it was dropped and will be restarted: until every rank of its new
        start asked to join, or ``rejoin_wait_s`` after the drop."""
        sync = self.sync
        store, ranks = sync.member.store, sync.member.ranks_per_replica
        dropped = read_dropped(store, replica)
        if dropped is None or dropped[0] >= sync.config.max_restarts:
            return  # a member, never dropped, or not restarted again
        incarnation, when = dropped
        deadline = self._hold_end(replica, incarnation, when)
        started = time.monotonic()
        while time.monotonic() < deadline:
            asked = read_join_requests(store, replica, ranks)
            if asked is not None and all(v > incarnation for v in asked.values()):
                break
            sync.member.progress(step=step, phase="rejoin_wait")
            time.sleep(REJOIN_POLL_S)
        if time.monotonic() - started > 0.1:
            sync.events.emit("rejoin_wait", step=step, replica=replica, dropped_incarnation=incarnation,
                             waited_s=time.monotonic() - started, ready=time.monotonic() < deadline)

    def _hold_end(self, replica: int, incarnation: int, dropped_at: float) -> float:
        """When the hold for ``replica``'s restart after its drop at ``dropped_at`` ends, on this process's monotonic
        clock: ``rejoin_wait_s`` after the drop, as far as this host's wall clock tells the drop's age, fixed when
        this leader first sees the drop. The drop's time is the coordinator's wall clock, on another host perhaps:
        a clock behind it cannot make the hold longer than ``rejoin_wait_s``."""
        key = (replica, incarnation)
        if key not in self._hold_ends:
            wait = self.sync.config.rejoin_wait_s
            left = min(wait, max(0.0, dropped_at + wait - time.time()))
            self._hold_ends[key] = time.monotonic() + left
        return self._hold_ends[key]

    def _held_by_leader(self, step: int) -> None:
        """A rank other than the leader: wait until its leader stopped holding ``step``'s boundary."""
        sync = self.sync
        sync.member.from_leader(GroupKeys.held(step), sync.config.rejoin_wait_s + sync.config.agree_timeout_s,
                                waiting_for=f"end of its hold before step {step} for a restarting group",
                                bound="recover.rejoin_wait_s + recover.agree_timeout_s", step=step,
                                phase="rejoin_wait")

    def _wait_until_admitted(self) -> tuple[int, tuple[int, ...]]:
        sync = self.sync
        started = time.time()
        _, _, _, admission = sync.member.wait_for_admission(sync.config.startup_timeout_s)
        sync.build_group()
        step, admitting = decode_admission(admission)
        sync.events.emit("admitted", epoch=sync.epoch, members=list(sync.members), after_step=step,
                         waited_s=time.time() - started)
        return step, admitting

    def _admitted_since(self, epoch: int) -> tuple[int, ...]:
        """Replicas admitted by the epochs after ``epoch`` up to this rank's: the leader (or the one rank) reads
        them in the job's store and passes them on in its group's store (``admitting/e{epoch}``), where the
        group's other ranks read them."""
        sync = self.sync
        member, local, key = sync.member, sync.member.group_store, GroupKeys.admitting(epoch)
        if local is not None and not member.leader:
            return decode_members(member.from_leader(key, sync.config.agree_timeout_s,
                                                      waiting_for=f"admission after epoch {epoch}",
                                                      bound="recover.agree_timeout_s"))[0]
        admitting: set[int] = set()
        for e in range(epoch + 1, sync.epoch + 1):
            if member.store.check([GroupKeys.admitted(e)]):
                admitting |= set(decode_admission(member.store.get(GroupKeys.admitted(e)))[1])
        if local is not None:
            local.set(key, encode_members(sorted(admitting), ""))
        return tuple(sorted(admitting))

    def _transfer(self, state: TrainingState, donor: int, joiners: tuple[int, ...], step: int) -> None:
        """Stream the donor's state to the joiners at this rank, over a group of just them."""
        sync = self.sync
        is_donor = sync.member.replica == donor
        group = sync.build_group(members=tuple(sorted((donor, *joiners))), tag="transfer", host=True)
        sync.member.progress(phase="transfer")
        sent = [0]

        def broadcast(tensor: torch.Tensor) -> None:
            group.broadcast_(tensor, root_replica=donor)
            sent[0] += 1
            if sent[0] == 1 and sync.chaos is not None:  # the header's length went out, the state has not
                sync.chaos.maybe_inject(step, "transfer")

        moving = GroupKeys.transferred(sync.epoch)

        def broadcast_many(tensors, on_each) -> None:
            def through(i: int) -> None:
                on_each(i)
                if is_donor:  # the members waiting in the admission's barrier wait on while this moves
                    sync.member.store.add(moving, 1)

            group.broadcast_many_(tensors, donor, through)

        start = time.perf_counter()
        try:
            stats = transfer(state, broadcast, is_donor=is_donor, broadcast_many=broadcast_many)
        finally:  # done with, whatever the outcome: its threads and connections go (off this thread)
            group.close()
        seconds = time.perf_counter() - start
        sync.events.emit("state_transferred", epoch=sync.epoch, role="donor" if is_donor else "joiner",
                         donor=donor, joiners=list(joiners), bytes=stats.bytes, chunks=stats.chunks,
                         host_buffers=stats.host_buffers, seconds=seconds,
                         mb_per_s=stats.bytes / 2**20 / max(seconds, 1e-9))
