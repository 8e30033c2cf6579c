"""In-memory snapshots of a job without replicas (docs/phoenix.md "Buddy snapshots").

Pure: which step is restored. In one process against a real keeper store: a snapshot restores a fresh model
bitwise, and a send that failed midway leaves the previous snapshot the one restored; the device path (a side
stream's copy into a reused host buffer) with a fake stream whose copies happen only when their event is waited
for: the snapshot is published after its copy, and the optimizer step after it comes after the copy. End to end: a rank of a
tensor-parallel job is killed, torchrun restarts the job, every rank refills from the keeper, and the run logs the
failure-free run's loss at every step.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from conftest import free_port, LAYOUT_STEPS, launch, read_metrics, same_training
from test_state_transfer import Deferred, DeferredCopies, Replica
from titan_recover.recover.events import read_events
from titan_recover.recover.phoenix.snapshots import buddy_node, restore_step, Snapshots


def test_the_newest_step_every_rank_holds_is_restored_if_newer_than_the_durable_checkpoint():
    assert restore_step({0: {4, 5}, 1: {4, 5}}, 2, durable_step=0) == 5
    assert restore_step({0: {4, 5}, 1: {3, 4}}, 2, durable_step=0) == 4  # rank 1 died sending step 5
    assert restore_step({0: {4, 5}, 1: {4, 5}}, 2, durable_step=5) is None  # the durable checkpoint is as new
    assert restore_step({0: {4, 5}}, 2, durable_step=0) is None  # rank 1's snapshots are gone
    assert restore_step({0: {2}, 1: {5}}, 2, durable_step=0) is None  # nothing in common
    assert [buddy_node(n, 3) for n in range(3)] == [1, 2, 0] and buddy_node(0, 1) == 0


def test_snapshot_config_errors_say_what_to_change():
    from titan_recover.recover.config import RecoverConfig, SnapshotConfig

    with pytest.raises(ValueError, match="needs recover.max_restarts > 0"):
        RecoverConfig(snapshot=SnapshotConfig(interval=1))
    with pytest.raises(ValueError, match="without replicas"):
        RecoverConfig(replicas=2, max_restarts=1, snapshot=SnapshotConfig(interval=1))
    with pytest.raises(ValueError, match="HOST:PORT"):
        SnapshotConfig(interval=1, keepers=["node3"])
    assert RecoverConfig(max_restarts=1, snapshot=SnapshotConfig(interval=2)).snapshot.interval == 2


def test_the_keepers_are_listed_or_the_launchers_in_node_order_learnt_from_the_ranks():
    from titan_recover.recover.phoenix.snapshots import KEEPERS_ENV, keeper_addresses, NODE_KEEPER_ENV, SnapshotConfig

    def never(own):
        raise AssertionError("no gather where the keepers are known")

    listed = SnapshotConfig(interval=1, keepers=["a:1", "b:2"])
    assert keeper_addresses(listed, {NODE_KEEPER_ENV: "x:9"}, gather=never) == ["a:1", "b:2"]
    assert keeper_addresses(SnapshotConfig(interval=1), {KEEPERS_ENV: "127.0.0.1:5"}, gather=never) == ["127.0.0.1:5"]
    # many nodes: 3 nodes x 2 ranks; torchrun numbers the ranks node by node, in its rendezvous' node order, which
    # no launcher knows in advance: each rank says its own node's keeper, and node n's are ranks 2n and 2n+1
    said = ["c:3", "c:3", "a:1", "a:1", "b:2", "b:2"]
    assert keeper_addresses(SnapshotConfig(interval=1), {NODE_KEEPER_ENV: "c:3"}, gather=lambda own: said,
                            local_ranks=2) == ["c:3", "a:1", "b:2"]
    with pytest.raises(ValueError, match=r"the ranks of node 1 name different snapshot keepers \['a:1', 'b:2'\]"):
        keeper_addresses(SnapshotConfig(interval=1), {NODE_KEEPER_ENV: "c:3"},
                         gather=lambda own: ["c:3", "c:3", "a:1", "b:2"], local_ranks=2)
    with pytest.raises(ValueError, match=r"several nodes name the same snapshot keeper \['localhost:7'\]"):
        keeper_addresses(SnapshotConfig(interval=1), {NODE_KEEPER_ENV: "localhost:7"},
                         gather=lambda own: ["localhost:7", "localhost:7"], local_ranks=1)
    with pytest.raises(RuntimeError, match="no snapshot keeper: start the job with ./run_train.sh"):
        keeper_addresses(SnapshotConfig(interval=1), {}, gather=never)


@pytest.fixture
def keeper():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield f"127.0.0.1:{store.port}"


def test_a_snapshot_restores_a_fresh_replica_and_a_failed_send_keeps_the_previous(keeper, monkeypatch):
    from titan_recover.recover.groups import blobs

    monkeypatch.setattr(blobs, "PIECE_BYTES", 1000)  # several pieces per snapshot, as large states are stored
    trained = Replica(seed=0)
    snapshots = Snapshots(trained.state(), keepers=[keeper], rank=0, ranks=1, local_ranks=1, timeout_s=10)
    for batch in range(3):
        trained.train_step(batch)
    assert snapshots.take(trained.step)
    snapshots.wait()
    expected = {k: v.clone() for k, v in trained.model.state_dict().items()}
    trained.train_step(3)

    sent_data = []

    class DiesWhileSending:  # the rank dies after its data reached the keeper, before the completion mark
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            return getattr(self.store, name)

        def set(self, key, value):
            self.store.set(key, value)
            if "/data/" in key:  # a piece of the payload
                sent_data.append(key)
                raise ConnectionError("killed mid-send")

    snapshots.store = DiesWhileSending(snapshots.store)
    assert snapshots.take(trained.step)
    snapshots.wait()
    assert sent_data  # the second snapshot's bytes went out, its completion mark did not

    fresh = Replica(seed=1)
    restorer = Snapshots(fresh.state(), keepers=[keeper], rank=0, ranks=1, local_ranks=1, timeout_s=10)
    assert restorer.restore(durable_step=0) == 3
    assert fresh.step == 3
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert restorer.restore(durable_step=3) is None  # a durable checkpoint as new wins

    # the restored process's first snapshot goes to the other slot: dying while it is sent leaves step 3 whole
    restorer.store = DiesWhileSending(restorer.store)
    fresh.train_step(3)
    assert restorer.take(fresh.step)
    restorer.wait()
    again = Replica(seed=2)
    assert Snapshots(again.state(), keepers=[keeper], rank=0, ranks=1, local_ranks=1,
                     timeout_s=10).restore(durable_step=0) == 3


def test_a_keeper_that_is_gone_leaves_a_start_without_snapshots_not_a_failed_start():
    """The buddy keeper died (its port closed): the rank starts, its restore finds nothing and says so, and the
    durable checkpoint is what the job resumes from, at once: a refused connection is not retried until the
    requests' timeout (a TCPStore client alone retries it for all of ``timeout_s`` and once more after a back-off:
    over 60 s at the default)."""
    from torch.distributed import TCPStore as Store

    closed = Store("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    address = f"127.0.0.1:{closed.port}"
    del closed  # the keeper is gone
    snapshots = Snapshots(Replica(seed=0).state(), keepers=[address], rank=0, ranks=1, local_ranks=1, timeout_s=60)
    started = time.monotonic()
    assert snapshots.restore(durable_step=0) is None
    assert time.monotonic() - started < 10  # 60 s and more without the connection's probe; ~ms with it


def test_ranks_restore_a_snapshot_only_if_every_rank_picked_it_and_read_it_whole(keeper):
    """Two ranks of one job (their own states, as shards are) hold snapshots of steps 2 and 4. Rank 1's payload of
    step 4 is damaged in the keeper: it cannot restore it, and says so. The ranks agree on what to restore (a
    collective; here two threads exchanging their picks): neither restores anything, neither fails, and the job
    resumes from its durable checkpoint. Whole again, both restore step 4. Another job's name finds nothing."""
    import json

    from titan_recover.recover.phoenix.snapshots import SnapshotKeys

    trained = [Replica(seed=r) for r in range(2)]
    takers = [Snapshots(trained[r].state(), keepers=[keeper], rank=r, ranks=2, local_ranks=2, timeout_s=10)
              for r in range(2)]
    for step in range(4):
        for r in range(2):
            trained[r].train_step(2 * step + r)
            if step in (1, 3):
                assert takers[r].take(trained[r].step)
                takers[r].wait()
    expected = [{k: v.clone() for k, v in t.model.state_dict().items()} for t in trained]

    def restore_on_both_ranks(job: str = "job"):
        fresh, picks, barrier, results = [Replica(seed=10 + r) for r in range(2)], {}, threading.Barrier(2), {}

        def agree_as(rank):
            def agree(pick):
                picks[rank] = pick
                barrier.wait(10)
                return min(picks.values()), max(picks.values())
            return agree

        restorers = [Snapshots(fresh[r].state(), keepers=[keeper], rank=r, ranks=2, local_ranks=2, timeout_s=10,
                               agree=agree_as(r), job=job) for r in range(2)]
        threads = [threading.Thread(target=lambda r=r: results.update({r: restorers[r].restore(durable_step=0)}))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        return [results[r] for r in range(2)], fresh

    store = takers[1].store
    meta_key = SnapshotKeys.meta("job", 1, 1)  # step 4 went to the second slot
    whole = store.get(meta_key)
    store.set(meta_key, json.dumps(dict(json.loads(whole), xxh3="0" * 16)))  # the payload no longer matches
    restored, fresh = restore_on_both_ranks()
    assert restored == [None, None] and [f.step for f in fresh] == [0, 0]
    assert not torch.equal(fresh[0].model.state_dict()["0.weight"], expected[0]["0.weight"])
    store.set(meta_key, whole)
    restored, fresh = restore_on_both_ranks()
    assert restored == [4, 4] and [f.step for f in fresh] == [4, 4]
    for r in range(2):
        for name, value in fresh[r].model.state_dict().items():
            assert torch.equal(value, expected[r][name]), (r, name)
    assert restore_on_both_ranks(job="another")[0] == [None, None]


def test_a_keeper_keeps_one_jobs_snapshots_per_rank_and_another_layouts_snapshot_is_not_restored(keeper):
    """A rank's first snapshot in a job deletes the snapshots the keeper holds of the job before it (keepers kept
    across jobs do not grow with every job). A snapshot of other parameters under this job's name (another model
    or sharding) is no pick: the rank resumes from its durable checkpoint instead of failing at the load."""
    from titan_recover.recover.phoenix.snapshots import SnapshotKeys

    def snapshot(replica, job):
        taker = Snapshots(replica.state(), keepers=[keeper], rank=0, ranks=1, local_ranks=1, timeout_s=10, job=job)
        replica.train_step(0)
        assert taker.take(replica.step)
        taker.wait()
        return taker.store

    store = snapshot(Replica(seed=0), job="first")
    first = [SnapshotKeys.meta("first", 0, 0), SnapshotKeys.data("first", 0, 0) + "/0"]  # its mark, its 1st piece
    assert all(store.check([key]) for key in first)
    snapshot(Replica(seed=0), job="second")
    assert not any(store.check([key]) for key in first)
    assert store.check([SnapshotKeys.meta("second", 0, 0)])

    wider = Replica(seed=1, hidden=32)  # another model under the second job's name
    restorer = Snapshots(wider.state(), keepers=[keeper], rank=0, ranks=1, local_ranks=1, timeout_s=10, job="second")
    assert restorer.restore(durable_step=0) is None and wider.step == 0


class GatedCopies(DeferredCopies):
    """A side stream whose copies the sending thread can only see complete once the test opens the gate."""

    def __init__(self, log):
        super().__init__(log)
        self.gate = threading.Event()

    def copy(self, pairs):
        event = GatedEvent(list(pairs), self.log, self.gate)
        self.pending.append(event)
        return event


class GatedEvent(Deferred):
    def __init__(self, pairs, log, gate):
        super().__init__(pairs, log)
        self.gate = gate

    def synchronize(self):
        if threading.current_thread() is not threading.main_thread():
            assert self.gate.wait(10)
        super().synchronize()


class LoggedStore:
    def __init__(self, store, log):
        self.store, self.log = store, log

    def __getattr__(self, name):
        return getattr(self.store, name)

    def set(self, key, value):
        self.store.set(key, value)
        if key.endswith("/meta"):
            self.log.append("published")


def test_on_a_device_the_copy_runs_on_a_side_stream_into_one_reused_buffer_and_is_published_after_it(keeper):
    log: list[str] = []
    copies = GatedCopies(log)
    trained = Replica(seed=0)
    snapshots = Snapshots(trained.state(), keepers=[keeper], rank=0, ranks=1, local_ranks=1, timeout_s=10,
                          copies=copies)
    snapshots.store = LoggedStore(snapshots.store, log)
    trained.train_step(0)
    copies.gate.set()
    assert snapshots.take(trained.step)
    snapshots.wait()
    assert log == ["copied", "published"]  # hashed and published only once the copy's event completed
    first = snapshots._payload

    # the next snapshot: the copy is still in flight when the next optimizer step is due
    copies.gate.clear()
    trained.train_step(1)
    expected = {k: v.clone() for k, v in trained.model.state_dict().items()}
    assert snapshots.take(trained.step)
    snapshots.before_optimizer()  # the step's kernels queue after the copy (here: the fake completes it now)
    trained.train_step(2)
    copies.gate.set()
    snapshots.wait()
    assert log == ["copied", "published"] * 2
    assert copies.allocated == 1 and snapshots._payload is first  # one host buffer, reused

    fresh = Replica(seed=1)
    restorer = Snapshots(fresh.state(), keepers=[keeper], rank=0, ranks=1, local_ranks=1, timeout_s=10)
    assert restorer.restore(durable_step=0) == 2
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, expected[name]), name  # the state of step 2, not the one step 3 made


