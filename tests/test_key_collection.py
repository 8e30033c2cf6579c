"""The protocol's keys stay bounded over many steps (groups/collect.py, docs/replica_groups.md "Keys deleted").

Members are the project's own ``ReplicaMember`` and ``ReplicaSync`` in threads of this process (no heartbeat
thread, no training), running the real commit barrier step after step against the job's store: the embedded
TCPStore (fast) and etcd (the session's ``etcd_server``, multiprocess tier).
"""

from __future__ import annotations

import base64
import threading
import uuid
from datetime import timedelta

import pytest

from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.groups.keys import GroupKeys
from titan_recover.recover.groups.member import ReplicaMember
from titan_recover.recover.groups.replica_sync import ReplicaSync
from titan_recover.recover.stores import open_store

REPLICAS = 3


def members_of(address: str, epoch: int) -> list[ReplicaSync]:
    """One rank per replica, in ``epoch`` with every replica as a member (as after ``wait_for_epoch``)."""
    config = RecoverConfig(replicas=REPLICAS, collective_timeout_s=10.0)
    syncs = []
    for replica in range(REPLICAS):
        member = ReplicaMember(config, replica=replica, rank=0, ranks_per_replica=1, address=address)
        member.epoch, member.members, member.admitted = epoch, tuple(range(REPLICAS)), True
        syncs.append(ReplicaSync(config, member, events=None))
    return syncs


