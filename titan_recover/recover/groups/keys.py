"""The replica-group protocol's store keys, and the few reads and writes of their values that both sides share.

Shared by the coordinator (a process of its own), a rank's membership client and its step synchronisation, the
fault-tolerant group (which raises the fault flag) and the launcher (which ends dropped replicas). This module
imports no client module, so the coordinator imports nothing that runs on a rank. The pure decisions over these
values are in :mod:`~titan_recover.recover.groups.protocol`; the contract is docs/replica_groups.md.
"""

from __future__ import annotations

import math
import time

from torch.distributed import Store


class GroupKeys:
    """Store keys of the replica-group protocol, in one place (other protocols have their own: ``DilocoKeys``)."""

    EPOCH = "epoch"
    STOP = "stop"
    STOP_SIGNAL = "stop/signal"
    """Set before ``STOP`` by the launcher whose signal asked for the stop (SIGUSR1; SIGTERM with a preemption
    grace): every node's launcher then exits 128 + that signal."""
    PREEMPTED_PREFIX = "preempted/"
    """``preempted/<node>``: that node's launcher got a preemption notice (``[recover] preemption_grace_s``)."""
    STOP_UNTRUSTED = "stop/untrusted"
    """Set before ``STOP`` when replicas disagree without a majority: no replica's state may be saved."""
    FINISHED = "finished"
    """Written by the coordinator once every member finished: ``trained`` (the training budget was committed) or
    ``stopped`` (the job stopped early; ``STOP`` says why). The launcher's exit code follows it."""
    CHECKPOINT_REQUESTED = "checkpoint/requested"
    """A counter: durable checkpoints asked for while the job trains on (a node whose groups left on a preemption
    notice adds 1). The commit that serves them says so in its decision (``CommitDecision.checkpoint``) and moves
    ``CHECKPOINT_SERVED`` up to the count it saw."""
    CHECKPOINT_SERVED = "checkpoint/served"
    """A counter: the requests the last commit with a checkpoint served."""
    COORDINATOR_STATE = "coordinator/state"
    """The coordinator's write-ahead state (:class:`~titan_recover.recover.groups.protocol.CoordinatorState`)."""
    DONE_COUNT = "done_count"
    """Ranks that finished training (each adds 1 after writing its ``done`` key): the coordinator looks at ranks'
    ``done`` keys one by one only once it is non-zero, so its per-tick requests do not grow with the ranks."""
    COLD_RESTART = "cold_restart"
    """The latest epoch ``R`` the coordinator formed empty because no live member held the state: every group is
    restarted from the newest durable state and founds epoch ``R + 1`` (docs/replica_groups.md "Losing every
    replica")."""
    COORDINATOR_BEAT = "coordinator/beat"
    """Rewritten by the coordinator while it makes progress; the launcher restarts one whose beat stays unchanged
    for ``coordinator_timeout_s`` (hung)."""
    COORDINATOR_STARTS = "coordinator/starts"
    """How many times a coordinator of this job started (a counter; a restart resumes the stored state)."""
    COORDINATOR_LEADER = "coordinator/leader"
    """With standby coordinators (an etcd store): the identity of the leading one, bound to its etcd lease
    (``stores/leader.py``); the others campaign for it."""

    @staticmethod
    def register(replica: int, rank: int) -> str:
        return f"register/{replica}/{rank}"

    @staticmethod
    def done(replica: int, rank: int) -> str:
        return f"done/{replica}/{rank}"

    @staticmethod
    def heartbeat(replica: int) -> str:
        """The replica group's beat, relayed by its leader rank (rank 0): every rank's latest beat
        (:func:`~titan_recover.recover.groups.liveness.encode_group_beat`)."""
        return f"hb/{replica}"

    @staticmethod
    def rank_beat(rank: int) -> str:
        """In the replica group's own store: a rank's beat, which its leader relays."""
        return f"hb/{rank}"

    @staticmethod
    def founding(epoch: int, replica: int) -> str:
        """Written by the launcher of ``replica``'s node after the cold restart ``epoch``: the incarnation it started
        to found epoch ``epoch + 1`` from the newest durable state, or ``-1`` (no restarts left)."""
        return f"founding/e{epoch}/{replica}"

    @staticmethod
    def founding_step(epoch: int) -> str:
        """Written by the coordinator with the cold restart ``epoch``: the checkpoint step every group restarts
        from, chosen once, so that every start loads the same one whatever its own listing of the folder shows
        (a shared file system may show a new step to some nodes before others)."""
        return f"founding/e{epoch}/step"

    @staticmethod
    def members(epoch: int) -> str:
        return f"epoch/{epoch}/members"

    @staticmethod
    def fault(epoch: int) -> str:
        return f"fault/e{epoch}"

    @staticmethod
    def join(epoch: int, replica: int) -> str:
        """Every rank of ``replica`` joined ``epoch``: written once (compare-and-set) by the rank of the group that
        completed it (``encode_members``: the ranks, and the writer as the reason)."""
        return f"join/e{epoch}/{replica}"

    @staticmethod
    def joining(epoch: int, replica: int) -> str:
        """The ranks of ``replica`` that joined ``epoch`` so far (``encode_members``), rewritten by its leader at its
        beats until the join is complete: what names the missing ranks of a group left out."""
        return f"join/e{epoch}/{replica}/so_far"

    @staticmethod
    def joined_count(epoch: int) -> str:
        """Groups all of whose ranks joined ``epoch`` (added to by the writer of the group's ``join``): one read per
        look."""
        return f"joined/e{epoch}"

    @staticmethod
    def rank_join(epoch: int, rank: int) -> str:
        """In the replica group's own store: rank ``rank`` joined ``epoch``."""
        return f"join/e{epoch}/{rank}"

    @staticmethod
    def joined_ranks(epoch: int) -> str:
        """In the replica group's own store: how many of its ranks joined ``epoch`` (each adds 1 after its
        ``rank_join``); the one that brings it to the group's size writes the group's ``join``."""
        return f"joined/e{epoch}/ranks"

    @staticmethod
    def rank_done(rank: int) -> str:
        """In the replica group's own store: rank ``rank`` (not the leader) finished training; its leader counts it
        as joined (done, not dead)."""
        return f"done/{rank}"

    @staticmethod
    def entered(after: int) -> str:
        """In the replica group's own store: what the leader's wait for an epoch after ``after`` ended with, passed
        on to the group's other ranks waiting for the same (:func:`encode_entered`)."""
        return f"entered/e{after}"

    @staticmethod
    def look(n: int) -> str:
        """In the replica group's own store: the leader's ``n``-th look at its epoch's fault flag before a
        collective, ``"{epoch} move"`` or ``"{epoch} stay"``, which the group's other ranks take as theirs
        (``ReplicaSync.catch_up``)."""
        return f"look/{n}"

    @staticmethod
    def admitted_to(incarnation: int) -> str:
        """In the replica group's own store: what the leader's wait for admission of start ``incarnation`` found
        (JSON: the epoch entered, as ``entered``, or the job's end; the admission's value), for the group's other
        ranks."""
        return f"admitted/i{incarnation}"

    @staticmethod
    def admitting(epoch: int) -> str:
        """In the replica group's own store: the replicas admitted by the epochs after ``epoch`` up to the one its
        leader entered when its members ran an admission from ``epoch``, for the group's other ranks."""
        return f"admitting/e{epoch}"

    @staticmethod
    def held(step: int) -> str:
        """In the replica group's own store: its leader stopped holding the boundary before ``step`` for a
        restarting group (``recover.rejoin_wait_s``); the group's other ranks waited for it."""
        return f"held/s{step}"

    @staticmethod
    def reduced(epoch: int, step: int | str) -> str:
        """Groups whose ranks finished the step's reduction (counted by the leaders); in a group's own store, its
        other ranks that did."""
        return f"reduced/e{epoch}/s{step}"

    @staticmethod
    def decision(epoch: int, step: int | str) -> str:
        """The step's commit decision (compare-and-set: the first proposal stays); in a group's own store, the
        same decision passed on to the group's ranks."""
        return f"decision/e{epoch}/s{step}"

    @staticmethod
    def group_ready(epoch: int, step: int | str) -> str:
        """In a group's own store: every rank other than the leader finished the step's reduction (``in``), or the
        decision was passed on (``decided``): the leader's wait in the commit barrier ends."""
        return f"ready/e{epoch}/s{step}"

    @staticmethod
    def group_prefix(epoch: int, rank: int, tag: str = "") -> str:
        return f"ftpg/e{epoch}/p{rank}" + (f"/{tag}" if tag else "")

    @staticmethod
    def join_request(replica: int, rank: int) -> str:
        """Written by a restarted (or late) replica's rank when it waits for admission: its incarnation."""
        return f"join_request/{replica}/{rank}"

    @staticmethod
    def starts(replica: int) -> str:
        """A counter: the starts of ``replica`` made so far, by any node's launcher. Each start takes the next number
        as its incarnation, so that a launcher replacing a lost node's never reuses the number of a start the job
        has seen (a reused one would be taken for that start: ended as dropped, or refused admission)."""
        return f"starts/{replica}"

    @staticmethod
    def dropped(replica: int) -> str:
        """``"{incarnation}|{time}"``: the start of ``replica`` last removed from an epoch, and when (the launcher
        ends it and may restart it)."""
        return f"dropped/{replica}"

    @staticmethod
    def admission(epoch: int) -> str:
        """Members ask the coordinator to admit replicas after a commit in ``epoch``: ``"{step}|{replicas}"``."""
        return f"admission/e{epoch}"

    @staticmethod
    def transferred(epoch: int) -> str:
        """A counter the donor's ranks add to as each chunk of a state transfer in ``epoch`` is through: the
        admission's other members wait for its decision while it moves (docs/phoenix.md)."""
        return f"transferred/e{epoch}"

    @staticmethod
    def admitted(epoch: int) -> str:
        """Published with an epoch that admits replicas: ``"{step}|{replicas}"`` (the step they enter after)."""
        return f"admitted/e{epoch}"

    @staticmethod
    def evicted(epoch: int, replica: int) -> str:
        """Members of ``epoch`` voted ``replica`` out (its state or computation is corrupt): the reason. The
        coordinator leaves it out of the next epoch (docs/scout.md)."""
        return f"evicted/e{epoch}/{replica}"

    @staticmethod
    def stop_checkpoint(step: int, round_: int) -> str:
        """The outcome of turn ``round_`` to write the checkpoint of a stop at ``step``: ``saved``, ``failed`` or
        ``lost`` (compare-and-set; :mod:`~titan_recover.recover.groups.stop_checkpoint`)."""
        return f"stop/checkpoint/s{step}/r{round_}"

    @staticmethod
    def stop_lost(replica: int) -> str:
        """After a stop: the coordinator found ``replica`` dead or hung (the reason). A stop's checkpoint writer
        named so loses its turn to the next candidate."""
        return f"stop/lost/{replica}"

    @staticmethod
    def evictions(epoch: int) -> str:
        """Written after ``epoch``'s ``evicted`` keys and before the fault flag: the coordinator reads those keys,
        one per member, only when this one exists."""
        return f"evicted/e{epoch}/any"

    @staticmethod
    def of_epoch(epoch: int) -> tuple[list[str], list[str]]:
        """Every key of ``epoch`` in the job's store, as ``(keys, prefixes)``: a prefix ends with ``/`` so that
        epoch 1's never matches epoch 10's keys. What is deleted once no member can read the epoch any more
        (:mod:`~titan_recover.recover.groups.collect`)."""
        keys = [GroupKeys.fault(epoch), GroupKeys.joined_count(epoch), GroupKeys.admission(epoch),
                GroupKeys.admitted(epoch), GroupKeys.transferred(epoch)]
        groups = GroupKeys.group_prefix(epoch, 0).rsplit("/", 1)[0] + "/"  # every fault-tolerant group's
        prefixes = [f"epoch/{epoch}/", f"join/e{epoch}/", f"reduced/e{epoch}/", f"decision/e{epoch}/",
                    f"evicted/e{epoch}/", f"founding/e{epoch}/", groups]
        return keys, prefixes