@pytest.mark.multiprocess
def test_killed_rank_of_a_tensor_parallel_job_refills_from_the_keeper(tmp_path, tp_reference, seed_checkpoint):
    reference, _ = tp_reference  # train_configs/tp.toml, failure-free, LAYOUT_STEPS steps from the seed checkpoint
    common = same_training(seed_checkpoint, 1)
    run = tmp_path / "run"
    proc = launch("train_configs/tp.toml", *common, "--dump_folder", str(run), "--recover.max_restarts", "1",
                  "--recover.snapshot.interval", "1",
                  "--chaos.faults", '[{kind = "kill", replica = 0, rank = 1, step = 4, phase = "forward"}]',
                  timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    restored, logged = refilled_with_the_failure_free_losses(run, reference)
    assert any(len(losses) == 2 for losses in logged.values()) or restored[0]["step"] == 3


def refilled_with_the_failure_free_losses(run, reference) -> tuple[list[dict], dict[int, list[float]]]:
    """Rank 1 killed once, at step 4; every rank refilled from the same snapshot; the steps after it trained twice
    (before the kill and after the restart): both times, and every other step, with exactly the failure-free loss.
    Returns the ``snapshot_restored`` events and the losses logged per step."""
    events = read_events(run / "events.jsonl")
    assert [(e["rank"], e["step"]) for e in events if e["event"] == "fault_injected"] == [(1, 4)]
    restored = [e for e in events if e["event"] == "snapshot_restored"]
    assert sorted(e["rank"] for e in restored) == [0, 1]
    assert {e["step"] for e in restored} == {restored[0]["step"]} and 1 <= restored[0]["step"] <= 3
    ref = {r["step"]: r["loss_metrics/global_avg_loss"] for r in read_metrics(reference)}
    logged = collections.defaultdict(list)
    for record in read_metrics(run):
        logged[record["step"]].append(record["loss_metrics/global_avg_loss"])
    assert sorted(logged) == sorted(ref) == list(range(1, LAYOUT_STEPS + 1))
    assert all(loss == ref[s] for s, losses in logged.items() for loss in losses), (dict(logged), ref)
    return restored, logged


@pytest.mark.multiprocess
def test_on_two_nodes_each_ranks_snapshots_go_to_the_other_nodes_keeper_and_refill_it(tmp_path, tp_reference,
                                                                                       seed_checkpoint):
    """Two launchers as two nodes of one job (1 rank each, TP over both), torchrun's c10d rendezvous on this
    machine: each launcher starts its node's keeper, the ranks learn both, and each rank's snapshots go to the keeper
    of the node it does not run on (which the rank's own launcher did not start). Node 1's rank is killed; both
    torchruns restart their workers, which refill from the snapshots and log the failure-free losses."""
    reference, _ = tp_reference
    run, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    args = [*same_training(seed_checkpoint, 1), "--dump_folder", str(run), "--recover.max_restarts", "1",
            "--recover.snapshot.interval", "1", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--chaos.faults", '[{kind = "kill", replica = 0, rank = 1, step = 4, phase = "forward"}]']
    logs = [tmp_path / f"node{n}.log" for n in range(2)]  # files, not pipes: neither launcher waits on a reader
    nodes = [subprocess.Popen([sys.executable, "-m", "titan_recover.launch", "train_configs/tp.toml", *args],
                              stdout=log.open("w"), stderr=subprocess.STDOUT) for log in logs]
    try:
        for node in nodes:
            node.wait(timeout=240)
    finally:
        for node in nodes:
            node.kill()
    outputs = [log.read_text() for log in logs]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    own = [re.search(r"this node's snapshot keeper: (\S+)", o).group(1) for o in outputs]
    assert own[0] != own[1]
    for node, output in enumerate(outputs):  # every start of the rank this launcher ran (and restarted)
        buddies = set(re.findall(r"rank \d: snapshots go to node \d's keeper (\S+) \(of 2\)", output))
        assert buddies == {own[1 - node]}, output[-3000:]

    restored, _ = refilled_with_the_failure_free_losses(run, reference)
    assert {e["keeper"] for e in restored} == set(own)  # each rank's from the other node's keeper


def test_extremes_are_the_lowest_and_highest_of_each_value_in_one_all_reduce(tmp_path):
    """The ranks' agreement (the snapshot to restore, a diloco learner's versions): on one rank each value is both."""
    from titan_recover.recover.groups.agree import extremes

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert extremes([4, -1, 0], "cpu") == ([4, -1, 0], [4, -1, 0])
    finally:
        torch.distributed.destroy_process_group()
