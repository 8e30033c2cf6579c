"""The worst case is checkpoint-restart, never worse (docs/replica_groups.md "Losing every replica").

When no live member holds the training state (every replica group killed at once), the job restarts every group
from the newest durable checkpoint and goes on; without one it stops with a sentence saying what to enable, and
the launcher's exit code says the job did not train its budget.
"""

from __future__ import annotations

import pytest

from conftest import EXACT_REFERENCE, read_metrics
from replica_runs import assert_all_equal_reference, LOSS, metrics_by_replica, of, run_replicas
from titan_recover.recover.children import processes_of_run

pytestmark = pytest.mark.multiprocess

REPLICAS, STEPS = EXACT_REFERENCE["replicas"], EXACT_REFERENCE["steps"]
KILL_ALL = [{"kind": "kill", "replica": r, "rank": 0, "step": 5, "phase": "forward"} for r in range(REPLICAS)]


def test_every_replica_killed_at_once_restarts_from_the_newest_checkpoint(tmp_path, exact_reference):
    """All three groups are killed in step 5's forward, a checkpoint every 2 steps: nobody holds the state, the
    coordinator restarts every group from the newest verified checkpoint (step 2: step 4's would have been
    verified by step 5's vote, which never came) and they found the next epoch together; steps 3-8 are trained
    again, each exactly as the first time, and everyone ends bitwise equal to the failure-free run."""
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=KILL_ALL,
                                extra=("--recover.quota.exact", "--recover.max_restarts", "2",
                                       "--checkpoint.enable", "--checkpoint.interval", "2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kills = of(events, "fault_injected")
    assert sorted(e["replica"] for e in kills) == [0, 1, 2]
    assert not of(events, "step_committed", step=5, epoch=0)  # all died before any could commit step 5
    [cold] = of(events, "cold_restart")
    assert cold["durable"].startswith("newest verified checkpoint, step 2 (unverified newer: [4])"), cold
    founders_loaded = [e for e in of(events, "checkpoint_choice") if "chosen by the coordinator" in e["reason"]]
    assert sorted((e["replica"], e["step"]) for e in founders_loaded) == [(r, cold["step"]) for r in range(REPLICAS)]
    founded = [e for e in of(events, "epoch_formed") if e["epoch"] == cold["epoch"] + 1]
    assert founded and founded[0]["members"] == [0, 1, 2], founded
    assert sorted(e["replica"] for e in of(events, "founding")) == [0, 1, 2]
    for replica, logged in metrics_by_replica(tmp_path).items():
        assert sorted(logged) == list(range(1, STEPS + 1)), replica
    first, again = {}, []  # steps 3 and 4 were logged twice by every replica: the same numbers both times
    for record in read_metrics(tmp_path):
        key = (record["replica"], record["step"])
        (again.append((first[key], record)) if key in first else first.__setitem__(key, record))
    assert sorted((a["replica"], a["step"]) for a, _ in again) == [(r, s) for r in range(REPLICAS) for s in (3, 4)]
    assert all(a[LOSS] == b[LOSS] and a["recover/tokens"] == b["recover/tokens"] for a, b in again)
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=range(REPLICAS))
    assert processes_of_run(str(tmp_path)) == []


def test_every_replica_killed_at_once_without_a_checkpoint_stops_and_says_what_to_enable(tmp_path, default_data):
    # two groups are enough to lose them all: no reference to compare with here
    kill_both = [{"kind": "kill", "replica": r, "rank": 0, "step": 2, "phase": "forward"} for r in range(2)]
    proc, events = run_replicas(tmp_path, replicas=2, ranks=1, steps=4, faults=kill_both,
                                extra=("--recover.max_restarts", "2"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "no durable state exists to restart from: enable [checkpoint]" in output
    assert "the job did not commit its training budget" in output
    assert not of(events, "cold_restart")
    assert of(events, "job_finished")[-1]["stopped"]
    assert processes_of_run(str(tmp_path)) == []