# ---- the fault flag: raised by a rank whose collective failed, or by the coordinator -------------------------


def vote_out(store: Store, epoch: int, replicas, reason: str) -> None:
    """Members of ``epoch`` name ``replicas`` to be left out of the next epoch (``evicted`` keys with ``reason``),
    then write the marker the coordinator looks for before it reads them (docs/scout.md); the caller raises the
    fault flag after."""
    for replica in replicas:
        store.set(GroupKeys.evicted(epoch, replica), reason)
    if replicas:  # after the names, before the flag: the coordinator looks for them only then
        store.set(GroupKeys.evictions(epoch), "1")


def newest_published(store: Store, epoch: int) -> int:
    """The newest epoch published from ``epoch`` on (an epoch's members are written before the ``epoch`` key, so
    this also finds one published after ``epoch`` was read)."""
    while store.check([GroupKeys.members(epoch + 1)]):
        epoch += 1
    return epoch


def checkpoint_requests(store: Store) -> tuple[int, int]:
    """(requested, served) durable checkpoints (``CHECKPOINT_REQUESTED`` / ``CHECKPOINT_SERVED``): one request,
    which creates no key, while none was ever asked for; three after."""
    if not store.check([GroupKeys.CHECKPOINT_REQUESTED]):
        return 0, 0
    return int(store.add(GroupKeys.CHECKPOINT_REQUESTED, 0)), int(store.add(GroupKeys.CHECKPOINT_SERVED, 0))