def decide(syncs: list[ReplicaSync], step: int | str) -> list[str | None]:
    """Every member runs the commit barrier of ``step`` at once; what each one read."""
    decisions = [None] * len(syncs)

    def run(i: int) -> None:
        decisions[i] = syncs[i].commit_barrier(step)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(syncs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return decisions


def commit(syncs: list[ReplicaSync], step: int | str) -> None:
    """Every member runs the commit barrier of ``step`` at once; every one must read ``commit``."""
    decisions = decide(syncs, step)
    assert decisions == ["commit"] * len(syncs), (step, decisions)


def move_to(syncs: list[ReplicaSync], epoch: int) -> None:
    for sync in syncs:
        sync.member.epoch = epoch


def etcd_keys(store) -> set[str]:
    """Every key of the store's job, read straight from etcd."""
    prefix = store.etcd_key("")
    reply = store.cluster.call(lambda c: c.post(c.get_url("/kv/range"), json={
        "key": base64.b64encode(prefix).decode(),
        "range_end": base64.b64encode(prefix[:-1] + bytes([prefix[-1] + 1])).decode(), "keys_only": True}))
    return {base64.b64decode(kv["key"])[len(prefix):].decode() for kv in reply.get("kvs", [])}


def test_every_key_of_an_epoch_is_under_its_own_keys_and_prefixes():
    keys, prefixes = GroupKeys.of_epoch(1)
    of_one = [GroupKeys.members(1), GroupKeys.fault(1), GroupKeys.join(1, 2), GroupKeys.joined_count(1),
              GroupKeys.reduced(1, 7), GroupKeys.decision(1, "admit7"), GroupKeys.admission(1), GroupKeys.admitted(1),
              GroupKeys.evicted(1, 2), GroupKeys.founding(1, 2), GroupKeys.group_prefix(1, 3, "transfer") + "/0"]
    of_ten = [GroupKeys.members(10), GroupKeys.fault(10), GroupKeys.join(10, 2), GroupKeys.joined_count(10),
              GroupKeys.reduced(10, 7), GroupKeys.decision(10, 7), GroupKeys.admission(10), GroupKeys.admitted(10),
              GroupKeys.evicted(10, 2), GroupKeys.founding(10, 2), GroupKeys.group_prefix(10, 3) + "/0",
              GroupKeys.EPOCH, GroupKeys.COORDINATOR_STATE, GroupKeys.heartbeat(1), GroupKeys.register(1, 0)]

    def collected(key: str) -> bool:
        return key in keys or any(key.startswith(p) for p in prefixes)

    assert all(map(collected, of_one)), [k for k in of_one if not collected(k)]
    assert not any(map(collected, of_ten)), [k for k in of_ten if collected(k)]


def test_a_commit_deletes_the_step_before_on_the_embedded_store():
    """TCPStore: the keys of the commit barrier stay those of the last step, however many steps commit (the
    older epochs' keys are not collected: the store cannot delete gloo's keys by prefix)."""
    server = open_store("127.0.0.1:0", timeout=timedelta(seconds=10), is_server=True)
    syncs = members_of(f"127.0.0.1:{server.port}", epoch=0)
    counts = []
    for step in range(0, 40):
        commit(syncs, step)
        counts.append(server.num_keys())
    assert len(set(counts[1:])) == 1, counts  # bounded: constant from the second commit on
    assert server.check([GroupKeys.reduced(0, 39), GroupKeys.decision(0, 39)])
    assert not any(server.check([key]) for step in range(39) for key in
                   (GroupKeys.reduced(0, step), GroupKeys.decision(0, step)))


def test_a_requested_checkpoint_rides_on_the_next_commit_decision_once():
    """A durable checkpoint asked for while the job trains on (a node leaving on a preemption notice) is in the next
    commit's decision, which every member reads, once for every request made before it; the commits after it carry
    none (docs/replica_groups.md "Checkpoints")."""
    from titan_recover.recover.groups.keys import request_checkpoint
    from titan_recover.recover.groups.protocol import CommitDecision

    server = open_store("127.0.0.1:0", timeout=timedelta(seconds=10), is_server=True)
    syncs = members_of(f"127.0.0.1:{server.port}", epoch=0)
    commit(syncs, 0)
    assert not server.check([GroupKeys.CHECKPOINT_REQUESTED])  # none asked for: no key made
    request_checkpoint(server)
    request_checkpoint(server)  # two before the next commit: one checkpoint serves both
    checkpoint = CommitDecision("commit", checkpoint=True).encode()
    assert decide(syncs, 1) == [checkpoint] * REPLICAS
    commit(syncs, 2)
    request_checkpoint(server)
    assert decide(syncs, 3) == [checkpoint] * REPLICAS
    commit(syncs, 4)
    assert int(server.add(GroupKeys.CHECKPOINT_SERVED, 0)) == int(server.add(GroupKeys.CHECKPOINT_REQUESTED, 0)) == 3


@pytest.mark.multiprocess
def test_keys_stay_bounded_over_many_steps_and_epochs_on_etcd(etcd_server):
    """etcd: 60 steps in epoch 0 leave the keys of the last step only; then the members are in epoch 2 (epochs 0
    and 1 left keys of every kind, epoch 10's must not be touched): the first commit in epoch 2 deletes every key
    of epochs 0 and 1 and nothing else."""
    address = f"etcd://{etcd_server}/titan_recover/collect-{uuid.uuid4().hex}"
    store = open_store(address, timeout=timedelta(seconds=10))
    store.set(GroupKeys.EPOCH, "0")
    store.set(GroupKeys.members(0), "0,1,2|all replicas registered")
    syncs = members_of(address, epoch=0)
    steady = {GroupKeys.EPOCH, GroupKeys.members(0)}
    for step in range(0, 60):
        commit(syncs, step)
        keys = etcd_keys(store)
        assert keys == steady | {GroupKeys.reduced(0, step), GroupKeys.decision(0, step)}, (step, sorted(keys))

    def every_kind(epoch: int) -> set[str]:
        return {GroupKeys.members(epoch), GroupKeys.fault(epoch), GroupKeys.join(epoch, 1),
                GroupKeys.joined_count(epoch), GroupKeys.reduced(epoch, 61), GroupKeys.decision(epoch, 61),
                GroupKeys.reduced(epoch, "admit60"), GroupKeys.admission(epoch), GroupKeys.admitted(epoch),
                GroupKeys.evicted(epoch, 1), GroupKeys.founding(epoch, 1), GroupKeys.group_prefix(epoch, 0) + "/0",
                GroupKeys.group_prefix(epoch, 2, "transfer") + "/rank_1"}

    old = every_kind(0) | every_kind(1)
    kept = every_kind(10) | {GroupKeys.members(2), GroupKeys.join(2, 0), GroupKeys.COORDINATOR_STATE}
    store.multi_set(sorted(old | kept), ["1"] * len(old | kept))
    move_to(syncs, 2)
    commit(syncs, 61)
    assert etcd_keys(store) == {GroupKeys.EPOCH} | kept | {GroupKeys.reduced(2, 61), GroupKeys.decision(2, 61)}
    for step in range(62, 70):  # the next commits in epoch 2 delete one step each, nothing else
        commit(syncs, step)
    assert etcd_keys(store) == {GroupKeys.EPOCH} | kept | {GroupKeys.reduced(2, 69), GroupKeys.decision(2, 69)}


def test_a_diloco_learner_keeps_two_claims_in_the_store():
    """Rank 0 shares each block it claims with the learner's other ranks (diloco/blocks.py); the claim two before
    goes, so a long job does not grow a key per inner step."""
    from torch.distributed import TCPStore

    from titan_recover.recover.diloco import blocks
    from titan_recover.recover.diloco.rules import DilocoKeys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    for count in range(10):
        blocks.share_claim(store, learner=1, incarnation=0, count=count, block=3 * count + 1)
        assert blocks.read_claim(store, learner=1, incarnation=0, count=count) == 3 * count + 1
    held = [count for count in range(10) if store.check([DilocoKeys.claim(1, 0, count)])]
    assert held == [8, 9]


def test_a_diloco_job_keeps_block_keys_only_for_blocks_given_back():
    """A block's done key and the hold key of the learner start that finished it (diloco/blocks.py) are deleted by
    the syncer once the block is below every block in training, except for blocks given back: a learner taken for
    lost may come back and try to finish one of those, and its hold's key must still say given back. Such a
    learner does not hold the collection back."""
    from torch.distributed import TCPStore

    from titan_recover.recover.diloco import blocks
    from titan_recover.recover.diloco.rules import DilocoKeys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))

    def done_keys(upto):
        return [b for b in range(upto) if store.check([DilocoKeys.done_of(b)])]

    def hold_keys(upto):
        return [(b, learner) for b in range(upto) for learner in range(3)
                if store.check([DilocoKeys.hold(b, learner, 0)])]

    # learners 0-2 claim and train blocks 0-5 in turn; learner 1 is still training block 4 when it is taken for
    # lost, and block 4 is given back
    for block in range(6):
        learner = block % 3
        assert blocks.claim_block(store, f"{learner}.0") == block
        blocks.record_training(store, learner, block, step=block // 3, incarnation=0)
        if block != 4:
            assert blocks.record_trained(store, learner, block, step=block // 3 + 1, incarnation=0, who=f"{learner}.0")
    assert blocks.requeue_block(store, 1, "syncer.0") == 4
    assert blocks.claim_block(store, "0.0") == 4  # learner 0 takes the given-back block and trains it
    blocks.record_training(store, 0, 4, step=2, incarnation=0)
    assert blocks.record_trained(store, 0, 4, step=3, incarnation=0, who="0.0")
    assert blocks.claim_block(store, "2.0") == 6
    blocks.record_training(store, 2, 6, step=2, incarnation=0)  # learner 2 trains block 6

    # a pass collects only below the claim counter the previous pass read (a block claimed since may not be named
    # by its learner's key yet): the first pass collects nothing
    assert blocks.collect_done(store, learners=3) == 0 and done_keys(7) == [0, 1, 2, 3, 4, 5]
    # learner 1's key still names block 4, given back: it cannot finish it, and block 6 is the lowest in training
    assert blocks.collect_done(store, learners=3) == 6
    assert done_keys(7) == [4]  # the given-back block keeps its key, one per failure
    assert hold_keys(7) == [(4, 0), (4, 1)]  # and both holds of it; the finishers' holds of 0-3 and 5 are gone
    assert not blocks.record_trained(store, 1, 4, step=2, incarnation=0, who="1.0")  # it comes back: refused
    assert blocks.blocks_trained(store) == 6  # 0-5, block 4 once
    blocks.record_trained(store, 2, 6, step=3, incarnation=0, who="2.0")
    assert blocks.collect_done(store, learners=3) == 7  # nothing in training: up to the claim counter
    assert done_keys(7) == [4] and blocks.blocks_trained(store) == 7 and hold_keys(7) == [(4, 0), (4, 1)]
    assert blocks.collect_done(store, learners=3) == 7  # the watermark is kept in the store
