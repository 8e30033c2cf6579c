"""The hang observer's pure parts: beacons in shared memory and the diagnosis (docs/scout.md)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from replica_runs import metrics_by_replica, of, run_replicas
from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.scout.beacon import Beacon, beacon_path, BeaconRecord, collective_fingerprint, read_beacon
from titan_recover.recover.children import processes_of_run
from titan_recover.recover.scout.observer import diagnose


def record(step, phase, seq, op="", when=100.0):
    fingerprint = collective_fingerprint(op, "replica", (1,))[0] if op else 0
    return BeaconRecord(step=step, phase=phase, seq=seq, op_fingerprint=fingerprint, op=op, time=when, pid=1)


def test_beacon_round_trip_through_the_file(tmp_path):
    path = beacon_path(str(tmp_path), 2, 1, incarnation=3)
    assert path.endswith(os.path.join("replica2", "start3", "rank1"))
    assert read_beacon(path) is None
    beacon = Beacon(path)
    first = read_beacon(path)
    assert first.phase == "startup" and first.seq == 0 and first.pid == os.getpid()
    beacon.update(step=4, phase="forward")
    with beacon.collective("all_reduce", "replica", (1,)):
        inside = read_beacon(path)
        assert (inside.step, inside.phase, inside.seq) == (4, "collective", 1)
        assert inside.op.startswith("all_reduce|replica|(1,)")
        assert inside.op_fingerprint == collective_fingerprint("all_reduce", "replica", (1,))[0]
    after = read_beacon(path)
    assert after.phase == "forward" and after.seq == 1 and after.time >= inside.time
    beacon.update(phase="not-a-phase")  # unknown phases keep the last known one
    assert read_beacon(path).phase == "forward"
    beacon.close()
    assert read_beacon(path).phase == "done"


def test_nothing_to_report_while_ranks_move_or_build():
    now = 200.0
    assert diagnose({0: record(3, "forward", 5, when=199.0), 1: record(3, "backward", 5, when=198.0)}, now, 5) is None
    # a rank still building its model, one that finished, and one without a beacon yet are not judged
    assert diagnose({0: record(0, "startup", 0, when=1.0), 1: record(9, "done", 40, when=1.0), 2: None}, now, 5) is None
    # waiting for other replicas (the reduction across them, its commit, a transfer) is not this group's hang
    assert diagnose({0: record(3, "reduction", 6, when=1.0), 1: record(3, "commit", 6, when=1.0)}, now, 5) is None


def test_the_rank_that_never_entered_the_collective_is_named():
    now = 200.0
    beacons = {0: record(3, "collective", 6, "all_reduce", when=190.0),
               1: record(3, "forward", 5, when=189.0),
               2: record(3, "collective", 6, "all_reduce", when=190.5)}
    found = diagnose(beacons, now, 5)
    assert found.kind == "behind" and found.ranks == (1,)
    assert "never entered" in found.reason and "rank 1: step 3 forward" in found.reason
    assert found.stalled_s == 11.0


def test_a_rank_that_went_past_the_collective_is_not_blamed_for_one_still_inside_it():
    """Rank 1 completed collective #6 and waits in a collective nobody instruments (FSDP2's); rank 0 still shows
    itself inside #6, which its peer has left: rank 0 is stuck there, not rank 1."""
    now = 200.0
    beacons = {0: record(3, "collective", 6, "all_reduce", when=190.0), 1: record(3, "backward", 6, when=189.0)}
    found = diagnose(beacons, now, 5)
    assert found.kind == "left_behind_inside" and found.ranks == (0,)
    assert "ranks [1] completed collective #6" in found.reason and "rank 0: step 3 collective" in found.reason


def test_a_diverged_collective_names_the_minority_and_two_ranks_stay_unblamed():
    now = 200.0
    beacons = {0: record(3, "collective", 6, "all_reduce", when=190.0),
               1: record(3, "collective", 6, "all_gather", when=190.0),
               2: record(3, "collective", 6, "all_reduce", when=190.0)}
    found = diagnose(beacons, now, 5)
    assert found.kind == "diverged" and found.ranks == (1,)
    assert "collective #6 diverged" in found.reason and "all_gather" in found.reason
    pair = diagnose({0: beacons[0], 1: beacons[1]}, now, 5)
    assert pair.kind == "diverged" and pair.ranks == (0, 1) and "no majority" in pair.reason


def test_everyone_inside_the_same_collective_blames_nobody_in_the_group_and_a_plain_stall_is_named():
    now = 200.0
    same = {r: record(3, "collective", 6, "all_reduce", when=190.0) for r in range(2)}
    found = diagnose(same, now, 5)
    assert found.kind == "stuck_in_collective" and found.ranks == ()
    stalled = diagnose({0: record(3, "optimizer", 6, when=150.0), 1: record(3, "forward", 6, when=199.0)}, now, 5)
    assert stalled.kind == "stalled" and stalled.ranks == (0,)


HANG = ("--recover.quota.policy", "throughput", "--recover.localize.hang_threshold_s", "4",
        "--recover.max_restarts", "0")


