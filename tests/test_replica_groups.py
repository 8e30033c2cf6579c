"""Replica groups surviving each other: real coordinator + one torchrun per replica, faults injected exactly.

Every test asserts that the fault fired, that the survivors trained every step, that their parameters are
bitwise identical across replicas, and that no process of the run is left behind.
"""

from __future__ import annotations

import collections
import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from conftest import launch, read_metrics, ROOT
from titan_recover.recover.events import read_events
from titan_recover.recover.launcher import processes_of_run

pytestmark = pytest.mark.multiprocess

# join window short to keep tests fast; heartbeat timeout at its default (2 s): shorter ones can misjudge a live
# process that the 2-core machine did not schedule for a second while 5+ processes compete.
FAST_DETECTION = ("--recover.heartbeat_timeout_s", "2.0", "--recover.join_window_s", "0.3")


def run_replicas(tmp_path: pathlib.Path, *, replicas: int, ranks: int, steps: int, faults: list[dict],
                 extra: tuple[str, ...] = ()):
    fault_toml = "[" + ", ".join(
        "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in f.items()) + "}" for f in faults
    ) + "]"
    proc = launch(
        "train_configs/replicas.toml",
        "--model.flavor", "tiny", "--metrics.no_enable_wandb",
        "--training.steps", str(steps),
        "--recover.replicas", str(replicas),
        "--parallelism.data_parallel_shard_degree", str(ranks),
        "--dump_folder", str(tmp_path),
        "--chaos.faults", fault_toml,
        *FAST_DETECTION, *extra,
        timeout=280,
    )
    return proc, read_events(tmp_path / "events.jsonl")


def assert_survived(tmp_path, proc, events, *, replicas: int, ranks: int, steps: int, lost: dict[int, int]):
    """``lost``: replica -> first step it no longer contributes to."""
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    injected = [e for e in events if e["event"] == "fault_injected"]
    assert len(injected) == len(lost), injected  # every scheduled fault fired
    survivors = sorted(set(range(replicas)) - set(lost))
    by_replica = collections.defaultdict(dict)
    for record in read_metrics(tmp_path):
        by_replica[record["replica"]][record["step"]] = record
    for replica in survivors:
        assert sorted(by_replica[replica]) == list(range(1, steps + 1)), f"replica {replica} missed steps"
        for step, record in by_replica[replica].items():
            alive = sum(1 for r in range(replicas) if r not in lost or step < lost[r])
            assert record["recover/replicas"] == alive, (replica, step, record["recover/replicas"])
        assert by_replica[replica] .keys() == by_replica[survivors[0]].keys()
        for step in by_replica[replica]:  # every survivor logged the same (cross-replica) loss
            assert by_replica[replica][step]["loss_metrics/global_avg_loss"] == \
                by_replica[survivors[0]][step]["loss_metrics/global_avg_loss"]
    finals = [e for e in events if e["event"] == "final_parameters"]
    assert sorted((e["replica"], e["rank"]) for e in finals) == [(r, k) for r in survivors for k in range(ranks)]
    for rank in range(ranks):
        digests = {e["sha256"] for e in finals if e["rank"] == rank}
        assert len(digests) == 1, f"position {rank}: replicas differ"  # bitwise identical parameters
    removed = [r for e in events if e["event"] == "epoch_formed" for r in e["removed"]]
    assert sorted(removed) == sorted(lost)
    assert processes_of_run(str(tmp_path)) == []  # nothing left behind
    return injected


@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_replica_lost_in_forward(tmp_path, default_data, kind):
    proc, events = run_replicas(tmp_path, replicas=3, ranks=1, steps=4,
                                faults=[{"kind": kind, "replica": 1, "rank": 0, "step": 2, "phase": "forward"}])
    injected = assert_survived(tmp_path, proc, events, replicas=3, ranks=1, steps=4, lost={1: 2})
    assert injected[0]["kind"] == kind and injected[0]["phase"] == "forward"


def test_kill_during_reduction_with_fsdp_inside(tmp_path, default_data):
    proc, events = run_replicas(tmp_path, replicas=3, ranks=2, steps=4,
                                faults=[{"kind": "kill", "replica": 2, "rank": 1, "step": 3, "phase": "reduction"}])
    assert_survived(tmp_path, proc, events, replicas=3, ranks=2, steps=4, lost={2: 3})
    redone = [e for e in events if e["event"] == "step_committed" and e["step"] == 3 and e["attempts"] > 1]
    assert redone, "the step's reduction was not redone in the new epoch"