def request_checkpoint(store: Store) -> None:
    """Ask for a durable checkpoint of the next step committed (a node leaving on a preemption notice)."""
    store.add(GroupKeys.CHECKPOINT_REQUESTED, 1)


def raise_fault_flag(store: Store, epoch: int, reason: str) -> str:
    """Set ``fault/e{epoch}`` unless set already; returns the flag's (first writer's) value."""
    value = f"{time.time():.6f}|{reason}"
    stored = store.compare_set(GroupKeys.fault(epoch), "", value)
    return stored.decode() if isinstance(stored, bytes) else stored


def fault_time_and_reason(raw: bytes | str) -> tuple[float, str]:
    """The wall time a fault flag was raised and its reason, from the flag's stored value."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    t, _, reason = text.partition("|")
    return float(t), reason


# ---- a leader's epoch, as passed on to its group ------------------------------------------------------------


def encode_entered(epoch: int | None, members: bytes | str = "", stop: str = "", untrusted: bool = False) -> str:
    """The value of ``entered``: the epoch entered and its members' stored value, or (``epoch`` None) the stop."""
    if epoch is None:
        return f"stop;{int(untrusted)};{stop}"
    return f"{epoch};{members.decode() if isinstance(members, bytes) else members}"


def decode_entered(raw: bytes | str) -> tuple[int | None, str, bool]:
    """``(epoch, members' stored value, False)``, or ``(None, the stop's reason, untrusted)``."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    head, _, rest = text.partition(";")
    if head == "stop":
        untrusted, _, reason = rest.partition(";")
        return None, reason, untrusted == "1"
    return int(head), rest, False


# ---- admission: what a joiner asked for and which start of a replica was dropped -----------------------------


def read_dropped(store: Store, replica: int) -> tuple[int, float] | None:
    """``(incarnation, time)`` of ``replica``'s start last removed from an epoch, or None (never dropped)."""
    if not store.check([GroupKeys.dropped(replica)]):
        return None
    return parse_dropped(store.get(GroupKeys.dropped(replica)))


