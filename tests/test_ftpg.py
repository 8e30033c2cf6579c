"""The fault-tolerant group: its contract and registry with a fake in-memory backend (fast), and the gloo backend on
real processes (no TorchTitan): errors instead of hangs, fast release."""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import weakref
from datetime import timedelta

import pytest
import torch
from torch.distributed import HashStore, TCPStore

from titan_recover.recover.ftpg.base import (
    backends,
    build_group,
    FaultDetected,
    FaultTolerantGroup,
    FTPGConfig,
    register_backend,
)
from titan_recover.recover.ftpg.gloo import broadcast_peers, close_connections, connected_first, PolledGlooGroup
from titan_recover.recover.ftpg.nccl import NcclGroup
from titan_recover.recover.ftpg.polled import batches_of, pieces_of, Progress
from titan_recover.recover.ftpg.staging import HostStaging
from titan_recover.recover.groups.keys import fault_time_and_reason, GroupKeys, raise_fault_flag
from titan_recover.recover.groups.member import wait_for_key
from titan_recover.recover.invariant.overlap import OverlappedReduction
from titan_recover.recover.invariant.reduction import Backup
from conftest import ROOT
from two_members import run_both

sys.path.insert(0, str(ROOT / "scripts"))
import thread_cpu  # noqa: E402  (the CPU of named threads, from /proc)


class _Room:
    """Where the members of one in-memory group meet: one slot per member and a barrier."""

    def __init__(self, size: int):
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)


@register_backend("in_memory")
class InMemoryGroup(FaultTolerantGroup):
    """A backend for members that are threads of one process: the whole of what adding a backend takes."""

    rooms: dict[tuple, _Room] = {}
    lock = threading.Lock()

    def __init__(self, store, *, config, epoch, members, replica, rank, timeout_s, device, on_poll=None,
                 fault_seen=None, tag=""):
        self.store, self.epoch, self.members, self.replica = store, epoch, members, replica
        self.timeout_s = timeout_s
        with self.lock:
            self.room = self.rooms.setdefault((id(store), GroupKeys.group_prefix(epoch, rank, tag)),
                                              _Room(len(members)))

    def _meet(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.room.slots[self.members.index(self.replica)] = tensor.clone()
        try:
            self.room.barrier.wait(self.timeout_s)
            seen = list(self.room.slots)
            self.room.barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            reason = f"replica {self.replica}: a member did not arrive within {self.timeout_s} s"
            raise_fault_flag(self.store, self.epoch, reason)
            raise FaultDetected(reason, raised_here=True) from None
        return seen

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        tensor.copy_(torch.stack(self._meet(tensor)).sum(0))

    def broadcast_many_(self, tensors, root_replica, on_each=None) -> None:
        for i, tensor in enumerate(tensors):
            tensor.copy_(self._meet(tensor)[self.members.index(root_replica)])
            if on_each is not None:
                on_each(i)


def _in_threads(fn, members):
    results: dict[int, object] = {}

    def run(replica):
        try:
            results[replica] = fn(replica)
        except Exception as error:  # handed to the test
            results[replica] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_a_backend_is_one_class_and_one_registration():
    """The fake backend above is registered by name and built through the factory like the built-in one."""
    assert "in_memory" in backends() and "gloo" in backends()
    store, members = HashStore(), (0, 1, 3)
    config = FTPGConfig(backend="in_memory")

    def member(replica):
        group = build_group(config, store, epoch=2, members=members, replica=replica, rank=0, timeout_s=5.0)
        assert isinstance(group, InMemoryGroup) and group.size == 3 and group.epoch == 2
        t = torch.full((4,), float(replica + 1))
        group.allreduce_sum_(t)
        b = [torch.full((2,), float(replica)), torch.full((3,), float(10 * replica))]
        done = []
        group.broadcast_many_(b, root_replica=3, on_each=done.append)
        one = torch.tensor([float(replica)])
        group.broadcast_(one, root_replica=1)
        return t.tolist(), [x.tolist() for x in b], done, one.item()

    results = _in_threads(member, members)
    for replica in members:
        assert results[replica] == ([7.0] * 4, [[3.0] * 2, [30.0] * 3], [0, 1], 1.0), results[replica]


def test_a_backend_reports_a_missing_member_as_a_fault():
    store = HashStore()
    config = FTPGConfig(backend="in_memory")

    def member(replica):
        group = build_group(config, store, epoch=0, members=(0, 1, 2), replica=replica, rank=1, timeout_s=0.3)
        group.allreduce_sum_(torch.ones(2))

    results = _in_threads(member, (0, 1))  # replica 2 never comes
    assert all(isinstance(results[r], FaultDetected) for r in (0, 1)), results
    assert "did not arrive" in fault_time_and_reason(store.get(GroupKeys.fault(0)))[1]


def test_a_flag_raised_while_gloo_waits_for_a_peer_that_never_came_is_seen_at_once(monkeypatch):
    """A broadcast to a peer lost before it built its group (a joiner that died): gloo waits on its own thread for
    the peer's address, up to the group's timeout. The flag raised meanwhile (by another client, 0.3 s in) ends
    the broadcast at the next poll, and the member's own store client answers meanwhile: gloo waits on a client of
    its own. On the member's client the flag was seen only at the group's timeout (20 s)."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client, other = (TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30)) for _ in range(2))
    group = PolledGlooGroup(client, config=FTPGConfig(), epoch=4, members=(0, 1), replica=0, rank=0, timeout_s=20.0)
    raising = threading.Timer(0.3, lambda: raise_fault_flag(other, 4, "replica 1 rank(s) [0]: no heartbeat"))
    raising.start()
    started = time.monotonic()
    try:
        with pytest.raises(FaultDetected, match="broadcast in epoch 4 abandoned: replica 1 rank.s. .0.: no heartbeat"):
            group.broadcast_(torch.ones(4), root_replica=0)
        assert time.monotonic() - started < 10.0  # half the group's timeout: its flag polls were answered
        client.set("still", "answering")
        assert client.get("still") == b"answering"
    finally:
        raising.join()
        # the peer comes after all, so that gloo's wait for it ends now and the group can go (not 20 s later)
        peer = PolledGlooGroup(other, config=FTPGConfig(), epoch=4, members=(0, 1), replica=1, rank=0, timeout_s=5.0)
        with contextlib.suppress(FaultDetected):  # it receives the abandoned broadcast, or the closing's error
            peer.broadcast_(torch.zeros(4), root_replica=0)
        for done in (group, peer):
            done.close()
            done.releasing.join(10)
            assert not done.releasing.is_alive()


def test_the_backend_is_checked_against_the_registry():
    with pytest.raises(ValueError, match=r"fault-tolerant group backend 'mpi' is not registered; registered: gloo, "
                                         r"in_memory, nccl"):
        FTPGConfig(backend="mpi")
    with pytest.raises(ValueError, match=r"backend = \"nccl\" needs CUDA tensors; this rank's device is cpu"):
        build_group(FTPGConfig(backend="nccl"), HashStore(), epoch=0, members=(0,), replica=0, rank=0, timeout_s=1.0)
    with pytest.raises(ValueError, match=r"recover.ftpg.poll_s must be > 0, got 0"):
        FTPGConfig(poll_s=0)
    with pytest.raises(ValueError, match=r"replica 4 is not a member of epoch 1 \(\(0, 1\)\)"):
        build_group(FTPGConfig(), HashStore(), epoch=1, members=(0, 1), replica=4, rank=0, timeout_s=1.0)


def test_auto_is_gloo_on_cpu_and_nccl_on_cuda_and_the_group_takes_its_config():
    assert FTPGConfig().backend == "auto"
    assert FTPGConfig().resolved_backend(torch.device("cuda", 3)) == "nccl"
    assert FTPGConfig().resolved_backend(torch.device("cpu")) == "gloo"
    assert FTPGConfig(backend="gloo").resolved_backend(torch.device("cuda")) == "gloo"
    store = HashStore()
    group = build_group(FTPGConfig(poll_s=0.05), store, epoch=0, members=(0,), replica=0, rank=0, timeout_s=5.0)
    assert isinstance(group, PolledGlooGroup) and group.config.poll_s == 0.05
    t = torch.arange(4.0)
    group.allreduce_sum_(t)  # one member: the sum is the tensor itself
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_raised_fault_flag_abandons_a_gloo_collective(monkeypatch):
    """A member that sees the epoch's flag gives up at once, without waiting for the collective or its deadline:
    at its first poll (counted, not timed). A group that did not look at the flag while it waits, or looked only
    at its deadline, polls on for ``timeout_s`` and fails this."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")  # as the launcher sets it: the peer never connects
    store = HashStore()
    raise_fault_flag(store, 0, "replica 1: no heartbeat")
    polls = []
    # the timeout bounds gloo's pending operation, which the group's destructor waits for when a later test's
    # garbage collection frees it (a run closes a failed group's connections first: ftpg/gloo.py)
    group = build_group(FTPGConfig(), store, epoch=0, members=(0, 1), replica=0, rank=0, timeout_s=1.0,
                        on_poll=lambda: polls.append(1))
    with pytest.raises(FaultDetected, match="allreduce in epoch 0 abandoned: replica 1: no heartbeat") as fault:
        group.allreduce_sum_(torch.ones(2))  # replica 1 never joins
    assert not fault.value.raised_here and len(polls) == 1


