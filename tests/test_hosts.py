"""Nodes on hosts of their own (tests/netns.py: a network namespace each, with its own address and host name, on a
shared bridge), so that every address the job advertises must be one the other hosts reach, and a host can be lost
as a powered-off one is: its link goes down and nothing answers, no reset, no signal (docs/deploy.md "A host cut
from the network")."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import EXACT_REFERENCE, free_port
from netns import hosts, unavailable
from replica_runs import assert_all_equal_reference, launch_nodes, metrics_by_replica, node_options, of, \
    replica_job_args
from test_nodes import output, wait_for_commit, wait_for_event
from titan_recover.recover.children import processes_of_run
from titan_recover.recover.events import read_events

pytestmark = pytest.mark.multiprocess

REPLICAS, STEPS = EXACT_REFERENCE["replicas"], EXACT_REFERENCE["steps"]


@pytest.fixture(scope="module")
def three_hosts():
    why = unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces on this machine: {why}")
    with hosts(3) as made:
        yield made


def on_hosts(made, placement: list[int]):
    """For ``launch_nodes``: the ``i``-th launcher started runs on host ``placement[i]``."""
    def command(i: int, args: tuple[str, ...]) -> list[str]:
        return made.command(placement[i], [sys.executable, "-m", "titan_recover.launch", *args])
    return command


def test_a_host_cut_from_the_network_is_dropped_ends_by_itself_and_a_spare_host_takes_its_place(
        tmp_path, exact_reference, three_hosts):
    """3 replica groups on 2 hosts (host 0: node 0, groups 0-1, the job's store and the coordinator; host 1: node 1,
    group 2). Once step 3 was committed host 1's link goes down. The coordinator finds group 2's beats stopped and
    drops it; replicas 0 and 1 compute its microbatches in the same step. On host 1 every request to the job's store
    goes unanswered (a TCPStore client alone would wait for as long as TCP retransmits, about 15 minutes): its
    launcher ends within the bound of a request, saying the store was lost, exit 1. A launcher of node rank 1 started
    on a spare host (host 2) runs group 2 again; it is admitted with a peer's state, streamed host to host. Node 0 and
    the spare exit 0 and every replica ends bitwise equal to the failure-free one-node run."""
    args = replica_job_args(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=[],
                            extra=("--recover.quota.exact", "--recover.max_restarts", "1",
                                   "--recover.rejoin_wait_s", "150"))
    options = node_options(2, f"{three_hosts.address(0)}:{free_port()}")
    cut = {}

    def cut_and_replace(procs, start) -> None:
        wait_for_commit(tmp_path, 3, procs)
        three_hosts.cut(1)
        cut["at"] = time.monotonic()
        start((*args, *options[1]))  # on host 2
        procs[1].wait(timeout=60)
        cut["ended_after_s"] = time.monotonic() - cut["at"]
        wait_for_event(tmp_path, [procs[0], procs[2]], "admission of the spare's group",
                       lambda e: e["event"] == "replica_admitted")

    node0, lost, spare = launch_nodes(tmp_path, [(*args, *o) for o in options], while_running=cut_and_replace,
                                      command=on_hosts(three_hosts, [0, 1, 2]))
    assert node0.returncode == 0, output(node0)
    assert spare.returncode == 0, output(spare)
    assert lost.returncode == 1, output(lost)
    assert f"the job's store at {options[0][-1]} was lost (no answer to a" in lost.stderr, lost.stderr[-3000:]
    assert cut["ended_after_s"] < 30, cut  # a request's bound (10 s) and the launcher's ending, not TCP's 15 minutes
    assert "node 1 of 2: replica group 2" in spare.stderr
    events = read_events(tmp_path / "events.jsonl")
    assert [e["removed"] for e in of(events, "epoch_formed") if e["removed"]] == [[2]]
    assert [(e["replica"], e["incarnation"]) for e in of(events, "replica_admitted")] == [(2, 1)]
    logged = metrics_by_replica(tmp_path)
    assert sorted(logged[0]) == sorted(logged[1]) == list(range(1, STEPS + 1))
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=range(REPLICAS))
    assert processes_of_run(str(tmp_path)) == []
