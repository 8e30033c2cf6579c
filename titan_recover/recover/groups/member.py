"""A rank's side of the replica-group protocol: registration, heartbeats, joining epochs, reading decisions.

The heartbeat thread keeps working while the main thread computes or blocks: it publishes
``time,progress,step,phase``, answers a fault flag by joining the next epoch (proving the process alive), and
ends the process when its replica has been left out of an epoch, so that torchrun ends the rest of the replica.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, TYPE_CHECKING

from torch.distributed import DistStoreError, PrefixStore, Store, TCPStore

from titan_recover.recover.groups.keys import decode_entered, encode_entered, GroupKeys
from titan_recover.recover.groups.liveness import encode_group_beat, Heartbeat
from titan_recover.recover.groups.protocol import (
    admitted_incarnations, decode_admission, decode_members, encode_members,
)
from titan_recover.recover.stores import connect, read_keys

if TYPE_CHECKING:  # the [recover] section composes this package's users: only its type is named here
    from titan_recover.recover.config import RecoverConfig

logger = logging.getLogger(__name__)

COORDINATOR_ENV = "TITAN_RECOVER_COORDINATOR"
REPLICA_ENV = "TITAN_RECOVER_REPLICA"
RUN_DIR_ENV = "TITAN_RECOVER_RUN_DIR"
INCARNATION_ENV = "TITAN_RECOVER_INCARNATION"
"""Set by the launcher: how many times this replica group has been started before (0: the first start)."""
FOUNDING_STEP_ENV = "TITAN_RECOVER_FOUNDING_STEP"
"""Set by the launcher on a start it made after a cold restart: the checkpoint step the coordinator chose, which
this start loads (``GroupKeys.founding_step``)."""
LATE_BEAT_S = 0.5
"""A beat this much later than ``heartbeat_interval_s`` after the previous one is logged (with where the delay was)."""
EXIT_EXCLUDED = 75
"""Exit code of a rank whose replica was left out of an epoch."""
WAIT_SLICE_S = 1.0
"""A rank blocked on an epoch or an admission looks at ``stop`` / ``finished`` after this long, then after slices
twice as long each, up to :data:`WAIT_SLICE_MAX_S`: a wait that ends by its timeout is logged by c10d (two lines),
so a long wait (a coordinator restarting, a joiner waiting for its turn) logs a few lines, not two a second. Every
stop that can come while ranks wait ends their waits by a write: the coordinator writes ``stop`` before an epoch's
members, the launcher stopping a job without a coordinator writes the next epoch's members (the last epoch's)
after it."""
WAIT_SLICE_MAX_S = 4.0


def wait_slices(first_s: float = WAIT_SLICE_S, most_s: float = WAIT_SLICE_MAX_S):
    """The lengths of the successive slices of a long wait: ``first_s``, doubling, capped at ``most_s``."""
    slice_s = first_s
    while True:
        yield slice_s
        slice_s = min(2 * slice_s, most_s)


class TooFewReplicas(RuntimeError):
    """Fewer than ``min_replicas`` replicas remain, or replicas disagree without a majority: the job stops."""

    def __init__(self, reason: str, *, untrusted: bool = False):
        super().__init__(reason)
        self.untrusted = untrusted
        """Replicas disagreed without a majority: no replica's state can be trusted (none is saved)."""


class Excluded(RuntimeError):
    """This replica was left out of the current epoch."""


class JobOver(RuntimeError):
    """The job finished or stopped while this replica waited for admission: there is nothing left to join."""


