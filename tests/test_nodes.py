"""One launcher per node (docs/deploy.md "Running on many nodes"): two launchers on this machine play two nodes of
one job, with the same config and the same ``--rdzv-endpoint``; node 0 hosts the job's store and runs the
coordinator, each node runs and restarts its own replica groups, and both exit with the job's verdict."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import EXACT_REFERENCE, free_port
from replica_runs import (assert_all_equal_reference, launch_nodes, metrics_by_replica, node_options, of,
                          replica_job_args)
from titan_recover.recover.events import read_events
from titan_recover.recover.children import LAUNCHER_ENV, processes_of_run

pytestmark = pytest.mark.multiprocess

REPLICAS, STEPS = EXACT_REFERENCE["replicas"], EXACT_REFERENCE["steps"]


def output(proc) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


def sigterm_once_step_3_committed(folder, nodes: list[int]):
    """For ``launch_nodes``: SIGTERM to the launchers of ``nodes``, back to back, once step 3 was committed."""
    def preempt(procs, start) -> None:
        wait_for_commit(folder, 3, procs)
        for node in nodes:
            procs[node].send_signal(signal.SIGTERM)
    return preempt


def wait_for_event(folder, procs, what: str, matches) -> None:
    """Until an event of the run ``matches``; fails (naming ``what``) if a launcher of ``procs`` ended first or
    after 180 s."""
    deadline = time.monotonic() + 180
    while not any(matches(e) for e in read_events(folder / "events.jsonl")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), f"no {what}"
        time.sleep(0.1)


def wait_for_commit(folder, step: int, procs) -> None:
    wait_for_event(folder, procs, f"step {step} committed",
                   lambda e: e["event"] == "step_committed" and e["step"] >= step)


def test_two_nodes_a_replica_on_node_1_killed_is_recomputed_restarted_and_readmitted(tmp_path, exact_reference):
    """3 replica groups of 1 rank on 2 nodes (node 0: groups 0 and 1, and the store and the coordinator; node 1:
    group 2). Replica 2 is killed in step 3's forward: replicas 0 and 1 compute its microbatch in the same step, node
    1's launcher restarts it and it is admitted again. Then the coordinator is SIGKILLed once every replica is in
    step 6: node 0's launcher restarts it, it resumes from the store and the replicas never notice (no epoch
    change). Both launchers exit 0 and every replica ends bitwise equal to the failure-free one-node run."""
    faults = [{"kind": "kill", "replica": 2, "rank": 0, "step": 3, "phase": "forward"},
              {"kind": "kill", "process": "coordinator", "phase": "step", "step": 6, "incarnation": 0}]
    args = replica_job_args(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=faults,
                            extra=("--recover.quota.exact", "--recover.max_restarts", "1",
                                   "--recover.rejoin_wait_s", "150"))
    node0, node1 = launch_nodes(tmp_path, [(*args, *o) for o in node_options(2, f"127.0.0.1:{free_port()}")])
    assert node0.returncode == 0, output(node0)
    assert node1.returncode == 0, output(node1)
    assert "node 1 of 2: replica group 2" in node1.stderr and "[coordinator" not in node1.stdout
    assert "node 0 of 2: replica groups 0-1" in node0.stderr
    events = read_events(tmp_path / "events.jsonl")
    killed, coordinator = of(events, "fault_injected")
    assert (killed["replica"], killed["step"]) == (2, 3)
    assert coordinator["process"] == "coordinator" and coordinator["step"] >= 6
    starts = [(e["start"], e["action"]) for e in of(events, "coordinator_started")]
    assert starts == [(0, "form_first"), (1, "resume")]
    formed = {e["epoch"]: e for e in of(events, "epoch_formed")}
    assert sorted(formed) == [0, 1, 2]  # the kill and the admission; the coordinator's restart changed nothing
    assert formed[1]["members"] == [0, 1] and formed[1]["removed"] == [2]
    assert [(e["replica"], e["incarnation"]) for e in of(events, "replica_admitted")] == [(2, 1)]
    logged = metrics_by_replica(tmp_path)
    assert sorted(logged[0]) == sorted(logged[1]) == list(range(1, STEPS + 1))
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=range(REPLICAS))
    assert processes_of_run(str(tmp_path)) == []


def test_two_nodes_a_frozen_node_replaced_then_thawed_ends_by_itself_and_evicts_nobody(tmp_path, exact_reference):
    """Node 1 (group 2) freezes once step 2 was committed: its launcher and every process it started are stopped
    (SIGSTOP; a host that hangs, or is cut off, then comes back). The coordinator drops group 2, a new node-1 launcher
    is started in its place and its group admitted; then the frozen processes resume. The thawed start of replica 2
    writes its old beat under the group's key: that is no news of the member (the replacement's start), which is not
    dropped; the thawed launcher finds another launcher named in its node's key and ends, with its own processes
    only, restarting nothing. The two live launchers exit 0, the thawed one 1 saying why, and every replica ends
    bitwise equal to the failure-free one-node run."""
    args = replica_job_args(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=[],
                            extra=("--recover.quota.exact", "--recover.max_restarts", "1",
                                   "--recover.rejoin_wait_s", "150"))
    options = node_options(2, f"127.0.0.1:{free_port()}")

    def freeze_replace_and_thaw(procs, start) -> None:
        wait_for_commit(tmp_path, 2, procs)
        frozen = processes_of_run(str(tmp_path), node=1)
        with open(f"/proc/{frozen[0]}/environ", "rb") as environ:  # every process of node 1 names its launcher
            launcher = [int(v.split(b"=")[1]) for v in environ.read().split(b"\0")
                        if v.startswith(LAUNCHER_ENV.encode() + b"=")][0]
        frozen.append(launcher)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        start((*args, *options[1]))
        wait_for_event(tmp_path, [procs[0], procs[-1]], "admission of the replacement",
                       lambda e: e["event"] == "replica_admitted")
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)

    node0, thawed, replacement = launch_nodes(tmp_path, [(*args, *o) for o in options],
                                              while_running=freeze_replace_and_thaw)
    assert node0.returncode == 0, output(node0)
    assert replacement.returncode == 0, output(replacement)
    assert thawed.returncode == 1, output(thawed)
    assert "node 1's launcher was replaced by" in thawed.stderr and "restarting" not in thawed.stderr, thawed.stderr
    events = read_events(tmp_path / "events.jsonl")
    assert [e["removed"] for e in of(events, "epoch_formed") if e["removed"]] == [[2]]  # the replacement stayed
    assert [(e["replica"], e["incarnation"]) for e in of(events, "replica_admitted")] == [(2, 1)]
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=range(REPLICAS))
    assert processes_of_run(str(tmp_path)) == []


def test_two_nodes_a_preemption_notice_to_node_1_ends_its_group_and_node_0_trains_on(tmp_path, exact_reference):
    """3 replica groups of 1 rank on 2 nodes (node 1: group 2), ``[recover] preemption_grace_s``: SIGTERM to node 1's
    launcher once step 3 was committed (what Kubernetes sends an evicted pod). Node 1's loss is survivable (node 0
    holds the job's store), so its group leaves as a lost node's does, at once: node 1 exits 143 saying so, replicas
    0 and 1 compute its microbatches and train to the end, node 0 exits 0, and both end bitwise equal to the
    failure-free one-node run. The job, now with fewer groups on fewer nodes, writes a durable checkpoint of the next
    step it commits, whatever the interval says (docs/replica_groups.md "Checkpoints")."""
    args = replica_job_args(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=[],
                            extra=("--recover.quota.exact", "--checkpoint.enable",
                                   "--recover.preemption_grace_s", "60"))

    node0, node1 = launch_nodes(tmp_path, [(*args, *o) for o in node_options(2, f"127.0.0.1:{free_port()}")],
                                while_running=sigterm_once_step_3_committed(tmp_path, nodes=[1]))
    assert node1.returncode == 128 + signal.SIGTERM, output(node1)
    assert "stopped by SIGTERM, a preemption notice to node 1, whose loss the job survives" in node1.stderr
    assert node0.returncode == 0, output(node0)
    events = read_events(tmp_path / "events.jsonl")
    assert not of(events, "stopped")  # the job was not stopped: it lost a node
    removed = [r for e in of(events, "epoch_formed") for r in e["removed"]]
    assert removed == [2]
    saved = [(e["source"], e["step"]) for e in of(events, "checkpoint_on_request")]
    assert len(saved) == 1 and saved[0][0] == "0/0" and 3 <= saved[0][1] < STEPS, saved
    assert (tmp_path / "checkpoint" / f"step-{saved[0][1]}" / ".metadata").is_file()
    logged = metrics_by_replica(tmp_path)
    assert sorted(logged[0]) == sorted(logged[1]) == list(range(1, STEPS + 1))
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=[0, 1])
    assert processes_of_run(str(tmp_path)) == []


def test_two_nodes_on_etcd_the_standby_coordinator_takes_over(tmp_path, etcd_server):
    """The same two-node job on an etcd store, 2 replica groups of 1 rank, 4 steps: nobody hosts the store, each
    node runs a coordinator candidate; the leader (whichever node's) is killed in step 2, a standby takes over (the
    other node's, waiting on the leader's key, or the restarted one's) and resumes the stored state. Both launchers
    exit 0, the replicas end identical, and the job's keys live under the run folder's prefix."""
    faults = [{"kind": "kill", "process": "coordinator", "phase": "step", "step": 2, "incarnation": 0}]
    args = replica_job_args(tmp_path, replicas=2, ranks=1, steps=4, faults=faults,
                            extra=("--recover.store", f"etcd://{etcd_server}"))
    node0, node1 = launch_nodes(tmp_path, [(*args, *o) for o in node_options(2)])
    assert node0.returncode == 0, output(node0)
    assert node1.returncode == 0, output(node1)
    assert f"the job's store: etcd://{etcd_server}/titan_recover/{tmp_path.name}/" in node1.stderr
    events = read_events(tmp_path / "events.jsonl")
    elected = of(events, "coordinator_elected")
    assert [e["start"] for e in elected][:2] == [0, 1], elected  # the first leader, then the one that took over
    # a leader may lose its lease on a loaded machine (no refresh answered in 1.5 s): another takes over, as after the
    # kill; every later election must follow such a loss, named in the events
    lost = of(events, "coordinator_lost_leadership")
    assert len(elected) == 2 + len(lost), (elected, lost)
    actions = [e["action"] for e in of(events, "coordinator_started")]
    assert actions[:2] == ["form_first", "resume"] and set(actions[2:]) <= {"resume", "finish"}, actions
    finals = of(events, "final_parameters")
    assert sorted(e["replica"] for e in finals) == [0, 1] and len({e["sha256"] for e in finals}) == 1
    assert processes_of_run(str(tmp_path)) == []


def test_two_nodes_on_etcd_both_preempted_at_once_stop_the_job_with_a_checkpoint(tmp_path, etcd_server):
    """2 replica groups on 2 nodes on etcd (neither node's loss ends the job), ``preemption_grace_s``: SIGTERM to both
    launchers at once, what a whole job's preemption sends. Each marks itself preempted; one whose marks leave fewer
    than ``min_replicas`` groups on nodes not preempted keeps its group and stops the whole job: a durable checkpoint
    of the last committed step is written, and both launchers exit 143."""
    args = replica_job_args(tmp_path, replicas=2, ranks=1, steps=1000, faults=[],
                            extra=("--recover.store", f"etcd://{etcd_server}", "--checkpoint.enable",
                                   "--checkpoint.interval", "1000", "--recover.preemption_grace_s", "60"))

    nodes = launch_nodes(tmp_path, [(*args, *o) for o in node_options(2)],
                         while_running=sigterm_once_step_3_committed(tmp_path, nodes=[0, 1]))
    assert [n.returncode for n in nodes] == [128 + signal.SIGTERM] * 2, "\n".join(output(n) for n in nodes)
    said = "".join(n.stderr for n in nodes)
    assert "the nodes not preempted run fewer than recover.min_replicas groups" in said, said[-3000:]
    events = read_events(tmp_path / "events.jsonl")
    committed = max(e["step"] for e in of(events, "step_committed"))
    stopped = of(events, "stopped")
    assert stopped and {e["step"] for e in stopped} == {committed} and any(e["checkpoint_saved"] for e in stopped)
    assert (tmp_path / "checkpoint" / f"step-{committed}" / ".metadata").is_file()
    assert processes_of_run(str(tmp_path)) == []