def test_kill_during_optimizer_step(tmp_path, default_data):
    proc, events = run_replicas(tmp_path, replicas=3, ranks=1, steps=4,
                                faults=[{"kind": "kill", "replica": 0, "rank": 0, "step": 2, "phase": "optimizer"}])
    # step 2 was committed before the optimizer ran: replica 0 contributed to it, not to step 3
    assert_survived(tmp_path, proc, events, replicas=3, ranks=1, steps=4, lost={0: 3})


def test_hung_process_is_dropped_after_the_heartbeat_timeout(tmp_path, default_data):
    proc, events = run_replicas(tmp_path, replicas=3, ranks=1, steps=4,
                                faults=[{"kind": "hang", "replica": 2, "rank": 0, "step": 2, "phase": "reduction"}])
    assert_survived(tmp_path, proc, events, replicas=3, ranks=1, steps=4, lost={2: 2})
    detected = [e for e in events if e["event"] == "failure_detected" and e["by"] == "coordinator"]
    assert detected and detected[0]["replica"] == 2 and detected[0]["dead_ranks"] == [0]
    injected_at = next(e["time"] for e in events if e["event"] == "fault_injected")
    assert detected[0]["time"] - injected_at < 2.0 + 1.0  # heartbeat timeout + slack


def test_stuck_main_thread_is_dropped_after_the_progress_timeout(tmp_path, default_data):
    proc, events = run_replicas(tmp_path, replicas=3, ranks=1, steps=4,
                                faults=[{"kind": "stall", "replica": 1, "rank": 0, "step": 2, "phase": "forward"}],
                                extra=("--recover.progress_timeout_s", "5"))
    assert_survived(tmp_path, proc, events, replicas=3, ranks=1, steps=4, lost={1: 2})
    detected = [e for e in events if e["event"] == "failure_detected"]
    assert detected[0]["hung_ranks"] == [0] and detected[0]["replica"] == 1


def test_two_failures_in_a_row(tmp_path, default_data):
    faults = [
        {"kind": "kill", "replica": 1, "rank": 0, "step": 2, "phase": "reduction"},
        {"kind": "kill", "replica": 3, "rank": 0, "step": 3, "phase": "backward"},
    ]
    proc, events = run_replicas(tmp_path, replicas=4, ranks=1, steps=5, faults=faults)
    assert_survived(tmp_path, proc, events, replicas=4, ranks=1, steps=5, lost={1: 2, 3: 3})
    epochs = [e["epoch"] for e in events if e["event"] == "epoch_formed"]
    assert epochs == [0, 1, 2]


def test_failure_during_recovery(tmp_path, default_data):
    faults = [
        {"kind": "kill", "replica": 1, "rank": 0, "step": 2, "phase": "reduction"},
        # replica 2 dies just after entering the epoch that recovers from the first failure
        {"kind": "kill", "replica": 2, "rank": 0, "step": 2, "phase": "rebuild"},
    ]
    proc, events = run_replicas(tmp_path, replicas=4, ranks=1, steps=4, faults=faults)
    assert_survived(tmp_path, proc, events, replicas=4, ranks=1, steps=4, lost={1: 2, 2: 2})
    commits = [e for e in events if e["event"] == "step_committed" and e["step"] == 2]
    assert {e["epoch"] for e in commits} == {2} and {e["replica"] for e in commits} == {0, 3}


def test_ctrl_c_stops_every_process(tmp_path, default_data):
    cmd = [sys.executable, "-m", "titan_recover.launch", "train_configs/replicas.toml", "--model.flavor", "tiny",
           "--metrics.no_enable_wandb", "--training.steps", "1000", "--recover.replicas", "2",
           "--parallelism.data_parallel_shard_degree", "1", "--dump_folder", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not any(e["event"] == "step_committed" for e in read_events(tmp_path / "events.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
            time.sleep(0.5)
        assert len(processes_of_run(str(tmp_path))) >= 4  # coordinator, 2 torchruns, 2 workers
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert processes_of_run(str(tmp_path)) == []


def test_too_few_replicas_stop_with_a_durable_checkpoint(tmp_path, default_data):
    proc, events = run_replicas(
        tmp_path, replicas=2, ranks=1, steps=5,
        faults=[{"kind": "kill", "replica": 1, "rank": 0, "step": 3, "phase": "forward"}],
        extra=("--recover.min_replicas", "2", "--checkpoint.enable", "--checkpoint.interval", "100"),
    )
    assert proc.returncode != 0
    assert "fewer than recover.min_replicas = 2: stopping" in proc.stdout + proc.stderr
    stopped = [e for e in events if e["event"] == "stopped"]
    assert stopped and stopped[0]["step"] == 2 and stopped[0]["checkpoint_saved"]
    assert (tmp_path / "replica_0" / "checkpoint" / "step-2").is_dir()
    assert processes_of_run(str(tmp_path)) == []