def incarnation_from_env(environ=os.environ) -> int:
    """Which start of this replica group this is (0: the first): the launcher's restarts of its torchrun, or
    torchrun's own (``--max-restarts``, ``TORCHELASTIC_RESTART_COUNT``, for a group started by hand). One of
    the two restarts a group, never both (the launcher runs torchrun with ``--max-restarts 0``)."""
    return int(environ.get(INCARNATION_ENV, 0)) + int(environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class ReplicaMember:
    def __init__(self, config: RecoverConfig, *, replica: int, rank: int, ranks_per_replica: int, address: str,
                 incarnation: int = 0, on_excluded: Callable[[], None] | None = None,
                 group_store: Callable[[], Store] | None = None):
        if ranks_per_replica > 1 and group_store is None:
            raise ValueError(f"replica {replica} has {ranks_per_replica} ranks: they beat and pass on decisions "
                             "through the group's own store (group_store, e.g. replica_group_store), and none was "
                             "given")
        self.config = config
        self.on_excluded = on_excluded or (lambda: os._exit(EXIT_EXCLUDED))
        """Called by the heartbeat thread when this replica was left out of an epoch: ends the process (torchrun
        then ends the rest of the replica). A host of many simulated members ends only the one."""
        self.replica, self.rank, self.ranks_per_replica = replica, rank, ranks_per_replica
        self.incarnation = incarnation
        self.admitted = False
        """This incarnation has been a member of an epoch. Until then it is a joiner: it answers no fault flag
        (the epochs are not its own) and is not ended by epochs that leave it out."""
        store_timeout = config.agree_timeout_s
        self.store = connect(address, store_timeout)  # main thread's client
        self._hb_store = connect(address, store_timeout)  # heartbeat thread's own client
        self.epoch = -1
        self.members: tuple[int, ...] = ()
        self._progress = time.time()
        self._step = 0
        self._phase = "startup"
        self._stop = threading.Event()
        self._faulted = -1  # the newest epoch whose fault flag the heartbeat thread saw
        self.waiting_on: tuple[int, int | str] | None = None
        """(epoch, step) of the commit barrier the main thread is blocked in: the heartbeat thread that sees the
        epoch's fault flag stores ``abort`` as the step's decision (unless one is stored) and passes the stored one
        on to the group, which wakes it (:meth:`_abort_barrier`)."""
        self.leader = rank == 0
        """The group's leader rank relays every rank's beat to the job's store, mirrors the fault flag into the
        group's store (docs/replica_groups.md "Liveness") and counts the group in at the commit barrier: the job's
        store sees one beat and one flag check per group and heartbeat interval, and one rank per group at each
        commit, whatever the ranks per group."""
        self.group_store = group_store() if group_store is not None else None
        """The main thread's client of the replica group's own store (torchrun's, :func:`replica_group_store`):
        the group's half of the commit barrier (``replica_sync``). None for a group of one rank."""
        self._hb_group_store = group_store() if group_store is not None else None
        """The heartbeat thread's client of it (a blocked wait holds a client): ranks other than the leader beat
        into it and read the mirrored fault flag there."""
        self._discarded: deque[str] = deque()
        """Keys of the group's store that no rank of the group reads any more, for the heartbeat thread to delete
        (:meth:`discard`): off the step's path."""
        self._relayed: dict[int, Heartbeat] = {}  # the leader's latest beat of every rank of its group
        self._mirror_from = 0  # the leader mirrored every raised flag of the epochs before this one
        self._thread: threading.Thread | None = None
        self.beacon = None
        """A :class:`~titan_recover.recover.scout.beacon.Beacon` for the hang observer, or None."""

    # ---- main thread -------------------------------------------------------------------------------------
    def progress(self, step: int | None = None, phase: str | None = None) -> None:
        """Record main-thread progress (read by the heartbeat thread)."""
        self._progress = time.time()
        if step is not None:
            self._step = step
        if phase is not None:
            self._phase = phase
        if self.beacon is not None:
            self.beacon.update(step, phase)

    def register(self) -> None:
        self.store.set(
            GroupKeys.register(self.replica, self.rank),
            f"{os.getpid()},{socket.gethostname()},{self.ranks_per_replica},{self.incarnation}",
        )
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="titan-recover-heartbeat", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Training ended normally (or stopped as the protocol asked): from now on a silent heartbeat is not a
        failure. Never called on an error path: a crashed rank must look dead. The heartbeat thread stops first:
        once every rank is done the coordinator closes the store, and a beat after that would fail loudly."""
        if not self.leader and self.group_store is not None:  # its leader counts it as joined from now on
            self.group_store.set(GroupKeys.rank_done(self.rank), "1")
        self.close()
        self.store.set(GroupKeys.done(self.replica, self.rank), "1")
        self.store.add(GroupKeys.DONE_COUNT, 1)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.config.heartbeat_interval_s + 1)

    def current_epoch(self) -> int:
        return int(self.store.get(GroupKeys.EPOCH)) if self.store.check([GroupKeys.EPOCH]) else -1

    def members_of(self, epoch: int) -> tuple[int, ...]:
        """Members the coordinator published for ``epoch``, read in the job's store."""
        return decode_members(self.store.get(GroupKeys.members(epoch)))[0]

    def entered_members_of(self, epoch: int) -> tuple[int, ...]:
        """Members of ``epoch``, an epoch this rank entered or went past on its way to its current one (what a
        ledger's transitions read): a rank other than the leader reads them in its group's store, where its leader
        put every epoch it entered or went past (:meth:`_pass_on_entered`)."""
        if self.group_store is None or self.leader:
            return self.members_of(epoch)
        return decode_members(self.group_store.get(GroupKeys.members(epoch)))[0]

    def fault_flag(self, epoch: int) -> bytes | None:
        """The value of ``epoch``'s fault flag (``time|reason``) if raised, else None: the leader (or the one rank)
        reads the job's store, another rank its leader's mirror in the group's store (None until the mirror holds
        the value)."""
        store = self.group_store if self.group_store is not None and not self.leader else self.store
        flag = read_keys(store, [GroupKeys.fault(epoch)])[0]  # one read on etcd: the key may go meanwhile
        return flag if flag is not None and b"|" in flag else None  # a mirror without its value yet: not known

    def wait_for_epoch(self, after: int, timeout_s: float) -> tuple[int, tuple[int, ...], str]:
        """Block until an epoch newer than ``after`` is published; returns (epoch, members, reason). The leader (or
        the one rank) blocks in the job's store on the next epoch's members key (woken when the coordinator writes
        it), looking at ``stop`` between :func:`wait_slices`; the coordinator writes ``stop`` before the members,
        so a rank that sees the epoch also sees a stop that came with it. The leader passes what it found on in
        its group's store (``entered``), where the group's other ranks wait for it: one rank per group waits in
        the job's store."""
        if self.group_store is not None and not self.leader:
            return self._entered_by_leader(after, timeout_s)
        deadline = time.monotonic() + timeout_s
        for slice_s in wait_slices():
            self.progress()
            published = wait_for_key(self.store, GroupKeys.members(after + 1),
                                     max(0.01, min(slice_s, deadline - time.monotonic())))
            if self.store.check([GroupKeys.STOP]):
                return self._enter_stop(after)
            if published:
                epoch, members = self._published_after(after)
                if epoch > after + 1 and self.store.check([GroupKeys.STOP]):
                    return self._enter_stop(after)  # a later epoch came with a stop after the look above
                return self._enter(self._pass_on_entered(after, epoch, encode_entered(epoch, members)))
            if time.monotonic() > deadline:
                # no coordinator decided within the bound (the launcher restarts a dead one well within it): stop
                # with the last committed step rather than train on without anyone to judge failures
                raise TooFewReplicas(
                    f"replica {self.replica} rank {self.rank}: no epoch after {after} was published within "
                    f"{timeout_s} s (recover.agree_timeout_s): the coordinator is gone and was not restarted; "
                    "stopping with the last committed step"
                )

    def _enter_stop(self, after: int) -> tuple[int, tuple[int, ...], str]:
        """The wait after ``after`` ended with the job's stop: entered as such, and passed on to the group."""
        entered = encode_entered(None, stop=self.store.get(GroupKeys.STOP).decode(),
                                 untrusted=self.store.check([GroupKeys.STOP_UNTRUSTED]))
        return self._enter(self._pass_on_entered(after, after + 1, entered))

    def _published_after(self, after: int) -> tuple[int, bytes]:
        """Once epoch ``after + 1`` is published: the newest epoch (the coordinator may have moved on since) and its
        members' stored value. One request where that is ``after + 1``: ``epoch`` and the members read together
        (``epoch`` exists from epoch 0's publication on, and the coordinator writes an epoch's members before
        ``epoch``); a second only where the coordinator moved on."""
        if after < 0:  # epoch 0's members can be read before ``epoch`` is written
            epoch = max(0, self.current_epoch())
            return epoch, self.store.get(GroupKeys.members(epoch))
        newest, members = self.store.multi_get([GroupKeys.EPOCH, GroupKeys.members(after + 1)])
        epoch = max(after + 1, int(newest))
        return epoch, members if epoch == after + 1 else self.store.get(GroupKeys.members(epoch))

    def _pass_on_entered(self, after: int, epoch: int, entered: str) -> str:
        """The leader: tell its group's other ranks what the wait after ``after`` ended with, under every epoch
        from ``after`` to ``epoch - 1`` (a rank of the group may wait after any of those it is still in); then
        the members of the epoch it entered and of every epoch it went past (a rank's ledger reads each of them:
        :meth:`entered_members_of`, whose read waits for the key)."""
        if self.group_store is None:
            return entered
        for skipped in range(after, epoch):
            self.group_store.set(GroupKeys.entered(skipped), entered)
        entered_epoch, members, _ = decode_entered(entered)
        if entered_epoch is not None and self.replica in decode_members(members)[0]:  # else nobody reads them
            self.group_store.set(GroupKeys.members(epoch), members)
            for passed in range(after + 1, epoch):
                self.group_store.set(GroupKeys.members(passed), self.store.get(GroupKeys.members(passed)))
        return entered

    def _entered_by_leader(self, after: int, timeout_s: float) -> tuple[int, tuple[int, ...], str]:
        """A rank other than the leader: what its leader's wait after ``after`` ended with, in the group's store."""
        entered = self.from_leader(GroupKeys.entered(after), timeout_s, waiting_for=f"epoch after {after}",
                                   bound="recover.agree_timeout_s", error=TooFewReplicas,
                                   then="the coordinator is gone and was not restarted, or the leader is; stopping "
                                        "with the last committed step")
        return self._enter(entered.decode())

    def from_leader(self, key: str, timeout_s: float, *, waiting_for: str, bound: str,
                    error: type[Exception] = RuntimeError, then: str = "it is stuck or gone", **progress) -> bytes:
        """A rank other than the leader: what its leader wrote under ``key`` in the group's store, waited for in
        :func:`wait_slices` (this rank's progress recorded between them, with ``progress``). Once ``timeout_s``
        passed without it, raises ``error`` with a sentence naming ``waiting_for``, the ``bound`` (the setting it
        follows) and ``then``."""
        if self.wait_alive(self.group_store, key, timeout_s, **progress):
            return self.group_store.get(key)
        raise error(f"replica {self.replica} rank {self.rank}: its group's leader (rank 0) passed on no "
                    f"{waiting_for} within {timeout_s} s ({bound}): {then}")

    def wait_alive(self, store: Store, key: str, timeout_s: float, **progress) -> bool:
        """Wait up to ``timeout_s`` for ``key`` in ``store`` (True once it is there) in :func:`wait_slices`, this
        rank's progress recorded before each (with ``progress``): a rank waiting on its peers is alive, not hung.
        Unrecorded, a wait longer than ``progress_timeout_s`` (a commit barrier waiting for a stuck group, or out a
        long state transfer) had the coordinator declare the waiting ranks hung too (the fault soak)."""
        deadline = time.monotonic() + timeout_s
        for slice_s in wait_slices():
            self.progress(**progress)
            if wait_for_key(store, key, max(0.01, min(slice_s, deadline - time.monotonic()))):
                return True
            if time.monotonic() > deadline:
                return False

    def _enter(self, entered: str) -> tuple[int, tuple[int, ...], str]:
        """Enter the epoch a wait ended with (``entered``); raise if it is a stop or leaves this replica out."""
        epoch, value, untrusted = decode_entered(entered)
        if epoch is None:
            raise TooFewReplicas(value, untrusted=untrusted)
        members, reason = decode_members(value)
        if self.replica not in members:
            raise Excluded(f"replica {self.replica} left out of epoch {epoch}: {reason}")
        self.epoch, self.members = epoch, members
        self.admitted = True
        return epoch, members, reason

    def wait_for_admission(self, timeout_s: float) -> tuple[int, tuple[int, ...], str, str]:
        """A joiner: every rank asks to be admitted (``join_request``: the coordinator admits a group once every rank
        of its new start asked); the leader (or the one rank) blocks until an epoch includes this replica (in the
        job's store, on the next epoch's members key; ``finished`` and ``stop`` are looked at between
        :func:`wait_slices`) and passes what it found on in its group's store (``admitted/i{incarnation}``), where
        the group's other ranks wait for it, so that all of them enter the same epoch. Returns (epoch, members,
        reason, the admission that let this replica in: ``admitted/e{x}``'s value, ``step|replicas``)."""
        self.store.set(GroupKeys.join_request(self.replica, self.rank), str(self.incarnation))
        if self.group_store is not None and not self.leader:
            return self._admitted_by_leader(timeout_s)
        try:
            epoch, raw, admission = self._wait_admitted(timeout_s)
        except JobOver as over:
            self._pass_on_admission(encode_entered(None, stop=str(over)), "")
            raise
        if self.group_store is not None:
            self.group_store.set(GroupKeys.members(epoch), raw)  # the ledger's first epoch (entered_members_of)
        self._pass_on_admission(encode_entered(epoch, raw), admission)
        return self._enter_admitted(epoch, raw, admission)

    def _wait_admitted(self, timeout_s: float) -> tuple[int, bytes, str]:
        """The leader's wait for the first epoch that includes this replica by an admission of this start: (epoch,
        its members' stored value, the admission)."""
        deadline = time.monotonic() + timeout_s
        for slice_s in wait_slices():
            self.progress()
            if self.store.check([GroupKeys.FINISHED]) or self.store.check([GroupKeys.STOP]):
                raise JobOver(f"replica {self.replica}: the job ended before this replica was admitted")
            epoch = self.current_epoch()
            if epoch > self.epoch:
                raw = self.store.get(GroupKeys.members(epoch))
                admission = self._admission_into(epoch) if self.replica in decode_members(raw)[0] else None
                if admission is not None:
                    return epoch, raw, admission
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replica {self.replica} rank {self.rank}: not admitted within {timeout_s} s "
                    "(recover.startup_timeout_s); are the running replicas committing steps?"
                )
            wait_for_key(self.store, GroupKeys.members(epoch + 1), max(0.01, min(slice_s, deadline - time.monotonic())))

    def _admission_into(self, epoch: int) -> str | None:
        """The admission that let this start of the replica into ``epoch`` or an epoch before it (the admitting
        epoch may already be behind a newer one: a fault during the admission), or None: the replica is a member
        of ``epoch`` for another start of it, an earlier one whose loss the coordinator has not handled yet (it was
        slow, or restarting) or one whose request it admitted after that start was lost; this start waits on for
        an epoch that admits it."""
        for admitting in range(epoch, -1, -1):
            if self.store.check([GroupKeys.admitted(admitting)]):
                raw = self.store.get(GroupKeys.admitted(admitting)).decode()
                if self.replica in decode_admission(raw)[1]:
                    start = admitted_incarnations(raw).get(self.replica, self.incarnation)
                    return raw if start == self.incarnation else None
        return None

    def _pass_on_admission(self, entered: str, admission: str) -> None:
        if self.group_store is not None:
            self.group_store.set(GroupKeys.admitted_to(self.incarnation),
                                 json.dumps({"entered": entered, "admission": admission}))

    def _admitted_by_leader(self, timeout_s: float) -> tuple[int, tuple[int, ...], str, str]:
        """A rank other than the leader: what its leader's admission wait found, in the group's store."""
        found = json.loads(self.from_leader(GroupKeys.admitted_to(self.incarnation),
                                            timeout_s + self.config.agree_timeout_s, waiting_for="admission",
                                            bound="recover.startup_timeout_s + recover.agree_timeout_s",
                                            error=TimeoutError))
        epoch, value, _ = decode_entered(found["entered"])
        if epoch is None:
            raise JobOver(value)
        return self._enter_admitted(epoch, value, found["admission"])

    def _enter_admitted(self, epoch: int, raw: bytes | str, admission: str) -> tuple[int, tuple[int, ...], str, str]:
        members, reason = decode_members(raw)
        self.epoch, self.members = epoch, members
        self.admitted = True
        return epoch, members, reason, admission

    def discard(self, keys: list[str]) -> None:
        """Hand keys of the group's own store that no rank of the group reads any more to the heartbeat thread,
        which deletes them after its next beat."""
        self._discarded.extend(keys)

    def fault_seen(self, epoch: int) -> bool:
        """The heartbeat thread saw the fault flag of ``epoch`` (or of a later one): no store request. Until this
        start is admitted the thread watches no flag; callers then look in the store themselves."""
        return self._faulted >= epoch

    @property
    def watches_faults(self) -> bool:
        return self.admitted and self._thread is not None

    # ---- heartbeat thread --------------------------------------------------------------------------------
    def _beat(self) -> None:
        """Another rank writes its beat to the group's store; the leader writes the group's beat to the job's store:
        its own and the latest of every other rank (read from the group's store in one request)."""
        beat = Heartbeat(time.time(), self._progress, self._step, self._phase, self.incarnation)
        if not self.leader:
            self._hb_group_store.set(GroupKeys.rank_beat(self.rank), beat.encode())
            return
        self._relayed[self.rank] = beat
        others = range(1, self.ranks_per_replica)
        if others:
            keys = [GroupKeys.rank_beat(r) for r in others]
            local = self._hb_group_store
            if len(self._relayed) == self.ranks_per_replica or local.check(keys):
                values = local.multi_get(keys)
            else:  # not every rank has beaten yet (start-up): relay those that have
                values = [local.get(k) if local.check([k]) else None for k in keys]
            self._relayed.update({r: Heartbeat.decode(v) for r, v in zip(others, values) if v is not None})
        self._hb_store.set(GroupKeys.heartbeat(self.replica), encode_group_beat(self._relayed))

    def _delete_discarded(self) -> None:
        """Delete the keys the main thread discarded (:meth:`discard`) from the group's store."""
        while self._discarded:
            self._hb_group_store.delete_key(self._discarded.popleft())

    def _fault_raised(self, epoch: int) -> bool:
        """Whether ``epoch``'s fault flag is raised. The leader reads the job's store and mirrors a raised flag into
        the group's store, where the other ranks look (so they make no request of the job's store per beat)."""
        if not self.leader:
            return self._hb_group_store.check([GroupKeys.fault(epoch)])
        raised = self._hb_store.check([GroupKeys.fault(epoch)])
        if raised and self._hb_group_store is not None:
            self._hb_group_store.set(GroupKeys.fault(epoch), "1")  # its value follows the join (_mirror_reason)
        return raised

    def _mirror_reason(self, epoch: int) -> None:
        """The leader, after its join: the flag's value (``time|reason``) into the group's store, where the other
        ranks read when and why it was raised (:meth:`fault_flag`). Not before the join: one more request to the job's
        store would delay every rank's join."""
        if self.leader and self._hb_group_store is not None:
            self._hb_group_store.set(GroupKeys.fault(epoch), self._hb_store.get(GroupKeys.fault(epoch)))

    def _abort_barrier(self, epoch: int, step: int | str) -> None:
        """The flag of ``epoch`` came while the main thread waits in that epoch's commit barrier of ``step``:
        ``abort`` becomes the step's decision unless one is stored, and the stored one is passed on to the group."""
        propose_decision(self._hb_store, self._hb_group_store, epoch, step, "abort")

    def _mirror_skipped(self, watching: int) -> None:
        """The leader moved past epochs without seeing their flags (its main thread changed epoch first): mirror
        those raised since, for a rank of its group still in one of them."""
        if self.leader and self._hb_group_store is not None:
            for epoch in range(self._mirror_from, watching):
                self._fault_raised(epoch)
            self._mirror_from = max(self._mirror_from, watching)

    def _heartbeat_loop(self) -> None:
        """Every ``heartbeat_interval_s``: beat, and look at the current epoch's fault flag (the leader in the job's
        store, the other ranks in the group's: :meth:`_beat`, :meth:`_fault_raised`), then :meth:`_watch_epochs`, then
        delete the group's keys the main thread discarded."""
        interval = self.config.heartbeat_interval_s
        watch = _EpochWatch()
        last_beat = idle_from = time.monotonic()
        store_s = 0.0  # the previous round's store calls after its beat
        while not self._stop.wait(interval):
            try:
                woke = time.monotonic()
                self._beat()
                beaten = time.monotonic()
                if beaten - last_beat > interval + LATE_BEAT_S:
                    # the coordinator declares this rank dead at heartbeat_timeout_s: say where the time went
                    logger.warning("replica %d rank %d: heartbeat %.2f s after the previous one (the thread woke "
                                   "%.2f s late; store calls took %.2f s; main thread at step %d, %s)", self.replica,
                                   self.rank, beaten - last_beat, woke - idle_from - interval,
                                   store_s + beaten - woke, self._step, self._phase)
                last_beat = beaten
                try:
                    if self.admitted:
                        self._watch_epochs(watch)
                    self._delete_discarded()
                finally:
                    idle_from = time.monotonic()
                    store_s = idle_from - beaten
            except Exception as error:  # the job's store is unreachable: the main thread's calls will fail too
                logger.warning("replica %d rank %d: heartbeat failed: %s", self.replica, self.rank, error)
                time.sleep(self.config.heartbeat_interval_s)

    def _watch_epochs(self, watch: _EpochWatch) -> None:
        """On the flag of the epoch it watches, the thread joins the next epoch (the process is alive), records the
        fault for the main thread (:meth:`fault_seen`: collectives read it without a store request) and wakes a
        commit barrier blocked in that epoch by storing ``abort`` as its decision. Once the coordinator published
        the next epoch it ends the process if its replica was left out."""
        watch.watching = max(watch.watching, self.epoch)
        self._mirror_skipped(watch.watching)
        if watch.joined > watch.watching:  # joined the next epoch: is this replica in it?
            published = self._published(watch.joined)
            if published is None:
                if self.leader and self._hb_group_store is not None:
                    self._report_joining(watch)
                return
            members, stopping = published
            if self.replica not in members and not stopping:
                logger.error("replica %d rank %d: left out of epoch %d, exiting", self.replica, self.rank,
                             watch.joined)
                self.on_excluded()
            watch.watching = watch.joined
        elif self._fault_raised(watch.watching):
            self._faulted = max(self._faulted, watch.watching)
            watch.joined, watch.reported = watch.watching + 1, set()
            self._join(watch.joined)
            barrier = self.waiting_on
            if barrier is not None and barrier[0] <= watch.watching:
                self._abort_barrier(*barrier)
            self._mirror_reason(watch.watching)

    def _join(self, epoch: int) -> None:
        """Join ``epoch`` in the group's store (``rank_join`` and a count); the rank that brings the count to the
        group's size, the last one in, writes the group's join to the job's store (:meth:`_complete_join`)."""
        local = self._hb_group_store
        if local is None:  # a group of one rank
            self._complete_join(epoch)
            return
        local.set(GroupKeys.rank_join(epoch, self.rank), f"{time.time():.6f}")
        if local.add(GroupKeys.joined_ranks(epoch), 1) == self.ranks_per_replica:
            self._complete_join(epoch)

    def _complete_join(self, epoch: int) -> None:
        """Write the group's complete join of ``epoch`` to the job's store and count it in, once: the first writer
        of the key (compare-and-set, with this rank in the value) counts (the last rank in and a leader that sees
        every rank in or finished may both try)."""
        mine = encode_members(range(self.ranks_per_replica), str(self.rank))
        stored = self._hb_store.compare_set(GroupKeys.join(epoch, self.replica), "", mine)
        if (stored.decode() if isinstance(stored, bytes) else stored) == mine:
            self._hb_store.add(GroupKeys.joined_count(epoch), 1)

    def _report_joining(self, watch: _EpochWatch) -> None:
        """The leader, at each beat until the group's join is complete: which of its ranks joined so far
        (``joining``, for the coordinator to name the missing ones), rewritten as more join. A rank that finished
        training counts as joined (done, not dead): once every rank joined or finished, the leader completes the
        join itself (a finished rank never adds to the count)."""
        local, everyone = self._hb_group_store, set(range(self.ranks_per_replica))
        if watch.reported == everyone or local.add(GroupKeys.joined_ranks(watch.joined), 0) >= len(everyone):
            watch.reported = everyone
            return
        ranks = {r for r in everyone if local.check([GroupKeys.rank_join(watch.joined, r)]) or
                 (r != self.rank and local.check([GroupKeys.rank_done(r)]))}
        if ranks == everyone:
            self._complete_join(watch.joined)
        elif ranks != watch.reported:
            self._hb_store.set(GroupKeys.joining(watch.joined, self.replica), encode_members(sorted(ranks), ""))
        watch.reported = ranks

    def _published(self, epoch: int) -> tuple[tuple[int, ...], bool] | None:
        """``(members, stopping)`` of ``epoch`` once published, else None. The leader reads the job's store and
        mirrors the members (and a stop, first) into the group's store, where the other ranks read them."""
        if not self.leader:
            local = self._hb_group_store
            if not local.check([GroupKeys.members(epoch)]):
                return None
            return decode_members(local.get(GroupKeys.members(epoch)))[0], local.check([GroupKeys.STOP])
        store, local = self._hb_store, self._hb_group_store
        if not store.check([GroupKeys.members(epoch)]):
            return None
        raw, stopping = store.get(GroupKeys.members(epoch)), store.check([GroupKeys.STOP])
        if local is not None:
            if stopping:
                local.set(GroupKeys.STOP, store.get(GroupKeys.STOP))
            local.set(GroupKeys.members(epoch), raw)
        return decode_members(raw)[0], stopping