SURVIVOR_TIMEOUT_S = 20.0
"""The survivors' collective timeout: a release by the deadline (or gloo's own timeout) would take this long."""


def _member(port: int, replica: int, members: tuple, victim: int, mode: str, results):
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    polls: list[float] = []
    second = []  # non-empty during the second collective

    def on_poll():  # the wall time of every look at the flag; the first one says "waiting inside the collective"
        polls.append(time.time())
        if second == [True]:
            second.append(True)
            store.add("waiting", 1)

    group = build_group(FTPGConfig(), store, epoch=0, members=members, replica=replica, rank=0,
                        timeout_s=SURVIVOR_TIMEOUT_S, on_poll=on_poll)
    t = torch.full((1024,), float(replica + 1))
    group.allreduce_sum_(t)  # a healthy round first
    store.add("round1", 1)
    while int(store.add("round1", 0)) < len(members):
        time.sleep(0.01)
    if replica == victim:
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    polls.clear()
    second.append(True)
    start = time.monotonic()
    try:
        group.allreduce_sum_(t)
        results.put((replica, "completed", time.monotonic() - start, "", False, time.time(), polls[-50:]))
    except FaultDetected as fault:
        results.put((replica, "fault", time.monotonic() - start, fault.reason, fault.raised_here, time.time(),
                     polls[-50:]))


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_survivors_are_released_quickly(mode):
    """Four gloo members after a healthy round; replica 2 is killed (its neighbours get gloo's error and raise the
    flag) or stopped (nobody gets an error: the flag is raised as the coordinator would). Every survivor ends with
    an error, not a hang, and is released by the fault, not by its 20 s deadline: a survivor that was not raised
    the flag itself makes at most one poll after the flag is in the store (the first look after it releases it).
    Compared within the run (each poll's time against when the flag was known to be stored), so no bound depends
    on how busy the machine is. A group that ignored the flag, or polled it rarely, fails the count; one that
    waited for its deadline fails the reasons."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    members, victim = (0, 1, 2, 3), 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(store.port, r, members, victim, mode, results)) for r in members]
    for p in procs:
        p.start()
    flag_stored = None
    try:
        # the fault comes after a healthy round of all four (starting four processes that import torch takes tens
        # of seconds on a loaded host); the 180 s only guard against a member that never starts
        deadline = time.monotonic() + 180
        while int(store.add("round1", 0)) < len(members):
            assert time.monotonic() < deadline, "the members did not finish their healthy round within 180 s"
            time.sleep(0.01)
        if mode == "hang":
            # nobody gets a gloo error from a stopped peer: the coordinator's verdict raises the flag, here once
            # every survivor is waiting inside the second collective (it polled at least once)
            while int(store.add("waiting", 0)) < len(members) - 1:
                assert time.monotonic() < deadline, "the survivors did not start waiting"
                time.sleep(0.01)
            store.compare_set("fault/e0", "", f"{time.time()}|replica {victim}: no heartbeat")
            flag_stored = time.time()  # the flag is in the store from here on
        got = [results.get(timeout=3 * SURVIVOR_TIMEOUT_S) for _ in range(len(members) - 1)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    assert sorted(r for r, *_ in got) == [0, 1, 3]
    assert all(outcome == "fault" for _, outcome, *_ in got), got  # an error, not a hang
    # released by the fault: nobody's reason is a deadline, ours or gloo's, and nobody waited as long as one
    assert not [g for g in got if "no progress" in g[3] or "Timed out" in g[3]], got
    assert all(elapsed < SURVIVOR_TIMEOUT_S for _, _, elapsed, *_ in got), got
    raisers = [g for g in got if g[4]]
    if mode == "hang":
        assert raisers == [] and all("abandoned: replica 2: no heartbeat" in g[3] for g in got), got
    else:
        # a neighbour of the killed member gets gloo's error and raises the flag; its call returned only after the
        # flag was stored, so the flag is in the store from the first raiser's release on
        assert raisers and all("failed" in g[3] for g in raisers), got
        flag_stored = min(g[5] for g in raisers)
    raised_at, _ = fault_time_and_reason(store.get("fault/e0"))  # the first failure raised the flag for everyone
    for replica, _, _, reason, raised_here, released, polls in got:
        if not raised_here:
            assert "abandoned" in reason and released >= raised_at, (replica, reason, "released before the flag")
            late = [t for t in polls if t > flag_stored]
            assert len(late) <= 1, (replica, len(late), "polls after the flag was stored")


# ---- pieces, the progress deadline, host staging (gloo members as threads of one process) -------------------
def test_small_tensors_are_batched_only_with_their_own_dtype():
    """gloo's coalesced all-reduce refuses a mix of dtypes (a float64 accumulation beside float32 parts)."""
    tensors = [torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    pieces = pieces_of(tensors, chunk_bytes=1024)
    batches = batches_of(pieces, tensors, chunk_bytes=1024, small_bytes=512)
    assert [[n for n, _ in batch] for batch in batches] == [[0, 1], [2], [3]]


def test_a_collective_is_split_into_pieces_of_at_most_chunk_bytes_in_order():
    a, b, empty = torch.arange(10.0), torch.arange(3, dtype=torch.float64), torch.zeros(0)
    pieces = pieces_of([a, empty, b], chunk_bytes=16)  # 4 floats or 2 doubles a piece
    assert [(i, start, v.tolist()) for i, start, v in pieces] == [
        (0, 0, [0.0, 1.0, 2.0, 3.0]), (0, 4, [4.0, 5.0, 6.0, 7.0]), (0, 8, [8.0, 9.0]), (2, 0, [0.0, 1.0]),
        (2, 2, [2.0])]
    assert all(v.data_ptr() == a.view(-1)[4 * k].data_ptr() for k, (_, _, v) in enumerate(pieces[:3]))  # views
    with pytest.raises(ValueError, match="tensor 0 of a collective is not contiguous"):
        pieces_of([torch.zeros(4, 4).t()], 16)


def test_the_deadline_follows_progress_not_the_whole_collective():
    now = [0.0]
    progress = Progress(2.0, clock=lambda: now[0])
    for _ in range(5):  # 10 s in all, never 2 s without a piece completing
        now[0] += 1.9
        assert not progress.expired()
        progress.advanced()
    now[0] += 2.1
    assert progress.expired() and progress.pieces == 5


def _gloo_pair(store, config, timeout_s, cls=PolledGlooGroup):
    return [cls(store, config=config, epoch=0, members=(0, 1), replica=r, rank=0, timeout_s=timeout_s)
            for r in (0, 1)]


class _SlowLink(PolledGlooGroup):
    """A member behind a slow link: each piece leaves after ``bytes / rate`` seconds (20 MiB/s), or as soon as the
    epoch's fault flag is up (its peer gave up: what it sends next fails at once, as on a real link)."""

    def _issue(self, i, batch, root, staging):
        leaves = time.monotonic() + sum(v.numel() * v.element_size() for _, (_, _, v) in batch) / (20 * 2**20)
        while time.monotonic() < leaves and not self.store.check([GroupKeys.fault(self.epoch)]):
            time.sleep(0.01)
        return super()._issue(i, batch, root, staging)


def test_a_big_reduction_on_a_slow_link_outlasts_the_timeout_while_it_makes_progress(monkeypatch):
    """25 MiB over a 20 MiB/s link take 1.25 s, 2.5 times ``timeout_s``: as one piece (the old fixed bound for
    the whole collective) the reduction fails; in pieces of 1 MiB (0.05 s each, a tenth of the bound) it
    succeeds."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    n, timeout_s = 25 * 2**20 // 4, 0.5  # float32 elements

    def reduce(chunk_mb):
        store, config = HashStore(), FTPGConfig(chunk_mb=chunk_mb, in_flight=1)
        fast = PolledGlooGroup(store, config=config, epoch=0, members=(0, 1), replica=0, rank=0, timeout_s=timeout_s)
        slow = _SlowLink(store, config=config, epoch=0, members=(0, 1), replica=1, rank=0, timeout_s=60.0)
        tensors = [torch.full((n,), 1.0), torch.full((n,), 2.0)]
        results, elapsed = run_both(lambda: fast.allreduce_sum_(tensors[0]), lambda: slow.allreduce_sum_(tensors[1]))
        return results, elapsed, tensors

    # Both members live in this process, so a pause of its garbage collector (a large heap late in the suite, the
    # first round's failure cycles) stalls both and counts against a 1 s bound it has nothing to do with: measured
    # in the fast tier, gloo's own 1000 ms recv timeout fired on a 1 MiB piece. Collected before, paused during.
    gc.collect()
    gc.disable()
    try:
        results, _, _ = reduce(chunk_mb=1024)
        # our deadline or gloo's own per-operation timeout, whichever looks first: both are the bound of one piece
        assert isinstance(results[0], FaultDetected), results
        assert "made no progress for 0.5 s" in results[0].reason or "Timed out waiting 500ms" in results[0].reason
        del results
        gc.collect()
        results, elapsed, tensors = reduce(chunk_mb=1)
    finally:
        gc.enable()
    assert results == {0: None, 1: None}, results
    assert elapsed > 2 * timeout_s  # far longer than the old bound, and it succeeded
    assert all(bool((t == 3.0).all()) for t in tensors)


def _loop_threads() -> set[str]:
    """The ids of this process's gloo event-loop threads (one per gloo group)."""
    return set(thread_cpu.threads_named("self", "gloo_tcp_loop"))


def _cpu_s(tids: set[str]) -> float:
    """User and kernel CPU seconds the threads ``tids`` of this process have used."""
    return sum(sum(thread_cpu.cpu_s(f"/proc/self/task/{tid}/stat")) for tid in tids)


def _connected_gloo_pair(monkeypatch) -> tuple[list[PolledGlooGroup], set[str]]:
    """Two gloo members (threads of this process) after a healthy all-reduce, and their event loops' thread ids."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    before = _loop_threads()
    groups = _gloo_pair(HashStore(), FTPGConfig(), timeout_s=30.0)
    results, _ = run_both(lambda: groups[0].allreduce_sum_(torch.ones(4)),
                          lambda: groups[1].allreduce_sum_(torch.ones(4)))
    assert results == {0: None, 1: None}, results
    return groups, _loop_threads() - before


def test_a_failed_gloo_group_polls_no_data_left_for_a_receive_it_abandoned(monkeypatch):
    """What a failed collective can leave behind, made on purpose: member 0 posts a receive and drops it (as an
    operation that failed on another connection does), then member 1 sends. gloo has nowhere to put the data and
    leaves it unread, and its event loop polls it without pause (measured here first, in the same run: the
    precondition). Once member 0's group has failed and closed its connections, its loop is idle. A group that kept
    its connections (the code before) spins on: the second measurement fails."""
    groups, loops = _connected_gloo_pair(monkeypatch)
    work = groups[0].pg.recv([torch.empty(1 << 16)], 1, 5)
    del work  # the receive's buffer is gone; gloo's record of the posted receive remains
    groups[1].pg.send([torch.ones(1 << 16)], 0, 5).wait(timedelta(seconds=30))
    window_s = 0.5
    start = _cpu_s(loops)
    time.sleep(window_s)
    spinning = _cpu_s(loops) - start
    assert spinning > 0.2 * window_s, f"the precondition: gloo's loop did not spin ({spinning:.2f} s CPU)"

    groups[0]._fail()
    groups[0]._disconnect()
    groups[0].closing.join(10)
    assert not groups[0].closing.is_alive()
    start = _cpu_s(loops)
    time.sleep(window_s)
    after = _cpu_s(loops) - start
    assert after <= 0.03, f"gloo's loops used {after:.2f} s CPU in {window_s} s after the group closed"


def test_closing_a_failed_gloo_group_fails_what_is_pending_on_it_at_once(monkeypatch):
    """``ProcessGroupGloo.abort`` leaves a pending operation to gloo's timeout (here 30 s): closing the group's
    connections fails it at once, and the member whose collective gets a closed connection after the epoch's flag
    is up reports the flag's reason, not the closed connection as a fault of its own."""
    groups, _ = _connected_gloo_pair(monkeypatch)
    pending = groups[0].pg.allreduce([torch.ones(4)])  # member 1 never joins
    groups[0].pg.abort()
    time.sleep(0.2)
    assert not pending.is_completed()  # abort() released nothing (why the group closes its connections instead)
    start = time.monotonic()
    raise_fault_flag(groups[0].store, 0, "replica 1: no heartbeat")
    with pytest.raises(FaultDetected, match="abandoned: replica 1: no heartbeat"):
        groups[0].allreduce_sum_(torch.ones(4))
    with pytest.raises(RuntimeError, match="Application timeout caused pair closure"):
        pending.wait()
    assert time.monotonic() - start < 10.0  # not gloo's 30 s
    with pytest.raises(FaultDetected, match=r"abandoned: replica 1: no heartbeat \(here: replica 1 rank 0: allreduce in epoch 0 failed"):
        groups[1].allreduce_sum_(torch.ones(4))  # its connection to member 0 is closed


def test_closing_reads_gloos_timeout_and_leaves_nothing_open(monkeypatch):
    """``close_connections`` stops at the receive gloo timed out, told by gloo's message (a torch whose gloo words
    it differently fails here); a second call finds every connection closed."""
    groups, _ = _connected_gloo_pair(monkeypatch)
    assert close_connections(groups[0].pg, [1]) == 1
    assert close_connections(groups[0].pg, [1]) is None


def test_a_gloo_group_is_closed_through_the_peers_its_collectives_connected_first():
    """A receive from a peer gloo never connected (lazy initialisation) waits for gloo's timeout, so the peers an
    all-reduce (gloo's ring: left, right) or a broadcast (gloo's tree: parent, children) connected come first."""
    assert connected_first(0, 4, reduced=True) == [3, 1, 2]
    assert connected_first(2, 4, reduced=True) == [1, 3, 0]
    assert connected_first(1, 2, reduced=True) == [0]
    assert connected_first(0, 1, reduced=True) == []
    assert connected_first(3, 4, reduced=False, roots=[0]) == [1, 0, 2]  # not its ring neighbour 2: never connected
    assert connected_first(3, 4, reduced=True, roots=[0]) == [2, 0, 1]


@pytest.mark.parametrize("size", range(1, 10))
def test_broadcast_peers_make_gloos_tree_from_every_root(size):
    """The tree :func:`broadcast_peers` describes: every member but the root receives from exactly one parent, the
    relation is mutual (a parent lists the member as its child), and it reaches every member from the root."""
    for root in range(size):
        peers = {rank: broadcast_peers(rank, size, root) for rank in range(size)}
        parent = {}
        for rank in range(size):
            vrank = (rank - root) % size
            receives = [p for p in peers[rank] if (p - root) % size < vrank]
            assert len(receives) == (rank != root), (size, root, rank, peers[rank])
            if receives:
                assert peers[rank][0] == receives[0]  # the parent first
                parent[rank] = receives[0]
                assert rank in peers[receives[0]]
        reached = {root}
        while True:
            more = {rank for rank, p in parent.items() if p in reached} - reached
            if not more:
                break
            reached |= more
        assert reached == set(range(size))
    assert broadcast_peers(3, 4, 0) == [1] and broadcast_peers(0, 4, 0) == [1, 2] and broadcast_peers(2, 3, 0) == [0]


def test_a_failed_broadcast_group_of_four_closes_through_its_tree_parent_at_once(monkeypatch):
    """Four members (threads of this process), a state transfer's group: only broadcasts from member 0, so member 3
    is connected to its tree parent, member 1, and not to its ring neighbour 2. Member 2 is lost; when member 3's
    next broadcast fails, its connections close at once: through member 1, not after trying to connect to the lost
    member 2 until gloo's timeout (here 30 s)."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    store, members = HashStore(), (0, 1, 2, 3)
    groups = [PolledGlooGroup(store, config=FTPGConfig(), epoch=0, members=members, replica=r, rank=0,
                              timeout_s=30.0, tag="transfer") for r in members]
    tensors = [torch.full((4,), float(r)) for r in members]
    results: dict[int, object] = {}

    def broadcast(r):
        try:
            groups[r].broadcast_(tensors[r], root_replica=0)
            results[r] = None
        except Exception as error:  # handed to the test
            results[r] = error

    threads = [threading.Thread(target=broadcast, args=(r,), daemon=True) for r in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {r: None for r in members} and all(bool((t == 0.0).all()) for t in tensors), results
    groups[2].close()  # member 2 is lost: nothing answers a connection to it any more
    groups[2].releasing.join(30)
    raise_fault_flag(store, 0, "replica 2: lost during the transfer")
    with pytest.raises(FaultDetected, match="lost during the transfer"):
        groups[3].broadcast_(tensors[3], root_replica=0)  # member 1 never forwards
    groups[3].closing.join(10)
    assert not groups[3].closing.is_alive()  # closed through member 1, not still connecting to member 2
    for group in groups:
        group.close()
        if group.releasing is not None:
            group.releasing.join(30)


def _sockets() -> int:
    """Sockets this process holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def _reduce_and_close(groups: list[PolledGlooGroup], fail: bool) -> None:
    """One epoch of a two-member pair: an all-reduce (checked), then, if ``fail``, a fault of the epoch (member 0's
    next collective fails and closes its connections), then both members close the group; returns once both are
    destroyed."""
    results, _ = run_both(lambda: groups[0].allreduce_sum_(torch.ones(4)),
                          lambda: groups[1].allreduce_sum_(torch.full((4,), 2.0)))
    assert results == {0: None, 1: None}, results
    if fail:  # member 0 sees the flag while it waits for member 1, which never comes
        raise_fault_flag(groups[0].store, groups[0].epoch, "replica 1: no heartbeat")
        with pytest.raises(FaultDetected, match="no heartbeat"):
            groups[0].allreduce_sum_(torch.ones(4))
        assert groups[0].closing is not None
    for group in groups:
        group.close()
        assert group.pg is None and group.failed
        group.releasing.join(30)
        assert not group.releasing.is_alive()


def test_gloo_groups_closed_epoch_after_epoch_leave_no_threads_or_sockets_behind(monkeypatch):
    """A gloo group kept after its epoch holds its event loop, its worker threads and its sockets (measured first, as
    the precondition: the check below would see a kept group). Closed, healthy or failed, it holds none: six epochs
    in turn leave this process as many gloo loops and sockets as before."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    store = HashStore()

    def pair(epoch):
        return [PolledGlooGroup(store, config=FTPGConfig(), epoch=epoch, members=(0, 1), replica=r, rank=0,
                                timeout_s=30.0) for r in (0, 1)]

    loops, sockets = _loop_threads(), _sockets()
    kept = pair(0)
    results, _ = run_both(lambda: kept[0].allreduce_sum_(torch.ones(4)), lambda: kept[1].allreduce_sum_(torch.ones(4)))
    assert results == {0: None, 1: None}, results
    assert len(_loop_threads() - loops) == 2 and _sockets() >= sockets + 2  # the precondition: what a kept pair holds
    for group in kept:
        group.close()
        group.releasing.join(30)
    for epoch in range(1, 7):
        _reduce_and_close(pair(epoch), fail=epoch % 2 == 0)
    assert _loop_threads() - loops == set()
    assert _sockets() <= sockets


def test_a_healthy_gloo_group_closed_at_once_after_its_last_collective_leaves_its_peer_every_byte(monkeypatch):
    """The root of a 64 MiB broadcast closes its group as soon as its broadcast returns, while the peer posts its
    receive 0.3 s late: the peer receives every byte (the destructor closes a connection softly, delivering what
    was sent)."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    groups = _gloo_pair(HashStore(), FTPGConfig(), timeout_s=30.0)
    source, target = torch.randn(16 * 2**20), torch.zeros(16 * 2**20)

    def root():
        groups[0].broadcast_(source, root_replica=0)
        groups[0].close()

    def late_peer():
        time.sleep(0.3)
        groups[1].broadcast_(target, root_replica=0)

    results, _ = run_both(root, late_peer)
    assert results == {0: None, 1: None}, results
    assert torch.equal(source, target)
    groups[1].close()
    for group in groups:
        group.releasing.join(30)
        assert not group.releasing.is_alive()


class _StagedGloo(PolledGlooGroup):
    """Stages host tensors as it stages device ones (the ring of pinned chunks, without a device to copy from)."""

    def _staging_for(self, tensors):
        self._staging = HostStaging(torch.device("cpu"), self.config.chunk_bytes, self.config.in_flight + 1)
        return self._staging


class _StagedRecording(_StagedGloo):
    ended = 0

    def _staging_for(self, tensors):
        staging = super()._staging_for(tensors)
        group = self

        class Recording(type(staging)):
            def end(self):
                group.ended += 1
                super().end()

        staging.__class__ = Recording
        return staging


def test_a_failed_staged_collective_still_orders_the_callers_stream_after_its_copies(monkeypatch):
    """The copies back already queued when a staged collective fails must be waited for by whatever the caller
    does next with its tensors (a restore, a recompute): ``end`` runs on failure too."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    store = HashStore()
    raise_fault_flag(store, 0, "replica 1 lost")
    # a short timeout: gloo's pending connect to the peer that never comes ends with it, not at the group's teardown
    member = _StagedRecording(store, config=FTPGConfig(chunk_mb=64 / 2**20, poll_s=0.01), epoch=0, members=(0, 1),
                              replica=0, rank=0, timeout_s=0.5)
    with pytest.raises(FaultDetected, match="replica 1 lost"):
        member.allreduce_sum_(torch.ones(100))
    assert member.ended == 1


def test_staged_pieces_go_through_a_bounded_ring_and_come_back_whole(monkeypatch):
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    config = FTPGConfig(chunk_mb=64 / 2**20, in_flight=2)  # 64-byte pieces: 16 floats
    members = _gloo_pair(HashStore(), config, 10.0, cls=_StagedGloo)
    grads = [torch.arange(100.0) + r for r in (0, 1)]
    results, _ = run_both(lambda: members[0].allreduce_sum_(grads[0]), lambda: members[1].allreduce_sum_(grads[1]))
    assert results == {0: None, 1: None}
    assert grads[0].tolist() == grads[1].tolist() == (2 * torch.arange(100.0) + 1).tolist()
    assert sum(b is not None for b in members[0]._staging._buffers) == 3  # in_flight + 1 slots, reused
    states = [[torch.full((40,), float(r)), torch.arange(5, dtype=torch.float64) * (r + 1)] for r in (0, 1)]
    seen = {0: [], 1: []}
    results, _ = run_both(lambda: members[0].broadcast_many_(states[0], 1, seen[0].append),
                       lambda: members[1].broadcast_many_(states[1], 1, seen[1].append))
    assert results == {0: None, 1: None} and seen == {0: [0, 1], 1: [0, 1]}
    assert states[0][0].tolist() == [1.0] * 40 and states[0][1].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


# ---- the nccl backend against a fake communicator -------------------------------------------------------------
class _FakeWork:
    def __init__(self, comm, tensor):
        self.comm, self.tensor, self.completed = comm, tensor, False
        self.error: Exception | None = None

    def is_completed(self) -> bool:
        if self.comm.aborted:
            raise RuntimeError("NCCL communicator was aborted")
        return self.completed or self.error is not None  # as NCCL's: complete once it failed

    def exception(self):
        return self.error

    def wait(self) -> bool:
        if self.error is not None:  # torch's WorkNCCL::wait: the communicator aborted on the waiting thread first
            self.comm.aborted_inline = True
            raise self.error
        return True


class _FakeCommunicator:
    """Records what the group does; its pieces complete when the test says so (``auto``: at once, doubled)."""

    made: list = []

    def __init__(self, prefix: str, auto: bool):
        self.prefix, self.auto = prefix, auto
        self.works: list[_FakeWork] = []
        self.aborted = self.aborted_inline = False
        self.made.append(self)

    def allreduce(self, tensors, opts):
        work = _FakeWork(self, tensors[0])
        if self.auto:
            tensors[0].mul_(2)  # two members holding the same values
            work.completed = True
        self.works.append(work)
        return work

    def broadcast(self, tensors, opts):
        work = _FakeWork(self, tensors[0])
        work.completed = self.auto
        self.works.append(work)
        return work

    def abort(self) -> None:
        self.aborted = True


class _GatedCommunicator(_FakeCommunicator):
    """Its abort returns only once ``gate`` is set (an idle NCCL communicator's took 1.0 s on an H200)."""

    def __init__(self, prefix: str, auto: bool, gate: threading.Event):
        super().__init__(prefix, auto)
        self.gate = gate

    def abort(self) -> None:
        self.gate.wait(10)
        super().abort()


class _FakeNccl(NcclGroup):
    auto = True
    communicator = _FakeCommunicator
    """Makes the group's communicator from (prefix, auto)."""

    def __init__(self, store, **kwargs):
        kwargs["device"] = torch.device("cuda", 0)  # the fake never touches the device
        super().__init__(store, **kwargs)
        self.device = torch.device("cpu")  # its "device" tensors are host tensors

    def _connect(self, store, group_rank, size):
        self.communicators.append(self.communicator(GroupKeys.group_prefix(self.epoch, self.rank, self.tag), self.auto))
        return self.communicators[-1]

    @property
    def communicators(self) -> list:
        """Every communicator this group made (the group itself lets an aborted one go)."""
        return self.__dict__.setdefault("_communicators", [])


def _fake_nccl(epoch=0, timeout_s=5.0, auto=True, chunk_mb=16 / 2**20, communicator=_FakeCommunicator):
    cls = type("_Fake", (_FakeNccl,), {"auto": auto, "communicator": communicator})
    return cls(HashStore(), config=FTPGConfig(chunk_mb=chunk_mb, poll_s=0.01), epoch=epoch, members=(0, 1),
               replica=0, rank=2, timeout_s=timeout_s)


def test_nccl_connects_each_epoch_at_its_first_collective_and_issues_every_piece_there():
    gate = threading.Event()
    first = _fake_nccl(epoch=0, communicator=functools.partial(_GatedCommunicator, gate=gate))
    second = _fake_nccl(epoch=1)
    assert first.pg is None and second.pg is None  # connected inside the first collective's guard
    t = torch.arange(40.0)  # 10 pieces of 16 bytes
    first.allreduce_sum_(t)
    assert t.tolist() == (2 * torch.arange(40.0)).tolist() and len(first.pg.works) == 10
    second.allreduce_sum_(torch.ones(4))
    assert first.pg is not second.pg and (first.pg.prefix, second.pg.prefix) == ("ftpg/e0/p2", "ftpg/e1/p2")
    assert len(second.pg.works) == 1  # the next epoch's communicator is its own
    # the next epoch's group exists: the previous communicator is aborted, let go, never used again; the abort (1 s
    # on an H200, docs/platform.md) runs off the caller's thread, which close() does not wait for
    first.close()
    assert first.pg is None and not first.communicators[0].aborted
    gate.set()
    deadline = time.monotonic() + 10
    while not first.communicators[0].aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.communicators[0].aborted and not second.pg.aborted
    with pytest.raises(FaultDetected, match="failed group"):
        first.allreduce_sum_(torch.ones(4))


def test_a_flag_raised_while_nccl_waits_for_a_root_that_never_came_is_seen_at_once():
    """A non-root rank builds its communicator by waiting in the store for the root's unique id (NCCL's own
    exchange: a blocking ``get``, up to the store's timeout); the root is a joiner of a lower replica that died
    before it built its group. The flag raised meanwhile (by another client, 0.3 s in) ends the collective at the
    next poll, the member's own store client answers meanwhile, and the communicator that arrives later (the root
    came after all) is aborted and let go by the connecting thread. Without the connection on a thread of its own
    (and a store client of its own) the flag was seen only at the store's timeout (30 s)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client, other = (TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30)) for _ in range(2))

    class WaitsForTheRoot(_FakeNccl):
        def _connect(self, store, group_rank, size):
            assert group_rank == 1
            store.get("unique_id")  # as NCCL's non-root ranks do
            return super()._connect(store, group_rank, size)

    group = WaitsForTheRoot(client, config=FTPGConfig(chunk_mb=16 / 2**20, poll_s=0.01), epoch=4, members=(0, 1),
                            replica=1, rank=0, timeout_s=20.0)
    raising = threading.Timer(0.3, lambda: raise_fault_flag(other, 4, "replica 0 rank(s) [0]: no heartbeat"))
    raising.start()
    started = time.monotonic()
    try:
        with pytest.raises(FaultDetected, match=r"allreduce \(connecting\) in epoch 4 abandoned: replica 0 rank.s. "
                                                r".0.: no heartbeat"):
            group.allreduce_sum_(torch.ones(4))
        assert time.monotonic() - started < 10.0  # half the group's timeout: its flag polls were answered
        client.set("still", "answering")
        assert client.get("still") == b"answering"
    finally:
        raising.join()
    other.set(GroupKeys.group_prefix(4, 0) + "/unique_id", "from the root")  # it came after all
    deadline = time.monotonic() + 10
    while not (group.communicators and group.communicators[0].aborted) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group.communicators[0].aborted and group.pg is None  # the failed group's late communicator let go


def test_a_broadcasts_callback_reads_each_tensor_only_after_the_stream_finished_its_last_piece(monkeypatch):
    """NCCL's pieces complete on the device; ``on_each(i)`` reads tensor ``i`` on the host (a state transfer
    hashes it), so the caller's stream is synchronized once tensor ``i``'s last piece completed, before the
    callback, and once per tensor, not per piece."""
    from titan_recover.recover.ftpg import nccl

    log = []
    monkeypatch.setattr(nccl, "synchronize", lambda device: log.append("synchronize"))
    group = _fake_nccl()  # 16-byte pieces
    tensors = [torch.arange(8.0), torch.arange(2.0), torch.arange(4.0)]  # 2, 1 and 1 pieces
    group.broadcast_many_(tensors, root_replica=0, on_each=log.append)
    assert len(group.pg.works) == 4
    assert log == ["synchronize", 0, "synchronize", 1, "synchronize", 2]


def test_the_nccl_communicator_is_left_to_the_group_not_to_nccls_watchdog_and_held_only_once_ready(monkeypatch):
    """The real ``_connect`` against a stand-in ``ProcessGroupNCCL``: built with asynchronous error handling off
    (an error on a piece fails the piece; NCCL's watchdog does not end the process), the process's own setting
    restored after, non-blocking, with a watchdog timeout far behind any progress deadline, connected eagerly, its
    first collective through (a non-blocking communicator's initialisation completes at its first use), and only
    then returned for the group to hold; a failure on the way aborts it there."""
    import torch.distributed as dist

    from titan_recover.recover.ftpg import nccl

    seen = {}

    class Options:
        def __init__(self):
            self.config = type("Config", (), {})()
            self._timeout = None

    class StandIn:
        def __init__(self, store, rank, size, options):
            seen.update(handling=os.environ.get(nccl.ASYNC_ERROR_HANDLING_ENV), rank=rank, size=size,
                        blocking=options.config.blocking, timeout=options._timeout, calls=[])

        def eager_connect_single_device(self, device):
            seen["calls"].append(("connect", device))

        def abort(self):
            seen["calls"].append("abort")

    StandIn.Options = Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandIn, raising=False)
    monkeypatch.setattr(nccl, "bind_thread", lambda device: seen.setdefault("bound", device))
    monkeypatch.setenv(nccl.ASYNC_ERROR_HANDLING_ENV, "3")
    group = nccl.NcclGroup.__new__(nccl.NcclGroup)
    group.timeout_s, group.device = 30.0, torch.device("cuda", 1)
    group._first_collective = lambda pg: seen["calls"].append("first collective")
    pg = group._connect(HashStore(), 1, 2)
    assert isinstance(pg, StandIn) and not hasattr(group, "pg")  # the caller holds it once it is ready
    assert seen == {"handling": "0", "rank": 1, "size": 2, "blocking": False, "timeout": nccl.WATCHDOG,
                    "calls": [("connect", torch.device("cuda", 1)), "first collective"],
                    "bound": torch.device("cuda", 1)}
    assert os.environ[nccl.ASYNC_ERROR_HANDLING_ENV] == "3"
    assert nccl.WATCHDOG.total_seconds() > 1000 * group.timeout_s

    def lost(pg):
        raise RuntimeError("NCCL error: remote process exited (a peer lost while it connected)")

    made = []
    group._first_collective = lambda pg: made.append(weakref.ref(pg)) or lost(pg)
    with pytest.raises(RuntimeError, match="a peer lost while it connected") as failure:
        group._connect(HashStore(), 1, 2)
    assert seen["calls"] == [("connect", torch.device("cuda", 1)), "abort"]  # aborted on the connecting thread
    assert made[0]() is None and failure.value is not None  # destroyed there: the traceback holds it no more


def test_a_communicators_first_collective_is_waited_for_within_the_timeout_and_its_error_raised_without_wait():
    """``_first_collective`` (CPU tensors stand in for the device's): one all-reduce of one element; returns once
    it completed; raises its error without calling its ``wait()`` (torch's aborts inline); and a piece that never
    completes fails after the group's timeout rather than holding the connecting thread."""
    group = _fake_nccl(timeout_s=0.2)
    group.device = torch.device("cpu")
    done = _FakeCommunicator("done", auto=True)
    group._first_collective(done)
    assert [w.tensor.numel() for w in done.works] == [1]
    broken = _BrokenCommunicator("broken")
    with pytest.raises(RuntimeError, match="a NCCL piece failed: NCCL error: remote process exited"):
        group._first_collective(broken)
    assert not broken.aborted_inline
    with pytest.raises(TimeoutError, match="first collective did not complete in 0.2 s"):
        group._first_collective(_FakeCommunicator("stuck", auto=False))


def test_a_torch_that_cannot_say_a_pieces_error_leaves_it_to_wait():
    """``Work.exception`` is deprecated in torch: without it, or where it is no longer implemented, a completed piece
    is not taken for a failed one (its ``wait()`` raises a real error, as before); an error it cannot hand over is."""
    from titan_recover.recover.ftpg.nccl import _raise_if_failed

    class Gone:
        pass

    class NotImplementedAnyMore:
        def exception(self):
            raise NotImplementedError("WorkNCCL::exception() is deprecated")

    class Unreadable:
        def exception(self):
            raise TypeError("unable to convert the exception")

    _raise_if_failed(Gone())
    _raise_if_failed(NotImplementedAnyMore())
    with pytest.raises(RuntimeError, match="a NCCL piece failed: unable to convert"):
        _raise_if_failed(Unreadable())


class _LostStore(HashStore):
    """A store that refuses the fault flag (the job's store went down with the peer)."""

    def compare_set(self, *args):
        raise RuntimeError("connection reset by peer")

    def set(self, *args):
        raise RuntimeError("connection reset by peer")


class _BrokenCommunicator(_FakeCommunicator):
    """A communicator whose pieces fail (a peer's connection reset), as NCCL reports it without its watchdog: the
    piece is complete, with an error, and its ``wait()`` would abort the communicator inline before raising."""

    def __init__(self, prefix: str, auto: bool = False):
        super().__init__(prefix, auto=False)

    def allreduce(self, tensors, opts):
        work = super().allreduce(tensors, opts)
        work.error = RuntimeError("NCCL error: remote process exited or there was a network error (peer gone)")
        return work


class _FlagAwaitingCommunicator(_BrokenCommunicator):
    """Its pieces fail; its abort returns once the epoch's fault flag is in ``store`` (or after 5 s, when it never
    comes), noting which in ``seen``."""

    def __init__(self, prefix: str, auto: bool, store, seen: list):
        super().__init__(prefix)
        self.store, self.seen = store, seen

    def abort(self) -> None:
        self.seen.append(wait_for_key(self.store, GroupKeys.fault(0), 5.0))
        super().abort()


def test_a_failed_piece_aborts_the_communicator_even_when_the_flag_cannot_be_raised():
    group = _fake_nccl(auto=False, communicator=_BrokenCommunicator)
    group.store = _LostStore()
    with pytest.raises(FaultDetected) as fault:
        group.allreduce_sum_(torch.ones(4))
    assert fault.value.raised_here and group.failed and group.communicators and _FakeCommunicator.made[-1].aborted
    assert "peer gone" in fault.value.reason and "raising the epoch's fault flag failed" in fault.value.reason


def test_a_failed_piece_raises_the_flag_while_the_communicator_aborts():
    """NCCL's abort took 1.0 s on an H200, more while device work queued before the collective ran
    (docs/platform.md): the flag that tells the other members does not wait for it, and the collective returns only
    once the abort did (its kernels may write into the tensor until then)."""
    seen, store = [], HashStore()
    group = _fake_nccl(auto=False, communicator=functools.partial(_FlagAwaitingCommunicator, store=store, seen=seen))
    group.store = store
    with pytest.raises(FaultDetected, match="peer gone") as fault:
        group.allreduce_sum_(torch.ones(4))
    assert fault.value.raised_here and seen == [True] and group.communicators[0].aborted and group.pg is None
    assert "releasing the group failed" not in fault.value.reason
    assert not group.communicators[0].aborted_inline  # the failed piece's wait() was never called


def test_a_fault_flag_aborts_the_nccl_communicator_and_releases_the_wait():
    """The flag comes while the group waits: the first poll after it is stored releases the wait (at most one poll
    starts after the flag is in the store; counted, not timed). A group that did not watch the flag would poll on
    until its 5 s deadline and fail the count and the reason."""
    group = _fake_nccl(auto=False)
    polls, stored = [], []
    group.on_poll = lambda: polls.append(time.monotonic())

    def flag():
        raise_fault_flag(group.store, 0, "replica 1: no heartbeat")
        stored.append(time.monotonic())

    threading.Timer(0.2, flag).start()
    with pytest.raises(FaultDetected, match="allreduce in epoch 0 abandoned: replica 1: no heartbeat") as fault:
        group.allreduce_sum_(torch.ones(4))
    assert not fault.value.raised_here and stored
    assert len([t for t in polls if t > stored[0]]) <= 1, (len(polls), "polls after the flag was stored")
    assert group.communicators[0].aborted and group.failed and group.pg is None
    with pytest.raises(FaultDetected, match="failed group"):  # never used again
        group.allreduce_sum_(torch.ones(4))


def test_a_fault_during_an_overlapped_reduction_ends_it_at_the_join_and_the_backup_holds_the_parts():
    """An overlapped reduction (docs/invariant.md) whose peer died in its backward: the parts are issued as they
    become final, none completes, the epoch's flag goes up: the join raises FaultDetected, the communicator is
    aborted, and the backup gives back every part as it was when issued, whatever the abandoned collective left."""
    group = _fake_nccl(auto=False, timeout_s=30.0)
    backup = Backup()
    parts = [torch.zeros(n) for n in (12, 3, 8)]
    tail = torch.zeros(2)
    reduction = OverlappedReduction(parts, tail, group.allreduce_many_, epoch=0, backup=backup).start()
    for index in (2, 1, 0):
        parts[index].fill_(index + 1.0)
        reduction.part_ready(index)
    reduction.release()
    reduction.tail_ready()
    threading.Timer(0.2, lambda: raise_fault_flag(group.store, 0, "replica 1 lost in backward")).start()
    with pytest.raises(FaultDetected, match="replica 1 lost in backward"):
        reduction.join()
    assert group.communicators[0].aborted and backup.saved == [48, 12, 32]  # every part issued, so saved whole
    for part in parts:
        part.add_(1000.0)  # partial sums an abandoned collective may leave
    assert [r.tolist() for r in backup.restored(parts)] == [[1.0] * 12, [2.0] * 3, [3.0] * 8]


def test_an_aborted_communicator_is_let_go_off_the_training_thread():
    """Until it is destroyed, a NCCL communicator holds the inputs of the pieces no one waited for (gradient views:
    a whole gradient per fault, on the device); its destructor joins NCCL's watchdog. After a fault the group holds
    it no more, nor does the fault's traceback, and the last reference goes on a thread of its own."""
    destroyed, aborted = [], threading.Event()

    class Work:
        def is_completed(self):
            if aborted.is_set():
                raise RuntimeError("NCCL communicator was aborted")
            return False

    class Communicator:
        def allreduce(self, tensors, opts):
            return Work()

        def abort(self):
            aborted.set()

        def __del__(self):
            destroyed.append(threading.current_thread().name)

    group = _fake_nccl(auto=False)
    group._connect = lambda *args: Communicator()
    threading.Timer(0.2, lambda: raise_fault_flag(group.store, 0, "replica 1 lost")).start()
    with pytest.raises(FaultDetected, match="replica 1 lost") as fault:
        group.allreduce_sum_(torch.ones(4))
    deadline = time.monotonic() + 30  # a hang guard: the release thread runs at once
    while not destroyed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborted.is_set() and group.pg is None and fault.value is not None  # the traceback is still alive here
    assert destroyed == ["titan-recover-nccl-release"]


def test_nccl_without_progress_for_the_timeout_aborts_and_raises_the_flag(monkeypatch):
    """The collective's deadline runs on a clock the test moves (no wall time involved): two of three pieces
    complete 0.9 timeouts apart, each seen by the group before the clock moves on, then nothing for 1.1 timeouts.
    The collective outlasts its timeout by far while it makes progress and fails once it stops. A deadline from
    the collective's start (not the last piece) fails after the first piece and fails the piece count."""
    from titan_recover.recover.ftpg import nccl

    clock, made = [0.0], []

    def progress(timeout_s):
        made.append(Progress(timeout_s, clock=lambda: clock[0]))
        return made[-1]

    monkeypatch.setattr(nccl, "Progress", progress)
    timeout_s = 0.3
    group = _fake_nccl(auto=False, timeout_s=timeout_s)
    done = threading.Event()

    def until(condition):  # a hang guard only: what is waited for is the group's own progress
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.001)

    def complete_some():
        # the connection's deadline, then the collective's (made once its pieces are issued)
        until(lambda: len(made) == 2 and group.pg is not None and len(group.pg.works) == 3)
        for k, work in enumerate(group.pg.works[:2]):
            clock[0] += 0.9 * timeout_s  # within the deadline
            work.completed = True
            until(lambda: made[1].pieces == k + 1)  # the group saw it: its deadline moved
        clock[0] += 1.1 * timeout_s  # past the deadline, with nothing completing
        done.set()

    threading.Thread(target=complete_some, daemon=True).start()
    with pytest.raises(FaultDetected, match=r"made no progress for 0.3 s \(2 piece\(s\)") as fault:
        group.allreduce_sum_(torch.ones(12))  # 3 pieces
    assert fault.value.raised_here and group.communicators[0].aborted and done.is_set()
    assert clock[0] > 2 * timeout_s  # the deadline moved with each completed piece
    assert group.store.check([GroupKeys.fault(0)])


def test_small_whole_tensors_share_a_batch_and_large_ones_are_split():
    tensors = [torch.zeros(2), torch.zeros(3), torch.zeros(10), torch.zeros(1), torch.zeros(1), torch.zeros(4)]
    pieces = pieces_of(tensors, chunk_bytes=16)  # 4 floats a piece
    batches = batches_of(pieces, tensors, chunk_bytes=16, small_bytes=64)
    shapes = [[(index, start, view.numel()) for _, (index, start, view) in batch] for batch in batches]
    # 2 + 3 floats exceed a piece; the 10 are split; 1 + 1 fit together; a whole tensor of 4 is a piece on its own
    assert shapes == [[(0, 0, 2)], [(1, 0, 3)], [(2, 0, 4)], [(2, 4, 4)], [(2, 8, 2)], [(3, 0, 1), (4, 0, 1)],
                      [(5, 0, 4)]]
    assert [n for batch in batches for n, _ in batch] == list(range(len(pieces)))
    # only tensors below small_bytes are coalesced: 1 + 1 floats (4 bytes each) are not below 4 bytes
    batches = batches_of(pieces, tensors, chunk_bytes=16, small_bytes=4)
    assert all(len(batch) == 1 for batch in batches)


def test_many_small_gradients_are_reduced_together_and_right(monkeypatch):
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    members = _gloo_pair(HashStore(), FTPGConfig(chunk_mb=1), 10.0)
    grads = [[torch.full((n,), float(r + 1)) for n in (3, 1000, 7, 300_000, 5)] for r in (0, 1)]
    saved = {0: [], 1: []}
    results, _ = run_both(lambda: members[0].allreduce_many_(grads[0], lambda *p: saved[0].append(p[:2])),
                       lambda: members[1].allreduce_many_(grads[1], lambda *p: saved[1].append(p[:2])))
    assert results == {0: None, 1: None}
    assert all(bool((g == 3.0).all()) for g in grads[0] + grads[1])
    assert saved[0] == saved[1] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 262144), (4, 0)]
