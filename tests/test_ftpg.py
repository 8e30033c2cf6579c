"""The fault-tolerant group: its contract and registry with a fake in-memory backend (fast), and the gloo backend on
real processes (no TorchTitan): errors instead of hangs, fast release."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
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
from titan_recover.recover.ftpg.gloo import PolledGlooGroup
from titan_recover.recover.groups.keys import fault_time_and_reason, GroupKeys, raise_fault_flag


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

    def __init__(self, store, *, config, epoch, members, replica, rank, timeout_s, on_poll=None, tag=""):
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


def test_the_backend_is_checked_against_the_registry():
    with pytest.raises(ValueError, match=r"fault-tolerant group backend 'nccl' is not registered; registered: gloo, "
                                         r"in_memory"):
        FTPGConfig(backend="nccl")
    with pytest.raises(ValueError, match=r"recover.ftpg.poll_s must be > 0, got 0"):
        FTPGConfig(poll_s=0)
    with pytest.raises(ValueError, match=r"replica 4 is not a member of epoch 1 \(\(0, 1\)\)"):
        build_group(FTPGConfig(), HashStore(), epoch=1, members=(0, 1), replica=4, rank=0, timeout_s=1.0)


def test_gloo_is_the_default_backend_and_takes_the_poll_interval_from_the_config():
    store = HashStore()
    group = build_group(FTPGConfig(poll_s=0.05), store, epoch=0, members=(0,), replica=0, rank=0, timeout_s=5.0)
    assert isinstance(group, PolledGlooGroup) and group.poll_s == 0.05
    t = torch.arange(4.0)
    group.allreduce_sum_(t)  # one member: the sum is the tensor itself
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_raised_fault_flag_abandons_a_gloo_collective(monkeypatch):
    """A member that sees the epoch's flag gives up at once, without waiting for the collective or its deadline."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")  # as the launcher sets it: the peer never connects
    store = HashStore()
    raise_fault_flag(store, 0, "replica 1: no heartbeat")
    group = build_group(FTPGConfig(), store, epoch=0, members=(0, 1), replica=0, rank=0, timeout_s=5.0)
    start = time.monotonic()
    with pytest.raises(FaultDetected, match="allreduce in epoch 0 abandoned: replica 1: no heartbeat") as fault:
        group.allreduce_sum_(torch.ones(2))  # replica 1 never joins
    assert not fault.value.raised_here and time.monotonic() - start < 2.0


def _member(port: int, replica: int, members: tuple, victim: int, mode: str, results):
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    group = build_group(FTPGConfig(), store, epoch=0, members=members, replica=replica, rank=0, timeout_s=20.0)
    t = torch.full((1024,), float(replica + 1))
    group.allreduce_sum_(t)  # a healthy round first
    store.add("round1", 1)
    while int(store.add("round1", 0)) < len(members):
        time.sleep(0.01)
    if replica == victim:
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    start = time.monotonic()
    try:
        group.allreduce_sum_(t)
        results.put((replica, "completed", time.monotonic() - start, ""))
    except FaultDetected as fault:
        results.put((replica, "fault", time.monotonic() - start, fault.reason))


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_survivors_are_released_quickly(mode):
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    members, victim = (0, 1, 2, 3), 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(store.port, r, members, victim, mode, results)) for r in members]
    for p in procs:
        p.start()
    try:
        # the fault comes after a healthy round of all four: the wait for the release below starts only then, so
        # that it does not include starting four processes that import torch (tens of seconds on a loaded host)
        deadline = time.monotonic() + 180
        while int(store.add("round1", 0)) < len(members):
            assert time.monotonic() < deadline, "the members did not finish their healthy round within 180 s"
            time.sleep(0.01)
        if mode == "hang":
            # nobody gets a gloo error from a stopped peer: the coordinator's verdict raises the flag
            time.sleep(0.5)
            store.compare_set("fault/e0", "", f"{time.time()}|replica {victim}: no heartbeat")
        got = [results.get(timeout=15) for _ in range(len(members) - 1)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    assert sorted(r for r, *_ in got) == [0, 1, 3]
    assert all(outcome == "fault" for _, outcome, _, _ in got)  # an error, not a hang
    slowest = max(elapsed for *_, elapsed, _ in [(g[0], g[1], g[2], g[3]) for g in got])
    assert slowest < (2.0 if mode == "kill" else 1.5), got  # released within the poll/flag latency, not 20 s
    assert store.check(["fault/e0"])  # the first failure raised the flag for everyone
