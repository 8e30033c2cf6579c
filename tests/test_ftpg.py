"""The fault-tolerant group on real gloo processes (no TorchTitan): errors instead of hangs, fast release."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from titan_recover.recover.ftpg.gloo import FaultDetected, FaultTolerantGroup

pytestmark = pytest.mark.multiprocess


def _member(port: int, replica: int, members: tuple, victim: int, mode: str, results):
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    group = FaultTolerantGroup(store, epoch=0, members=members, replica=replica, position=0, timeout_s=20.0)
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
        if mode == "hang":
            # nobody gets a gloo error from a stopped peer: the coordinator's verdict raises the flag
            while int(store.add("round1", 0)) < len(members):
                time.sleep(0.01)
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