@dataclass
class _EpochWatch:
    """What a heartbeat thread follows of the epochs (:meth:`ReplicaMember._watch_epochs`)."""

    watching: int = -1
    """The epoch whose fault flag it looks at."""
    joined: int = -1
    """The newest epoch it joined."""
    reported: set[int] = field(default_factory=set)
    """The leader: the ranks of its group it last reported as joined to ``joined`` (every rank: complete)."""


def wait_for_key(store: Store, key: str, timeout_s: float) -> bool:
    """Block until ``key`` exists in ``store`` (True) or ``timeout_s`` passed (False): one request, woken by the
    write, instead of polling. Waits are sized to end by the write, not by the timeout (c10d logs every timed-out
    wait)."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return True
    except DistStoreError:
        return False


def propose_decision(store: Store, local: Store | None, epoch: int, step: int | str, proposal: str) -> str:
    """Store ``proposal`` as the step's decision in the job's ``store`` unless one is stored; the stored one is
    every member's decision: returned, and passed on to the group's own store (``local``)."""
    stored = store.compare_set(GroupKeys.decision(epoch, step), "", proposal)
    decision = stored.decode() if isinstance(stored, bytes) else stored
    pass_on(local, epoch, step, decision)
    return decision


def pass_on(local: Store | None, epoch: int, step: int | str, decision: str) -> None:
    """Make the job's decision of ``step`` known in the group's own store (``local``; nothing for a group of one
    rank): the group's ranks waiting for it wake, and so does its leader waiting for them."""
    if local is not None:
        local.set(GroupKeys.decision(epoch, step), decision)
        local.set(GroupKeys.group_ready(epoch, step), "decided")


def replica_group_store(timeout_s: float, environ=os.environ) -> Store:
    """A client of the replica group's own store: the one its ranks' process group was formed on (torchrun's,
    ``MASTER_ADDR:MASTER_PORT``; after a torchrun restart rank 0's, see ``train.fresh_store_after_restart``), under
    a prefix of its own. It lives exactly as long as the group."""
    try:
        host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        raise RuntimeError("a replica group of several ranks needs its own store: MASTER_ADDR and MASTER_PORT "
                           "(set by torchrun) are missing or not a port") from e
    client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return PrefixStore("titan_recover", client)
