"""The coordinator is not a single point of failure (docs/replica_groups.md "Coordinator restarts").

The launcher hosts the job's store; a coordinator killed at any point (while forming an epoch, half-way through
publishing one; mid-step: tests/test_nodes.py) is restarted by the launcher and resumes from the store while the
replicas train on. Every run is in exact mode: "nothing lost" means every replica ends bitwise equal to the
failure-free run.
"""

from __future__ import annotations

import pytest

from conftest import EXACT_REFERENCE
from replica_runs import assert_all_equal_reference, metrics_by_replica, of, run_replicas
from titan_recover.recover.children import processes_of_run

pytestmark = pytest.mark.multiprocess

REPLICAS, STEPS = EXACT_REFERENCE["replicas"], EXACT_REFERENCE["steps"]
EXACT = ("--recover.quota.exact",)


def coordinator_fault(phase, step, *, start=0):
    return {"kind": "kill", "process": "coordinator", "phase": phase, "step": step, "incarnation": start}


def test_the_coordinator_killed_during_an_epoch_change_is_restarted_and_finishes_it(tmp_path, exact_reference):
    """Replica 1 is killed in step 3. The coordinator is killed as it is about to form epoch 1; its next start is
    killed half-way through publishing it (its state written ahead, the epoch not yet readable); the third start
    publishes that same epoch. The survivors recompute replica 1's microbatch in step 3, the launcher restarts
    replica 1, it is admitted and receives its state: everyone ends bitwise equal to the failure-free run. On the
    launcher's embedded store. On etcd, the same resumption by starts that each lead under a new term and write
    through its fence: tests/test_recover_protocol.py (in process) and tests/test_nodes.py (a standby on another
    node takes over mid-step)."""
    faults = [{"kind": "kill", "replica": 1, "rank": 0, "step": 3, "phase": "forward"},
              coordinator_fault("epoch", 1), coordinator_fault("publish", 1, start=1)]
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=faults,
                                extra=(*EXACT, "--recover.max_restarts", "1", "--recover.rejoin_wait_s", "150"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(of(events, "fault_injected")) == 3
    starts = [(e["start"], e["action"]) for e in of(events, "coordinator_started")]
    assert starts == [(0, "form_first"), (1, "resume"), (2, "finish")]
    formed = {e["epoch"]: e for e in of(events, "epoch_formed")}
    assert formed[1]["members"] == [0, 2] and formed[1]["removed"] == [1]
    assert formed[1]["start"] == 2 and formed[1]["finished_publication"]  # decided by start 1, published by 2
    assert [(e["replica"], e["incarnation"]) for e in of(events, "replica_admitted")] == [(1, 1)]
    logged = metrics_by_replica(tmp_path)
    assert sorted(logged[0]) == sorted(logged[2]) == list(range(1, STEPS + 1))
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=range(REPLICAS))
    assert processes_of_run(str(tmp_path)) == []


def test_a_group_restarted_while_the_coordinator_hangs_enters_only_an_epoch_that_admits_it(tmp_path, exact_reference):
    """Replica 1 is killed in step 3 and the coordinator hangs (stopped) as it is about to form epoch 1: the
    launcher restarts replica 1, whose new start asks to join while epoch 0, which lists replica 1 for its lost
    start, is still the current one; the coordinator is restarted once its beat stood still for 15 s, handles
    the loss and admits the new start. The new start waits for that admission and enters with its first restart.
    Found by ``benchmarks/fault_soak.py --coordinator``: the new start took epoch 0 for its own and failed, and its
    next start took the admission made for the failed one, was declared dead and failed too: three restarts for
    one fault."""
    hang = {**coordinator_fault("epoch", 1), "kind": "hang"}
    faults = [{"kind": "kill", "replica": 1, "rank": 0, "step": 3, "phase": "forward"}, hang]
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=faults,
                                extra=(*EXACT, "--recover.max_restarts", "3", "--recover.rejoin_wait_s", "150",
                                       "--recover.coordinator_timeout_s", "15"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(e["start"], e["action"]) for e in of(events, "coordinator_started")] == [(0, "form_first"), (1, "resume")]
    asked = [e for e in of(events, "join_requested", replica=1)]
    resumed = of(events, "coordinator_started")[1]["time"]
    assert asked and asked[0]["time"] < resumed  # the new start asked while the coordinator hung (the case here)
    assert [(e["replica"], e["incarnation"]) for e in of(events, "replica_admitted")] == [(1, 1)]
    assert [e["incarnation"] for e in asked] == [1]
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=range(REPLICAS))
    assert processes_of_run(str(tmp_path)) == []


BUDGET = 1000


def test_without_a_coordinator_every_replica_stops_with_a_checkpoint_of_the_last_committed_step(tmp_path,
                                                                                                default_data):
    """No restarts for the coordinator: killed once every replica is in step 4, the launcher stops the job: every
    replica aborts the step it is in and stops with the last step committed (whichever: a tiny step takes less than
    the heartbeat interval in which the stop is seen), a durable checkpoint of it written once; no traceback, exit 1.
    The budget (1000 steps) is far beyond what the replicas train before the stop reaches them on a loaded machine,
    so reaching it would mean the stop was lost, not that the machine was slow."""
    proc, events = run_replicas(tmp_path, replicas=2, ranks=1, steps=BUDGET, faults=[coordinator_fault("step", 4)],
                                extra=("--recover.coordinator_restarts", "0", "--checkpoint.enable",
                                       "--checkpoint.interval", str(10 * BUDGET)))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "the coordinator exited with -9 and has no restarts left" in output
    assert "Traceback" not in output
    stopped = of(events, "stopped")
    last = {max(e["step"] for e in of(events, "step_committed", replica=r)) for r in (0, 1)}
    assert sorted(e["replica"] for e in stopped) == [0, 1] and {e["step"] for e in stopped} == last
    [step] = last
    assert 3 <= step < BUDGET
    assert [e["checkpoint_saved"] for e in stopped if e["replica"] == 0] == [True]
    assert (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    assert processes_of_run(str(tmp_path)) == []
