"""PHOENIX end to end: lost capacity comes back from peers' memory and the trajectory is kept (docs/phoenix.md).

Every run is in exact mode, so "the same trajectory" is bitwise: the loss at every step and every final parameter
of every replica, the restarted and promoted ones included, equal the failure-free reference's (``torch.equal``).
"""

from __future__ import annotations

import json

import pytest

from conftest import EXACT_REFERENCE
from replica_runs import assert_all_equal_reference, LOSS, metrics_by_replica, of, run_replicas
from wandb_offline import read_run
from titan_recover.recover.children import processes_of_run

pytestmark = pytest.mark.multiprocess

REPLICAS, STEPS = EXACT_REFERENCE["replicas"], EXACT_REFERENCE["steps"]
EXACT = ("--recover.quota.exact",)
# restarted groups are waited for at the step boundary after they were dropped, so that the step they are admitted
# at does not depend on how fast this machine starts a process (the bound is far above a start, ~10-25 s here)
RESTARTS = ("--recover.max_restarts", "2", "--recover.rejoin_wait_s", "150")


def fault(replica, step, phase, *, incarnation=0, kind="kill"):
    return {"kind": kind, "replica": replica, "rank": 0, "step": step, "phase": phase, "incarnation": incarnation}


@pytest.fixture
def reference(exact_reference):
    return exact_reference


def test_killed_replica_rejoins_and_a_donor_and_a_joiner_dying_mid_transfer_are_survived(tmp_path, reference):
    """Replica 1 is killed at step 2 and restarted; at its admission (start of step 4) the donor, replica 0, is
    killed mid-transfer: replica 2 donates instead. Replica 0 is restarted in turn and killed mid-transfer as a
    joiner (step 6): the others go on; its third start is admitted and receives the state before step 8."""
    faults = [fault(1, 2, "forward"), fault(0, 4, "transfer"), fault(0, 6, "transfer", incarnation=1)]
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=faults,
                                extra=(*EXACT, *RESTARTS, "--metrics.enable_wandb"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fired = sorted((e["replica"], e["step"], e["phase"]) for e in of(events, "fault_injected"))
    assert fired == [(0, 4, "transfer"), (0, 6, "transfer"), (1, 2, "forward")]
    assert_one_job_run(tmp_path, proc, reference)

    admitted = [(e["replica"], e["after_step"], e["incarnation"]) for e in of(events, "replica_admitted")]
    assert admitted == [(1, 3, 1), (0, 5, 1), (0, 7, 2)]
    # the first admission: donor 0 died, replica 2 finished the transfer; both sides saw the same bytes
    first = of(events, "state_transferred", epoch=of(events, "admission_committed", step=4)[0]["epoch"])
    assert {(e["role"], e["replica"], e["donor"]) for e in first} == {("donor", 2, 2), ("joiner", 1, 2)}
    assert len({e["bytes"] for e in first}) == 1 and first[0]["bytes"] > 0
    # the joiner killed mid-transfer (step 6) never committed its admission; its next start did (step 8)
    assert not of(events, "admission_committed", step=6)
    assert {e["replica"] for e in of(events, "admission_committed", step=8)} == {0, 1, 2}
    assert of(events, "full_strength", step=8)

    # the restarted replicas trained from the step they were admitted at; all three ended bitwise equal to the
    # failure-free run, which also means the loss of every step of every replica is the reference's
    logged = metrics_by_replica(tmp_path)
    assert sorted(logged[1]) == [1, 4, 5, 6, 7, 8] and sorted(logged[0]) == [1, 2, 3, 8]
    assert sorted(logged[2]) == list(range(1, STEPS + 1))
    assert_all_equal_reference(reference, tmp_path, events, replicas=[0, 1, 2])
    assert processes_of_run(str(tmp_path)) == []


def assert_one_job_run(folder, proc, reference):
    """The job's one wandb run (offline, written by the launcher while replicas died and came back): named after
    the TOML file, grouped by it, the loss and the recover/* figures of every step equal to what the members logged
    (the failure-free reference's), each fault marked at its step and in the table of events; no member started a
    run of its own. The console has a line per step and per resilience event, each group's output its own file."""
    run = read_run(folder / "wandb")
    assert run.group == "replicas" and run.name.startswith("replicas-"), (run.group, run.name)
    ref = metrics_by_replica(reference)[0]
    assert sorted(s for s, row in run.history.items() if LOSS in row) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        row = run.history[step]
        assert row[LOSS] == ref[step][LOSS] and row["recover/tokens"] == ref[step]["recover/tokens"], step
        assert row["recover/replicas"] >= 2 and any(k.startswith("replica2/throughput") for k in row), row
    assert [s for s in range(1, STEPS + 1) if "events/fault_injected" in run.history[s]] == [2, 4, 6]
    assert [s for s in range(1, STEPS + 1) if "events/replica_admitted" in run.history[s]] == [4, 6, 8]
    table_file = next((folder / "wandb").glob("offline-run-*/files/media/table/event_table_*.json"))
    table = json.loads(table_file.read_text())
    columns = table["columns"]
    injected = sorted(row[columns.index("step")] for row in table["data"] if row[columns.index("kind")] == "fault_injected")
    assert injected == [2, 4, 6]
    assert not list(folder.glob("replica_*/**/offline-run-*")), "a member started a wandb run of its own"
    assert "step     8  loss" in proc.stdout and "[event] fault_injected (step 2" in proc.stdout
    assert "[replica 0]" not in proc.stdout  # the groups' full output is in their files
    assert (folder / "logs" / "replica_0.log").read_text().count("---- ") == 3  # three starts of replica 0


def test_spare_is_promoted_after_a_kill(tmp_path, reference):
    """3 replicas and a spare: the spare holds no quota but applies every committed step; when replica 1 dies the
    spare computes its microbatch in the same step (the lowest load) and holds its share from the next step on,
    with no state to move."""
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=[fault(1, 2, "forward")],
                                extra=(*EXACT, "--recover.spares", "1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(of(events, "fault_injected")) == 1
    logged = metrics_by_replica(tmp_path)
    spare = REPLICAS
    assert logged[spare][1]["recover/quota/3"] == 0 and logged[spare][1]["recover/computed_here"] == 0
    assert logged[spare][2]["recover/computed_here"] == 1 and logged[0][2]["recover/computed_here"] == 1
    promoted = of(events, "spare_promoted")
    assert promoted and {e["step"] for e in promoted} == {3} and all(e["spares"] == [spare] for e in promoted)
    assert logged[spare][3]["recover/quota/3"] == 1 and logged[spare][3]["recover/quota/1"] == 0
    assert not of(events, "state_transferred")  # a spare is warm: nothing to transfer
    assert sorted(logged[spare]) == list(range(1, STEPS + 1))
    assert_all_equal_reference(reference, tmp_path, events, replicas=[0, 2, spare])

