"""Nodes on hosts of their own (tests/netns.py: a network namespace each, with its own address and host name, on a
shared bridge), so that every address the job advertises must be one the other hosts reach, and a host can be lost
as a powered-off one is: its link goes down and nothing answers, no reset, no signal (docs/deploy.md "A host cut
from the network")."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import EXACT_REFERENCE, free_port, running_etcd
from netns import hosts, unavailable
from replica_runs import assert_all_equal_reference, launch_nodes, metrics_by_replica, node_options, of, \
    replica_job_args
from test_nodes import output, wait_for_commit, wait_for_event
from titan_recover.recover.children import processes_of_run
from titan_recover.recover.events import read_events

pytestmark = pytest.mark.multiprocess

REPLICAS, STEPS = EXACT_REFERENCE["replicas"], EXACT_REFERENCE["steps"]
SHORT_STORE_TIMEOUT = ("--recover.agree_timeout_s", "15", "--recover.collective_timeout_s", "10")
"""The job's store is opened with ``agree_timeout_s``: a request to it unanswered this long (60 s by default) fails."""


@pytest.fixture
def three_hosts():
    """Three hosts, made for each test (a test cuts one)."""
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


class cut_and_replace_on_the_spare:
    """For ``launch_nodes`` (launchers on hosts 0, 1, then 2): once step 3 was committed, cut ``node``'s host from
    the network and start a launcher of that node rank on host 2 (the spare); wait for the cut launcher to end by
    itself (``ended_after_s`` after the cut; 60 s at most), then for an admission of the spare's groups."""

    def __init__(self, folder, hosts, args: tuple[str, ...], options: list[tuple[str, ...]], node: int):
        self.folder, self.hosts, self.args, self.options, self.node = folder, hosts, args, options, node
        self.ended_after_s = float("nan")

    def __call__(self, procs, start) -> None:
        wait_for_commit(self.folder, 3, procs)
        self.hosts.cut(self.node)
        cut_at = time.monotonic()
        start((*self.args, *self.options[self.node]))  # on host 2
        procs[self.node].wait(timeout=60)
        self.ended_after_s = time.monotonic() - cut_at
        wait_for_event(self.folder, [procs[1 - self.node], procs[2]], "admission of the spare's groups",
                       lambda e: e["event"] == "replica_admitted")


def test_a_host_cut_from_the_network_is_dropped_ends_by_itself_and_a_spare_host_takes_its_place(
        tmp_path, exact_reference, three_hosts):
    """3 replica groups on 2 hosts (host 0: node 0, groups 0-1, the job's store and the coordinator; host 1: node 1,
    group 2). Once step 3 was committed host 1's link goes down. The coordinator finds group 2's beats stopped and
    drops it; replicas 0 and 1 compute its microbatches in the same step. On host 1 every request to the job's store
    goes unanswered (a TCPStore client alone would wait for as long as TCP retransmits): its launcher ends within
    the bound of a request (the store's timeout, 15 s here), saying the store was lost, exit 1. A launcher of node
    rank 1 started on a spare host (host 2) runs group 2 again as its start 1 (the job's counter of its starts),
    admitted with a peer's state streamed host to host, spending no restart. Node 0 and the spare exit 0 and every
    replica ends bitwise equal to the failure-free one-node run."""
    args = replica_job_args(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=[],
                            extra=("--recover.quota.exact", "--recover.max_restarts", "1",
                                   "--recover.rejoin_wait_s", "150", *SHORT_STORE_TIMEOUT))
    options = node_options(2, f"{three_hosts.address(0)}:{free_port()}")
    cut = cut_and_replace_on_the_spare(tmp_path, three_hosts, args, options, node=1)
    node0, lost, spare = launch_nodes(tmp_path, [(*args, *o) for o in options], while_running=cut,
                                      command=on_hosts(three_hosts, [0, 1, 2]))
    assert node0.returncode == 0, output(node0)
    assert spare.returncode == 0, output(spare)
    assert lost.returncode == 1, output(lost)
    assert f"the job's store at {options[0][-1]} was lost (no answer to a" in lost.stderr, lost.stderr[-3000:]
    assert cut.ended_after_s < 30  # a request's bound (15 s) and the launcher's ending, not TCP's give-up
    assert "node 1 of 2: replica group 2" in spare.stderr
    # the spare's group is the group's start 1 (the job's counter of its starts), never taken for the cut start 0
    assert "dropped" not in spare.stderr and "restarting" not in spare.stderr, spare.stderr
    events = read_events(tmp_path / "events.jsonl")
    assert [e["removed"] for e in of(events, "epoch_formed") if e["removed"]] == [[2]]
    assert [(e["replica"], e["incarnation"]) for e in of(events, "replica_admitted")] == [(2, 1)]
    logged = metrics_by_replica(tmp_path)
    assert sorted(logged[0]) == sorted(logged[1]) == list(range(1, STEPS + 1))
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=range(REPLICAS))
    assert processes_of_run(str(tmp_path)) == []