def write_dropped(store: Store, replica: int, incarnation: int) -> None:
    """Name ``replica``'s start ``incarnation`` as removed from the job (by the coordinator from an epoch, by the
    DiLoCo syncer from its learners): its launcher ends it if it still runs (stopped or hung, it cannot exit by
    itself) and restarts it while it has restarts left."""
    store.set(GroupKeys.dropped(replica), f"{incarnation}|{time.time():.6f}")


def parse_dropped(value: bytes) -> tuple[int, float]:
    """``(incarnation, time)`` from the value of a :meth:`GroupKeys.dropped` key."""
    incarnation, _, when = value.decode().partition("|")
    return int(incarnation), float(when)


def missing_keys(store: Store, keys: list[str], expected: int | None = None) -> list[str]:
    """The keys of ``keys`` that ``store`` does not hold, in order: one ``check`` of all of them (all there: one
    request), halved where it fails, so ``m`` missing keys of ``n`` cost at most ``2 m log2(n)`` requests or so
    instead of ``n``. ``expected``: about how many are missing, where known; when halving would cost more than a
    ``check`` per key, each key is checked on its own."""
    if expected is not None and 2 * expected * math.ceil(math.log2(max(2, len(keys)))) >= len(keys):
        return [key for key in keys if not store.check([key])]
    if not keys or store.check(keys):
        return []
    if len(keys) == 1:
        return list(keys)
    half = len(keys) // 2
    return missing_keys(store, keys[:half]) + missing_keys(store, keys[half:])


def read_join_requests(store: Store, replica: int, ranks: int) -> dict[int, int] | None:
    """rank -> incarnation of ``replica``'s ranks that asked to join, or None until every rank has."""
    keys = [GroupKeys.join_request(replica, r) for r in range(ranks)]
    if not store.check(keys):  # every key, one request
        return None
    return {r: int(v) for r, v in enumerate(store.multi_get(keys))}