@pytest.mark.multiprocess
def test_a_rank_hanging_in_a_collective_and_a_desynchronised_collective_are_named(tmp_path, default_data):
    """Three replicas of two ranks, each with its observer (threshold 4 s). At step 3, replica 1's rank 1 stalls
    (main thread stuck, heartbeat alive) where it should enter its replica's collective, so its peer waits inside
    it; replica 2's rank 1 issues an all-reduce of another shape than its peer's (gloo waits forever on such a
    pair). Each observer names what happened, writes its report and ends its replica; replica 0 trains on to the
    end, and its observer reports nothing.

    The timing is checked against the run's own quantities, not the machine's speed: a verdict comes only once the
    named beacons were still for the threshold (``stalled_s``, measured by the observer), and before the
    fault-tolerant group's collective timeout could have ended the step; no epoch's fault is a collective or
    barrier timeout, so it was the observer that ended each hang. An observer that judged before its threshold,
    or that left the hang to the collective timeout, fails this."""
    faults = [{"kind": "stall", "replica": 1, "rank": 1, "step": 3, "phase": "collective"},
              {"kind": "desync", "replica": 2, "rank": 1, "step": 3, "phase": "collective"}]
    proc, events = run_replicas(tmp_path, replicas=3, ranks=2, steps=5, faults=faults, extra=HANG)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    injected = {e["replica"]: e for e in of(events, "fault_injected")}
    assert sorted(injected) == [1, 2]
    hangs = {e["replica"]: e for e in of(events, "hang_detected")}
    assert sorted(hangs) == [1, 2]  # and none from replica 0's observer
    threshold_s = float(HANG[HANG.index("--recover.localize.hang_threshold_s") + 1])
    collective_timeout_s = RecoverConfig().collective_timeout_s
    for replica, hang in hangs.items():
        assert hang["ended"] and hang["stalled_s"] > threshold_s, hang
        assert injected[replica]["time"] < hang["time"] < injected[replica]["time"] + collective_timeout_s, hang
    reasons = [e["reason"] for e in of(events, "fault_flag")]
    assert reasons and not [r for r in reasons if "no progress for" in r or "timed out" in r.lower()], reasons

    behind = hangs[1]
    assert behind["kind"] == "behind" and behind["ranks"] == [1]
    assert "never entered" in behind["reason"] and "all_reduce(max)" in behind["reason"]
    report = json.loads(pathlib.Path(behind["report"]).read_text())
    assert report["ranks"] == [1] and report["beacons"]["0"]["phase"] == "collective"
    assert report["beacons"]["1"]["seq"] == report["beacons"]["0"]["seq"] - 1

    # two ranks have no majority: the collective and what each rank issued are named, neither rank singled out
    diverged = hangs[2]
    assert diverged["kind"] == "diverged" and diverged["ranks"] == [0, 1]
    assert "(1,)" in diverged["reason"] and "(2,)" in diverged["reason"] and "no majority" in diverged["reason"]
    assert pathlib.Path(diverged["report"]).exists()

    assert sorted(r for e in of(events, "epoch_formed") for r in e["removed"]) == [1, 2]
    assert sorted(metrics_by_replica(tmp_path)[0]) == list(range(1, 6))
    assert processes_of_run(str(tmp_path)) == []


def test_a_rank_is_inside_its_replica_collective_until_the_device_completed_it(tmp_path, monkeypatch):
    """On NCCL a collective call returns once it is queued; the host waits later. The beacon must show the rank
    inside the collective until the device completed it, or the observer sees no rank waiting in a collective and
    cannot tell a rank behind from one stalled."""
    from types import SimpleNamespace

    import torch

    from titan_recover import platform
    from titan_recover.recover.modes.sync import SyncMode

    beacon = Beacon(str(tmp_path / "beacon"))
    seen = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op: seen.append(("issued", beacon.phase)))
    monkeypatch.setattr(platform, "synchronize", lambda device: seen.append(("completed", beacon.phase)))
    SyncMode._replica_all_reduce_max(SimpleNamespace(member=SimpleNamespace(beacon=beacon)), torch.zeros(1))
    assert seen == [("issued", "collective"), ("completed", "collective")] and beacon.phase != "collective"


def test_a_beacon_left_by_an_earlier_job_in_the_same_run_folder_is_not_this_starts(tmp_path, monkeypatch):
    """A run folder used again: the beacon of the earlier job's rank names a PID that is gone (or, worse, reused by
    another process). Before this start's rank writes its own, the observer reads it as not written yet: it neither
    stops watching (a gone PID read as an exited rank) nor judges the earlier job's timestamps."""
    import threading

    from titan_recover.recover.scout import beacon as beacon_module
    from titan_recover.recover.scout.observer import Observer

    path = beacon_path(str(tmp_path), 0, 0, incarnation=0)
    with monkeypatch.context() as earlier:  # the earlier job's rank: an hour ago, a PID no process has now
        earlier.setattr(beacon_module.time, "time", lambda: 1000.0)
        earlier.setattr(beacon_module.os, "getpid", lambda: 2**22 + 12345)  # above Linux's largest pid_max
        Beacon(path).update(step=7, phase="forward")
    assert read_beacon(path).time == 1000.0

    observer = Observer(str(tmp_path), 0, 0, ranks=1, threshold_s=0.5, end_hung=True)
    ended = threading.Event()
    threading.Thread(target=lambda: (observer.run(), ended.set()), daemon=True).start()
    assert not ended.wait(1.0)  # still watching: nothing of this start to judge yet
    observer.request_stop()
    assert ended.wait(5.0)