def test_a_host_cut_off_for_seconds_comes_back_and_its_group_is_restarted_and_readmitted(
        tmp_path, exact_reference, three_hosts):
    """The same two hosts; host 1's link goes down once step 3 was committed and comes back 5 s later (a switch that
    restarts, a flapping port), shorter than any request bound. Group 2 is dropped meanwhile (its beats stopped for
    ``heartbeat_timeout_s``) and the others train on; when the link is back its requests are answered: node 1's
    launcher reads the drop and ends it, or it finds its epoch over and ends by itself, whichever comes first; the
    launcher restarts it (one of ``max_restarts``) and it is admitted with a peer's state.
    Both launchers exit 0 and every replica ends bitwise equal to the failure-free one-node run."""
    args = replica_job_args(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=[],
                            extra=("--recover.quota.exact", "--recover.max_restarts", "1",
                                   "--recover.rejoin_wait_s", "150", *SHORT_STORE_TIMEOUT))
    options = node_options(2, f"{three_hosts.address(0)}:{free_port()}")

    def cut_for_five_seconds(procs, start) -> None:
        wait_for_commit(tmp_path, 3, procs)
        three_hosts.cut(1)
        time.sleep(5)
        three_hosts.heal(1)

    node0, node1 = launch_nodes(tmp_path, [(*args, *o) for o in options], while_running=cut_for_five_seconds,
                                command=on_hosts(three_hosts, [0, 1]))
    assert node0.returncode == 0, output(node0)
    assert node1.returncode == 0, output(node1)
    assert ": restarting it (start 1, 0 restart(s) left)" in node1.stderr, node1.stderr[-3000:]
    events = read_events(tmp_path / "events.jsonl")
    assert [e["removed"] for e in of(events, "epoch_formed") if e["removed"]] == [[2]]
    assert [(e["replica"], e["incarnation"]) for e in of(events, "replica_admitted")] == [(2, 1)]
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=range(REPLICAS))
    assert processes_of_run(str(tmp_path)) == []


@pytest.fixture
def etcd_on_the_bridge(three_hosts, tmp_path_factory):
    """An etcd member at the machine's address on the hosts' bridge (reached by every host; it is not cut)."""
    with running_etcd(tmp_path_factory.mktemp("etcd_bridge"), three_hosts.MACHINE) as endpoint:
        yield endpoint


def test_on_etcd_node_0s_host_cut_off_the_job_goes_on_and_a_spare_host_takes_its_place(
        tmp_path, exact_reference, three_hosts, etcd_on_the_bridge):
    """3 replica groups on 2 hosts on etcd (host 0: node 0, groups 0-1, a coordinator; host 1: node 1, group 2, a
    coordinator), etcd on the machine. Once step 3 was committed host 0's link goes down: its coordinator, if it
    led, still runs but can no longer renew its lease, so node 1's standby leads once it lapses; it drops groups 0-1
    and replica 2 computes every microbatch. Host 0's launcher finds etcd silent and ends by itself, exit 1. A node-0
    launcher started on a spare host (host 2) joins the running job (node 1 keeps its announcement) once the cut
    launcher's node key lapses, and its groups are admitted with replica 2's state. Node 1 and the spare exit 0 and
    every replica ends bitwise equal to the failure-free one-node run."""
    args = replica_job_args(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=[],
                            extra=("--recover.quota.exact", "--recover.max_restarts", "1",
                                   "--recover.rejoin_wait_s", "150", "--recover.store", f"etcd://{etcd_on_the_bridge}"))
    options = node_options(2)
    cut = cut_and_replace_on_the_spare(tmp_path, three_hosts, args, options, node=0)
    lost, node1, spare = launch_nodes(tmp_path, [(*args, *o) for o in options], while_running=cut,
                                      command=on_hosts(three_hosts, [0, 1, 2]))
    assert lost.returncode == 1, output(lost)
    assert "the job's store at etcd://" in lost.stderr and "was lost" in lost.stderr, lost.stderr[-3000:]
    assert cut.ended_after_s < 25  # etcd's request timeout (10 s), then the launcher's ending
    assert_node_0s_groups_rejoined_on_etcd(tmp_path, node1, spare, exact_reference)


def assert_node_0s_groups_rejoined_on_etcd(folder, node1, replacement, exact_reference) -> None:
    """After node 0 of an etcd job of 3 groups (node 0: 0-1, node 1: 2) was lost and replaced: node 1 exited 0, the
    replacement joined the running job and restarted nothing, node 0's groups were removed once each and admitted
    as their starts 1, replica 2 logged every step, every replica ends bitwise equal to the failure-free run, and no
    process of the run is left."""
    assert node1.returncode == 0, output(node1)
    assert replacement.returncode == 0, output(replacement)
    job = [line for line in node1.stderr.splitlines() if "the job's store: etcd://" in line][0].split("store: ")[1]
    assert f"node 0 of 2: replica groups 0-1; the job's store: {job}" in replacement.stderr, replacement.stderr
    assert "restarting" not in replacement.stderr, replacement.stderr
    events = read_events(folder / "events.jsonl")
    # node 0's groups are removed once each, in one epoch or two (a lost launcher's groups do not end at the same
    # instant: one may still join the epoch formed when the other was found gone)
    assert sorted(r for e in of(events, "epoch_formed") for r in e["removed"]) == [0, 1]
    assert sorted((e["replica"], e["incarnation"]) for e in of(events, "replica_admitted")) == [(0, 1), (1, 1)]
    assert sorted(metrics_by_replica(folder)[2]) == list(range(1, STEPS + 1))
    assert_all_equal_reference(exact_reference, folder, events, replicas=range(REPLICAS))
    assert processes_of_run(str(folder)) == []
