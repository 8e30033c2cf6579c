"""Decoupled DiLoCo (docs/diloco.md): the syncer's rounds over real stores and threads, then a whole job with a
learner killed and restarted, a 3x straggler and a syncer crash."""

from __future__ import annotations

import collections
import json
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from conftest import read_metrics
from replica_runs import launch_nodes, node_options
from wandb_offline import read_run
from titan_recover.recover.diloco.rules import decode_versions, DilocoKeys, token_weights
from titan_recover.recover.events import read_events
from titan_recover.recover.children import processes_of_run
from titan_recover.recover.groups.keys import GroupKeys, read_dropped
from titan_recover.recover.groups.liveness import encode_group_beat, Heartbeat


def _config(*overrides: str):
    from titan_recover.job_config import build_config

    return build_config("train_configs/diloco.toml", ["--model.flavor", "tiny", "--metrics.no_enable_wandb",
                                                      *overrides])


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_syncer_merges_a_quorum_token_weighted_without_waiting_for_a_late_learner(tmp_path):
    """Three learners' send threads deliver to a real syncer store; learner 2 has been slow (3x the sync period)
    and is not waited for; the published global fragment is the Nesterov outer step on the token-weighted mean
    of the two deltas, bit for bit, and a pull thread fetches it."""
    from titan_recover.recover.diloco.messages import offer_parameters
    from titan_recover.recover.diloco.transport import Delta, DeltaSender, GlobalPuller
    from titan_recover.recover.diloco.syncer.rounds import Arrivals
    from titan_recover.recover.diloco.syncer.service import Syncer

    config = _config("--recover.diloco.outer_lr", "0.5", "--recover.diloco.outer_momentum", "0.9")
    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    address = f"127.0.0.1:{coordinator.port}"
    syncer = Syncer(config, coordinator_address=address, run_dir=str(tmp_path), ranks=1)
    syncer.publish_address()
    weights = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4)]
    offer_parameters(syncer.store, 0, 0, ["a", "b"], weights, [(0, 1), (1, 2)])
    offer_parameters(syncer.store, 1, 0, ["a", "b"], [w + 1 for w in weights], [(0, 1), (1, 2)])
    syncer.initialize(timeout_s=10)
    assert syncer.versions == [0, 0] and decode_versions(syncer.store.get(DilocoKeys.VERSIONS))[1] == [0, 0]
    for learner in (0, 1):  # both offers deleted once the global model is built (learner 0's was taken)
        prefix = DilocoKeys.init(learner, 0)
        assert not syncer.store.check([DilocoKeys.meta(prefix)]) and not syncer.store.check([f"{prefix}/0"])

    now = time.time()
    for learner in range(3):  # every learner is alive
        coordinator.set(GroupKeys.heartbeat(learner), encode_group_beat({0: Heartbeat(now + 60, now + 60, 1, "inner")}))
    syncer._judge_liveness()
    assert syncer.alive == {0, 1, 2}
    syncer.rounds.period_s[0] = 1.0  # what the syncer learned before: fragment 0's period is 1 s

    deltas = {0: torch.tensor([1.0, -2.0, 0.5, 0.0, 4.0, 1.0]), 1: torch.tensor([3.0, 0.0, -1.0, 2.0, 0.0, 1.0])}
    tokens = {0: 3072, 1: 1024}  # learner 0 trained three times the tokens since its last send
    senders = [DeltaSender(address, learner=i, incarnation=0, rank=0) for i in deltas]
    try:
        for sender, (i, d) in zip(senders, deltas.items()):
            sender.submit(Delta(0, 4, tokens[i], (syncer.generation, 0), d.clone()))
            assert sender.drain(timeout_s=10)
        _wait(lambda: syncer._receive(time.time()) >= 0 and len(syncer.rounds.open[0].deltas) == 2)
        # learner 2 sends every 3 s and sent 0.5 s before the merge (set at the merge's own time, so that how
        # long the deliveries took on a loaded machine does not move its next delivery)
        merge_at = time.time()
        syncer.rounds.arrivals[(2, 0)] = Arrivals(last_at=merge_at - 0.5, interval_s=3.0, tokens=1024)
        syncer._maybe_merge(0, merge_at)
    finally:
        for sender in senders:
            sender.stop()

    merged = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "fragment_merged"]
    assert len(merged) == 1, merged
    record = merged[0]
    assert record["learners"] == [0, 1] and record["version"] == 1
    assert record["weights"] == {"0": 0.75, "1": 0.25}
    assert record["waited_for"] == [] and "gain" in record["window_reason"]  # 2.5 s away: not worth the wait
    assert record["window_s"] == 0.0
    assert record["staleness"] == {"0": 0, "1": 0}
    # the outer step, by hand: Nesterov SGD's first step is p - lr * (1 + momentum) * g
    g = (deltas[0].double() * 0.75 + deltas[1].double() * 0.25).float()
    expected = weights[0].reshape(-1) - 0.5 * (g + 0.9 * g)
    puller = GlobalPuller(address, rank=0, fragments=2)
    try:
        _wait(lambda: puller.newest().get(0, ((0, 0),))[0] == (syncer.generation, 1))
        assert torch.equal(puller.newest()[0][1], expected)
        assert torch.equal(puller.newest()[1][1], weights[1])  # fragment 1 untouched, version 0
    finally:
        puller.stop()


def test_the_syncer_ends_the_job_once_every_node_reported_and_records_whether_the_budget_was_trained(tmp_path):
    """On two nodes the syncer waits for both launchers' reports that their learners ended; the job's verdict is
    ``trained`` only with every block of the budget counted, else it says why and how many. With nobody alive for
    ``startup_timeout_s`` (a node lost with its launcher reports nothing) it ends the job too."""
    from titan_recover.recover.diloco.syncer.service import Syncer

    config = _config("--training.steps", "4", "--recover.startup_timeout_s", "30")
    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    syncer = Syncer(config, coordinator_address=f"127.0.0.1:{coordinator.port}", run_dir=str(tmp_path), ranks=1,
                    nodes=2)
    budget = 4 * config.recover.replicas
    assert not syncer._over()
    coordinator.set(DilocoKeys.learners_over(0), "1")
    assert not syncer._over()  # node 1's learners may still train
    coordinator.add(DilocoKeys.BLOCKS_DONE, budget - 1)
    coordinator.set(DilocoKeys.learners_over(1), "1")
    assert syncer._over() and syncer.end_reason == "every learner ended"
    assert syncer.verdict() == f"every learner ended, with {budget - 1} of the budget's {budget} blocks trained"
    coordinator.add(DilocoKeys.BLOCKS_DONE, 1)
    assert syncer.verdict() == "trained"

    lost = Syncer(config, coordinator_address=f"127.0.0.1:{coordinator.port}", run_dir=str(tmp_path), ranks=1,
                  nodes=3)
    coordinator.add(DilocoKeys.BLOCKS_DONE, -budget)
    assert not lost._over()
    lost._someone_alive_at -= 31  # no learner alive for longer than startup_timeout_s
    assert lost._over() and lost.end_reason == "no learner was alive for 30.0 s (recover.startup_timeout_s)"


def test_a_syncer_resumes_the_newest_generations_checkpoint_and_never_starts_afresh_without_it(tmp_path):
    """Each generation saves its own checkpoint and deletes the older ones; a deposed syncer's late save (an older
    generation) is never the one resumed. A syncer that finds no checkpoint where the store says one was saved (a
    run folder that is not shared by the node it runs on) refuses to start a new model, saying why."""
    from titan_recover.recover.diloco.syncer.checkpoint import load_checkpoint, save_checkpoint, saved_generations
    from titan_recover.recover.diloco.syncer.service import MissingCheckpoint, Syncer

    run = str(tmp_path / "run")
    assert load_checkpoint(run) is None
    save_checkpoint({"merges": 3}, run, 1)
    save_checkpoint({"merges": 5}, run, 2)
    assert saved_generations(run) == [2] and load_checkpoint(run) == {"merges": 5}
    save_checkpoint({"merges": 4}, run, 1)  # generation 1, deposed, saves once more
    assert saved_generations(run) == [1, 2] and load_checkpoint(run) == {"merges": 5}

    config = _config("--training.steps", "4")
    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    coordinator.set(DilocoKeys.CHECKPOINTED, "2 5")
    elsewhere = Syncer(config, coordinator_address=f"127.0.0.1:{coordinator.port}", run_dir=str(tmp_path / "node1"),
                       ranks=1)
    with pytest.raises(MissingCheckpoint, match=r"syncer 1: syncer 2 saved a checkpoint \(after 5 merges\) that is "
                       r"not in .*node1/syncer: .* must be on a filesystem every node shares"):
        elsewhere.initialize(timeout_s=1.0)


@pytest.mark.parametrize("store", ["embedded", "etcd"])
def test_a_launcher_ends_a_hung_syncer_only_while_it_leads_and_restarts_a_dead_one(tmp_path, capsys, store):
    """The launcher's supervision of its syncer, with processes that only sleep in its place and a TCPStore for the
    job's store. Embedded store: the one syncer always leads; hung (no beat within its bound) it is killed, then
    restarted from its checkpoint. etcd: a standby that does not lead is never judged by the beat; once the store
    names it leader it is, and a dead one is restarted as a standby; one that led and lost the role but still runs
    (stopped) is ended once ``deposed_grace_s`` passed. With no restarts left it says so, once."""
    import signal
    import subprocess

    from titan_recover.recover.children import ReplicaSlot
    from titan_recover.recover.launcher import ReplicaJob

    etcd = ("--recover.store", "etcd://127.0.0.1:2379") if store == "etcd" else ()
    config = _config("--recover.startup_timeout_s", "0.3", "--recover.diloco.syncer_timeout_s", "0.3",
                     "--recover.diloco.syncer_max_restarts", "1", "--dump_folder", str(tmp_path), *etcd)
    commands = []

    class Sleeping(ReplicaJob):
        deposed_grace_s = 0.3

        def _start(self, cmd, env, prefix, death_signal=signal.SIGKILL, log=""):
            commands.append(cmd)
            proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
            self.children.append(proc)
            return proc

    job = Sleeping(config, None, [], 1, 0)
    job.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    try:
        job.syncer = ReplicaSlot(-1, 1)
        job.start_syncer()
        first = job.syncer.proc
        assert ("--standby" in commands[0]) == (store == "etcd")
        if store == "etcd":
            assert commands[0][commands[0].index("--identity") + 1].endswith("/node0/syncer0")
            job.store.set(DilocoKeys.SYNCER_LEADER, "elsewhere/node1/syncer0")
            job.supervise_syncer()
            time.sleep(0.5)  # past every bound: a standby that does not lead is not judged
            job.supervise_syncer()
            assert first.poll() is None and job.syncer.incarnation == 0
            job.store.set(DilocoKeys.SYNCER_LEADER, job.syncer_identity)
        job.supervise_syncer()  # watched from now (etcd: it leads now; held to startup_timeout_s until it beats)
        time.sleep(0.5)
        job.supervise_syncer()
        err = capsys.readouterr().err
        assert first.poll() == -signal.SIGKILL and "the syncer made no progress for" in err
        again = "as a standby" if store == "etcd" else "from its checkpoint"
        assert f"the syncer exited with -9: restarting it {again} (start 1, 0 restart(s) left)" in err
        assert job.syncer.proc is not first and job.syncer.proc.poll() is None
        if store == "etcd":
            assert commands[1][commands[1].index("--identity") + 1].endswith("/node0/syncer1")
        if store == "etcd":  # the restart leads, then another candidate takes the role while it is stopped
            second = job.syncer.proc
            job.store.set(DilocoKeys.SYNCER_LEADER, job.syncer_identity)
            job.supervise_syncer()
            job.store.set(DilocoKeys.SYNCER_LEADER, "elsewhere/node1/syncer1")
            job.supervise_syncer()
            assert second.poll() is None  # within the grace: a deposed candidate exits by itself
            time.sleep(0.4)
            job.supervise_syncer()
            assert second.poll() == -signal.SIGKILL
        else:
            job.syncer.proc.kill()
            job.syncer.proc.wait()
            job.supervise_syncer()
        job.supervise_syncer()
        err = capsys.readouterr().err
        assert ("this node's syncer lost the leadership" in err) == (store == "etcd")
        assert err.count("this node's syncer exited with -9 and has no restarts left") == 1
    finally:
        for child in job.children:
            child.kill()
            child.wait()


def test_a_syncers_first_evaluation_is_held_to_the_start_bound_until_its_first_microbatch_ends(tmp_path):
    """The first microbatch of a syncer process's first evaluation compiles (a FlexAttention model; ~35 s for the
    tiny model on CPU, docs/diloco.md), which may outlast ``syncer_timeout_s``. The syncer announces it in its
    beat; the launcher's watch holds that beat to ``startup_timeout_s``; the beat after the microbatch, written at
    once, is held to ``syncer_timeout_s`` again, and a later evaluation announces nothing."""
    from titan_recover.recover.children import BeatWatch
    from titan_recover.recover.diloco.syncer.service import Syncer

    config = _config("--recover.diloco.syncer_timeout_s", "10", "--recover.startup_timeout_s", "300")
    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    syncer = Syncer(config, coordinator_address=f"127.0.0.1:{coordinator.port}", run_dir=str(tmp_path), ranks=1)
    syncer.beat(at_once=True)
    watch = BeatWatch(b"", timeout_s=10.0, start_s=300.0)
    seen = []

    class Compiling:
        def loss(self, parameters, progress):
            for _ in range(2):  # two validation microbatches; each beat is read as the launcher reads it
                seen.append(watch.quiet_s(coordinator.get(DilocoKeys.SYNCER_BEAT), time.monotonic())[1])
                progress()
            seen.append(watch.quiet_s(coordinator.get(DilocoKeys.SYNCER_BEAT), time.monotonic())[1])
            return 1.0

    syncer.model.parameters = lambda: {"w": torch.ones(2)}
    syncer.evaluator = Compiling()
    assert syncer.evaluate(time.time()) == 1.0
    assert seen == [300.0, 10.0, 10.0]  # the compiling microbatch; the beat after it is written at once
    seen.clear()
    syncer.evaluate(time.time())
    assert seen == [10.0, 10.0, 10.0]  # compiled once per process
    assert coordinator.get(DilocoKeys.SYNCER_BEAT).decode().startswith(f"{syncer.generation}:")


@pytest.mark.multiprocess
def test_a_deposed_standby_syncer_writes_nothing_to_the_store_and_saves_no_global_model(tmp_path, etcd_server):
    """A syncer that leads through the election's fenced store (as ``--standby`` runs it) loses the role (its lease
    revoked, another candidate leads): its next write to the job's store is refused (``NotLeader``) and its end
    saves no global model over the new leader's."""
    import uuid

    from titan_recover.recover.diloco.syncer.checkpoint import global_model_path
    from titan_recover.recover.diloco.syncer.service import Syncer
    from titan_recover.recover.standby import lead
    from titan_recover.recover.stores import connect
    from titan_recover.recover.stores.etcd import NotLeader

    url = f"etcd://{etcd_server}/titan_recover/syncer-{uuid.uuid4().hex}"
    store = connect(url, 10.0)
    first = lead(store, DilocoKeys.SYNCER_LEADER, "node0/syncer0", over_key=GroupKeys.FINISHED)
    config = _config("--training.steps", "4")
    syncer = Syncer(config, coordinator=first.fenced(), run_dir=str(tmp_path), ranks=1, identity="node0/syncer0")
    assert syncer.generation == 1
    syncer.beat(at_once=True)
    first.resign()  # as a lapsed lease: the key is gone and the next candidate takes it
    second = lead(store, DilocoKeys.SYNCER_LEADER, "node1/syncer0", over_key=GroupKeys.FINISHED)
    try:
        refused = r"node0/syncer0 no longer holds .*diloco/syncer_leader.* \(node1/syncer0 holds it"
        with pytest.raises(NotLeader, match=refused):
            syncer.finish()
        assert not (tmp_path / global_model_path("")).exists()
        assert store.get(DilocoKeys.SYNCER_BEAT).decode().startswith("1:")  # its last beat, before it lost the role
        store.set(GroupKeys.FINISHED, "trained")
        assert lead(store, DilocoKeys.SYNCER_LEADER, "node2/syncer0", over_key=GroupKeys.FINISHED) is None
    finally:
        second.resign()


def test_the_syncer_gives_back_the_block_of_a_learner_whose_beat_stopped_never_one_its_restart_claimed(tmp_path):
    """Learners 0-2 beat; learner 1's beat stops while it trains block 1: once the syncer has watched it still for
    heartbeat_timeout_s it declares learner 1 lost and gives block 1 back. Learner 2's beat stops too, and its
    restart, before its first beat, gives back block 2 itself, trains it again and claims block 3: the syncer, which
    saw only start 0's beat go still, declares learner 2 lost but gives back nothing (block 3 is start 1's)."""
    from titan_recover.recover.diloco import blocks
    from titan_recover.recover.diloco.syncer.service import Syncer

    config = _config("--recover.heartbeat_timeout_s", "0.3", "--recover.join_window_s", "0.2")
    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    syncer = Syncer(config, coordinator_address=f"127.0.0.1:{coordinator.port}", run_dir=str(tmp_path), ranks=1)

    def beat(learner: int) -> None:
        now = time.time()
        coordinator.set(GroupKeys.heartbeat(learner), encode_group_beat({0: Heartbeat(now, now, 1, "inner")}))

    def judge_until_lost(learner: int, beating: tuple[int, ...]) -> None:
        deadline = time.monotonic() + 5
        while learner in syncer.alive:
            assert time.monotonic() < deadline, f"learner {learner} was never declared lost"
            for other in beating:
                beat(other)
            time.sleep(0.05)
            syncer._judge_liveness()

    for learner in range(3):
        assert blocks.claim_block(coordinator, f"{learner}.0") == learner
        blocks.record_training(coordinator, learner, learner, step=0, incarnation=0)
        beat(learner)
    syncer._judge_liveness()
    assert syncer.alive == {0, 1, 2}
    judge_until_lost(1, beating=(0, 2))
    assert syncer.alive == {0, 2}
    assert blocks.claim_block(coordinator, "0.0") == 1  # given back, and taken
    # learner 2 dies; before it beats, its restart gives back block 2, takes it again, then claims block 3
    assert blocks.requeue_block(coordinator, 2, "2.1") == 2
    assert blocks.claim_block(coordinator, "2.1") == 2 and blocks.claim_block(coordinator, "2.1") == 3
    blocks.record_training(coordinator, 2, 3, step=1, incarnation=1)
    judge_until_lost(2, beating=(0,))
    assert blocks.claim_block(coordinator, "0.0") == 4  # block 3 was not given back
    lost = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "learner_lost"]
    assert [(e["learner"], e["requeued_block"]) for e in lost] == [(1, 1), (2, None)]
    # learner 1's start, whose block was given back, is named dropped for its launcher to end (and restart);
    # learner 2's lost start gave nothing back and was not stuck: nothing named (its restart trains on)
    assert read_dropped(coordinator, 1)[0] == 0
    assert read_dropped(coordinator, 2) is None and read_dropped(coordinator, 0) is None


def test_a_learner_stopped_between_blocks_is_named_dropped_once_its_beat_stood_still_for_the_progress_timeout(
        tmp_path):
    """Learners 0-2 beat and hold no block. Learner 1's beat stops for longer than heartbeat_timeout_s and less than
    progress_timeout_s, then comes back (a pause): lost, then alive again, never named dropped. Learner 2's beat
    stops for good (SIGSTOP between blocks): lost at heartbeat_timeout_s with nothing to give back, then named
    dropped once its beat stood still for progress_timeout_s (its launcher ends and restarts it), once."""
    from titan_recover.recover.diloco.syncer.service import Syncer

    config = _config("--recover.heartbeat_timeout_s", "0.3", "--recover.join_window_s", "0.2",
                     "--recover.progress_timeout_s", "1.0")
    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    syncer = Syncer(config, coordinator_address=f"127.0.0.1:{coordinator.port}", run_dir=str(tmp_path), ranks=1)

    def judge_for(seconds: float, beating: tuple[int, ...]) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            now = time.time()
            for learner in beating:
                coordinator.set(GroupKeys.heartbeat(learner), encode_group_beat({0: Heartbeat(now, now, 1, "idle")}))
            time.sleep(0.05)
            syncer._judge_liveness()

    judge_for(0.2, beating=(0, 1, 2))
    assert syncer.alive == {0, 1, 2}
    judge_for(0.6, beating=(0,))  # both still, for more than heartbeat_timeout_s: lost, nothing given back
    assert syncer.alive == {0}
    assert read_dropped(coordinator, 1) is None and read_dropped(coordinator, 2) is None
    judge_for(0.3, beating=(0, 1))  # learner 1 is back before progress_timeout_s
    assert syncer.alive == {0, 1}
    judge_for(0.6, beating=(0, 1))  # learner 2 still for > 1 s in all
    assert read_dropped(coordinator, 2)[0] == 0 and read_dropped(coordinator, 1) is None
    judge_for(0.3, beating=(0, 1))
    stopped = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "learner_stopped"]
    assert [(e["learner"], e["start"]) for e in stopped] == [(2, 0)], stopped
    lost = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "learner_lost"]
    assert sorted((e["learner"], e["requeued_block"]) for e in lost) == [(1, None), (2, None)]


def test_a_learner_finishing_rank_by_rank_is_never_taken_for_stopped():
    """Learners of 2 ranks: learner 0's rank 0 reported done (its leader no longer relays beats) while rank 1 still
    waits for its last deltas; learner 1's beat just stopped. Both beats stay still past progress_timeout_s: only
    learner 1 is stopped."""
    from titan_recover.recover.diloco.syncer.liveness import LearnerLiveness

    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    liveness = LearnerLiveness(coordinator, learners=2, ranks=2, heartbeat_timeout_s=0.1, progress_timeout_s=0.3)
    now = time.time()
    for learner in (0, 1):
        beats = {rank: Heartbeat(now, now, 1, "idle") for rank in (0, 1)}
        coordinator.set(GroupKeys.heartbeat(learner), encode_group_beat(beats))
    coordinator.set(GroupKeys.done(0, 0), "1")
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        judged = liveness.judge()
        time.sleep(0.05)
    assert judged == (set(), set())  # neither alive (no beat), neither done
    assert liveness.stopped == {1: 0}


def test_a_learner_whose_main_thread_hangs_is_lost_and_finds_its_block_given_away_if_it_comes_back(tmp_path):
    """Learner 1's heartbeat thread beats on while its main thread makes no progress: the syncer declares it lost
    after ``progress_timeout_s`` of watched time and gives its block back. A learner out of blocks waits while a
    block is not counted trained, then takes the block; learner 1, coming back, cannot count it (its hold ended
    given back): it ends without sending the block's progress (``learner.BlockGivenBack``). A holder that stops
    between the two writes of counting its block has it counted by whoever finds its hold ended."""
    from titan_recover.recover.diloco import blocks
    from titan_recover.recover.diloco.syncer.service import Syncer

    config = _config("--recover.heartbeat_timeout_s", "0.3", "--recover.join_window_s", "0.2",
                     "--recover.progress_timeout_s", "0.6")
    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    syncer = Syncer(config, coordinator_address=f"127.0.0.1:{coordinator.port}", run_dir=str(tmp_path), ranks=1)
    stamps = {}

    def beat(learner: int, progress: bool) -> None:
        now = time.time()
        stamps[learner] = now if progress or learner not in stamps else stamps[learner]
        coordinator.set(GroupKeys.heartbeat(learner), encode_group_beat({0: Heartbeat(now, stamps[learner], 1, "x")}))

    for learner in range(2):
        assert blocks.claim_block(coordinator, f"{learner}.0") == learner
        blocks.record_training(coordinator, learner, learner, step=0, incarnation=0)
        beat(learner, progress=True)
    syncer._judge_liveness()
    assert syncer.alive == {0, 1}
    started, deadline = time.monotonic(), time.monotonic() + 5
    while 1 in syncer.alive:
        assert time.monotonic() < deadline, "learner 1 was never declared lost"
        beat(0, progress=True)
        beat(1, progress=False)
        time.sleep(0.05)
        syncer._judge_liveness()
    assert time.monotonic() - started >= 0.6 and syncer.alive == {0}
    [lost] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "learner_lost"]
    assert lost["requeued_block"] == 1 and "learner 1 rank(s) [0]: no progress (hung)" in lost["reason"], lost
    assert read_dropped(coordinator, 1)[0] == 0  # for its launcher to end the stuck start (and restart it)
    assert blocks.record_trained(coordinator, 0, 0, step=1, incarnation=0, who="0.0")
    assert blocks.blocks_trained(coordinator) == 1  # block 1 is given back, not trained: a learner out of blocks
    assert blocks.claim_requeued(coordinator, "0.0") == 1  # waits for it, and takes it
    blocks.record_training(coordinator, 0, 1, step=1, incarnation=0)
    assert not blocks.record_trained(coordinator, 1, 1, step=1, incarnation=0, who="1.0")  # learner 1 comes back
    assert blocks.requeue_block(coordinator, 1, "1.1") is None  # its restart: nothing more to give back
    assert blocks.record_trained(coordinator, 0, 1, step=2, incarnation=0, who="0.0")
    assert blocks.blocks_trained(coordinator) == 2
    assert blocks.requeue_block(coordinator, 0, "syncer.0") is None  # a hold that ended trained is not given back

    # learner 0 stops between the two writes of counting block 2 trained (its hold ended trained, the count not
    # made): whoever then finds the hold ended counts it for it, once, and keeps its keys
    assert blocks.claim_block(coordinator, "0.0") == 2
    blocks.record_training(coordinator, 0, 2, step=2, incarnation=0)
    assert blocks.set_once(coordinator, DilocoKeys.hold(2, 0, 0), "trained:0.0")
    assert blocks.requeue_block(coordinator, 0, "syncer.0") is None
    assert blocks.blocks_trained(coordinator) == 3 and coordinator.check([DilocoKeys.requeued_of(2)])
    assert blocks.requeue_block(coordinator, 0, "0.1") is None and blocks.blocks_trained(coordinator) == 3


@pytest.mark.multiprocess  # a store server in a process of its own, to stop
def test_a_send_and_a_pull_stuck_on_a_stopped_syncer_go_to_the_syncer_published_after_it():
    """A learner's send to, and pull from, a syncer whose process is stopped (SIGSTOP) block in the socket; once a
    newer syncer is published, the sender abandons that send and delivers the delta to the newer one (numbered from
    0 there), and the puller abandons that pull and fetches the newer one's fragment."""
    import signal
    import subprocess
    import sys

    from titan_recover.recover.diloco.messages import publish_fragment, take_delta
    from titan_recover.recover.diloco.transport import Delta, DeltaSender, GlobalPuller

    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    serve = ("import sys, time; from datetime import timedelta; from torch.distributed import TCPStore; "
             "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)); "
             "print(s.port, flush=True); time.sleep(120)")
    first = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    sender = puller = None
    try:
        port = int(first.stdout.readline())
        old = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
        publish_fragment(old, 0, 0, 0, torch.zeros(4))
        old.set(DilocoKeys.VERSIONS, "1 0")
        coordinator.set(DilocoKeys.SYNCER, f"127.0.0.1:{port} 1")
        address = f"127.0.0.1:{coordinator.port}"
        sender = DeltaSender(address, learner=0, incarnation=0, rank=0)
        puller = GlobalPuller(address, rank=0, fragments=1)
        sender.submit(Delta(0, 1, 10, (1, 0), torch.ones(4)))
        assert sender.drain(10.0) and sender.sent == 1
        _wait(lambda: 0 in puller.newest())
        first.send_signal(signal.SIGSTOP)
        big = torch.full((16 * 2**20,), 2.0)  # 64 MiB: more than the sockets buffer
        sender.submit(Delta(1, 2, 20, (1, 0), big))
        time.sleep(3.0)
        assert sender.pending() == 1 and sender.sent == 1  # stuck on the stopped syncer, no newer one yet
        assert puller.newest()[0][0] == (1, 0)
        second = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        publish_fragment(second, 0, 0, 0, torch.full((4,), 3.0))
        second.set(DilocoKeys.VERSIONS, "2 0")
        coordinator.set(DilocoKeys.SYNCER, f"127.0.0.1:{second.port} 2")
        assert sender.drain(20.0), "the delta never reached the newer syncer"
        assert sender.sent == 2 and sender.abandoned == 1
        # a store's set returns once sent: the server may still be reading the pieces
        second.wait([DilocoKeys.meta(DilocoKeys.delta(0, 0, 0, 0))], timedelta(seconds=10))
        delivered = take_delta(second, 0, 0, 0, 0)  # numbered from 0 in the newer syncer's store
        assert delivered is not None and delivered.fragment == 1 and delivered.tokens == 20
        assert torch.equal(delivered.data, big)
        _wait(lambda: puller.newest()[0][0] == (2, 0), timeout_s=20.0)
        assert torch.equal(puller.newest()[0][1], torch.full((4,), 3.0)) and puller.abandoned == 1
    finally:
        first.kill()
        first.wait()
        for thread in (sender, puller):
            if thread is not None:
                thread.stop()


def test_a_learner_withdraws_its_offer_even_one_whose_mark_was_never_written():
    from torch.distributed import HashStore

    from titan_recover.recover.diloco.messages import offer_parameters, withdraw_offer
    from titan_recover.recover.groups.blobs import pieces_of, put_blob

    store = HashStore()
    prefix = DilocoKeys.init(2, 0)
    nbytes = put_blob(store, prefix, torch.zeros(5 * 2**20, dtype=torch.uint8))  # 2 pieces, no mark (cut short)
    withdraw_offer(store, 2, 0)  # without a mark nobody else knows the size: nothing deleted
    assert store.check([f"{prefix}/0"])
    withdraw_offer(store, 2, 0, nbytes)  # the offerer knows it
    assert pieces_of(nbytes) == 2 and not any(store.check([f"{prefix}/{i}"]) for i in range(2))
    nbytes = offer_parameters(store, 2, 0, ["a"], [torch.ones(3)], [(0, 1)])
    withdraw_offer(store, 2, 0)  # a complete offer: its size from its mark
    assert nbytes == 12 and store.num_keys() == 0


def test_a_delta_queued_while_the_syncer_is_away_absorbs_the_next_one():
    from titan_recover.recover.diloco.transport import Delta

    first = Delta(1, 4, 100, (1, 3), torch.tensor([1.0, 2.0]))
    first.absorb(Delta(1, 8, 50, (1, 4), torch.tensor([0.5, -2.0])))
    assert (first.step, first.tokens, first.base) == (8, 150, (1, 3))  # the older base: the staleness is its
    assert first.data.tolist() == [1.5, 0.0]


def test_the_inbox_sums_a_ranks_pieces_until_every_rank_reached_the_same_step():
    """Learner 0 of 2 ranks: rank 0's send thread summed its deltas of fragment 1 at steps 50 and 100 (the syncer
    was slow), rank 1 sent them apart. Nothing is delivered until both ranks' pieces reach step 100; then one
    delivery of both steps' deltas from each rank, nothing left waiting."""
    from torch.distributed import HashStore

    from titan_recover.recover.diloco.messages import announce_sender, write_delta
    from titan_recover.recover.diloco.syncer.inbox import Inbox

    store = HashStore()
    for rank in (0, 1):
        announce_sender(store, 0, rank, 0)
    sent = {0: 0, 1: 0}

    def send(rank, step, tokens, base, values):
        write_delta(store, 0, 0, rank, sent[rank], fragment=1, step=step, tokens=tokens, base=base,
                    data=torch.tensor(values))
        sent[rank] += 1

    inbox = Inbox(store, learners=1, ranks=2)
    send(1, 50, 10, (1, 3), [1.0, 1.0])
    send(0, 100, 20, (1, 3), [3.0, 3.0])  # d50 + d100 of rank 0
    assert inbox.receive() == (2, [])
    send(1, 100, 10, (1, 4), [2.0, 2.0])
    received, delivered = inbox.receive()
    assert received == 1 and len(delivered) == 1 and inbox.partial == {}
    (delivery,) = delivered
    assert (delivery.fragment, delivery.step, delivery.tokens, delivery.base) == (1, 100, 20, (1, 3))
    assert [d.tolist() for d in delivery.deltas] == [[3.0, 3.0], [3.0, 3.0]]


def test_learner_blocks_and_schedule():
    from titan_recover.recover.diloco.rules import schedule_step, total_blocks

    assert total_blocks(steps=16, learners=3) == 48  # one inner step's microbatches per block
    # blocks are claimed in order, learners at a time: the schedule follows the job's progress
    assert [schedule_step(b, 3) for b in (0, 2, 3, 5, 6, 47)] == [1, 1, 2, 2, 3, 16]


@pytest.mark.multiprocess
def test_learners_on_two_nodes_never_wait_for_a_dead_or_slow_learner_or_the_syncer(tmp_path, etcd_server):
    """3 learners of the tiny model, H = 4, 2 fragments, on two nodes with an etcd store: two launchers on this
    machine (node 0: learners 0 and 1; node 1: learner 2), each running a coordinator candidate and a syncer
    candidate (docs/diloco.md "Standby syncers"). Learner 1 is killed at its step 30 and restarted by node 0's
    launcher; learner 2 is 3x slower from step 2. The first syncer to lead hangs (SIGSTOP) right after its 8th
    merge: its lease lapses and the other node's standby takes over from its checkpoint, without waiting for a
    launcher to see the hang; the stopped one's launcher ends it once it still runs 4 s after it lost the role (the
    learners' sends to its store fail then: they follow the new syncer), and restarts it as a standby. That second
    syncer is killed after merge 14: a standby takes over from its checkpoint (the first one's restart, or the
    second one's). Both launchers exit 0 once a syncer counted the budget trained. One node, or the embedded
    store, is the same code with one launcher's report of its learners' end and a syncer that node 0's launcher
    restarts.

    The launchers start together. On this 2-core machine node 1's three processes (coordinator, syncer, one
    learner) start before node 0's four: learner 2 may train alone at first and either node's syncer may lead
    first, as on a cluster whose nodes come up at different times; the claims below hold whatever the order."""
    # 192 blocks (one inner step each): about 30 s of training on 2 busy cores, longer than a takeover and a restart
    steps, period, learners = 64, 4, 3
    faults = [
        # step 30, not earlier: learners 0 and 1 start up to ~0.5 s apart on 2 busy cores (~7 steps of the tiny
        # model), and the straggler can only be seen not waited for while the other two fast learners are both alive
        {"kind": "kill", "replica": 1, "rank": 0, "step": 30, "phase": "forward"},
        {"kind": "slow", "replica": 2, "rank": 0, "step": 2, "factor": 3.0},
        {"kind": "hang", "process": "syncer", "step": 8, "phase": "merge"},  # the first syncer to lead
        {"kind": "kill", "process": "syncer", "step": 14, "phase": "merge", "incarnation": 1},  # the second
    ]
    fault_toml = "[" + ", ".join(
        "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in f.items()) + "}" for f in faults) + "]"
    max_window_s = 2.0
    syncer_timeout_s = 8.0  # well above a pass of the tiny model's syncer loop on 2 busy cores
    args = (
        "train_configs/diloco.toml", "--model.flavor", "tiny",
        "--training.steps", str(steps), "--recover.diloco.inner_steps", str(period),
        "--recover.diloco.max_window_s", str(max_window_s), "--recover.diloco.checkpoint_interval_s", "1",
        "--recover.diloco.eval_interval_s", "0", "--recover.heartbeat_timeout_s", "2.0",
        "--recover.diloco.syncer_timeout_s", str(syncer_timeout_s),
        "--dump_folder", str(tmp_path), "--chaos.faults", fault_toml, "--recover.store", f"etcd://{etcd_server}",
    )
    nodes = launch_nodes(tmp_path, [(*args, *o) for o in node_options(2)], timeout=300)
    node0, node1 = nodes
    assert node0.returncode == 0, node0.stdout[-4000:] + node0.stderr[-4000:]
    assert node1.returncode == 0, node1.stdout[-4000:] + node1.stderr[-4000:]
    assert "node 1 of 2: replica group 2" in node1.stderr
    events = read_events(tmp_path / "events.jsonl")
    by_kind = collections.defaultdict(list)
    for e in events:
        by_kind[e["event"]].append(e)

    # every learner fault fired; the syncer's fired, unless a syncer lost its lease first on this loaded machine (etcd
    # answered no refresh within 1.5 s: named in the events), which shifts which syncer reaches which merge
    fired = {(e.get("process", "trainer"), e["kind"], e["step"]) for e in by_kind["fault_injected"]}
    lost_lease = by_kind["syncer_lost_leadership"]
    assert {("trainer", "kill", 30), ("trainer", "slow", 2)} <= fired, fired
    assert fired - {("trainer", "kill", 30), ("trainer", "slow", 2)} <= {("syncer", "hang", 8), ("syncer", "kill", 14)}
    assert len(fired) == 4 or lost_lease, (fired, lost_lease)

    # the killed learner was restarted by its node's launcher; its block was given back and trained by a learner
    # alive. Whether its restart (process start-up: 20-30 s on 2 busy cores) comes back before the budget is trained
    # depends on the machine; when it does, it adopted every global fragment before training
    assert "replica 1 exited with" in node0.stderr and "restarting it" in node0.stderr
    starts = {(e["replica"], e["incarnation"]): e for e in by_kind["learner_started"]}
    assert {(0, 0), (1, 0), (2, 0)} <= set(starts) <= {(0, 0), (1, 0), (2, 0), (1, 1)}
    if (1, 1) in starts:
        assert all(v[1] >= 0 for v in starts[(1, 1)]["versions"])
        assert starts[(1, 1)]["step"] > 0  # its step count continues from its previous start's
    killed_block = max(e["block"] for e in by_kind["block_claimed"] if e["replica"] == 1 and e["incarnation"] == 0)
    given_back = [e["requeued_block"] for e in by_kind["learner_lost"] + list(starts.values())
                  if e.get("requeued_block") is not None]
    assert given_back == [killed_block]  # given back once, by the syncer or by the restart

    # data: every block of the budget was trained, each by one learner, except the one the dead learner held,
    # which a learner alive trained again
    claims = collections.Counter(e["block"] for e in by_kind["block_claimed"])
    assert sorted(claims) == list(range(steps * learners))
    assert {b: n for b, n in claims.items() if n > 1} == {killed_block: 2}
    retrained = [e for e in by_kind["block_claimed"] if e["block"] == killed_block][1]
    assert (retrained["replica"], retrained["incarnation"]) != (1, 0)

    # syncers led in turn (three, one more for each lost lease), each elected and resuming its predecessor's
    # checkpoint, each but the last ended by a fault or the loss of its lease. The hung one was deposed by its lease
    # (not for its beat: it no longer led) and the other node's standby took over; its launcher ended it and
    # restarted it as a standby; the killed one was restarted as a standby too
    started, elected = by_kind["syncer_started"], by_kind["syncer_elected"]
    assert [e["identity"] for e in started] == [e["identity"] for e in elected], (started, elected)
    assert [e["generation"] for e in started] == list(range(1, len(started) + 1)), started
    assert [e["resumed"] for e in started] == [False] + [True] * (len(started) - 1), started
    assert all(later["merges"] >= earlier["merges"] for earlier, later in zip(started, started[1:])), started
    syncer_faults = {e["generation"]: e for e in by_kind["fault_injected"] if e.get("process") == "syncer"}
    # what ended each leader but the last: a fault, or a lease lost first (then a fault scheduled for that leader
    # never fires, and the job has one start fewer than faults plus lost leases)
    ended = {**{e["generation"]: e for e in lost_lease}, **syncer_faults}
    assert sorted(ended) == list(range(1, len(started))), (ended, started)
    node = [int(e["identity"].split("/")[1].removeprefix("node")) for e in started]
    for g, fault in syncer_faults.items():
        assert started[g]["time"] > fault["time"]  # the next one led after it
        if fault["kind"] == "hang":  # its own node has no other candidate yet: the other node's took over
            deposed = nodes[node[g - 1]].stderr
            assert node[g] != node[g - 1], node
            assert "this node's syncer lost the leadership" in deposed and "restarting it as a standby" in deposed
        else:
            assert "the syncer exited with -9: restarting it as a standby" in nodes[node[g - 1]].stderr
    assert all("the syncer made no progress" not in n.stderr for n in nodes)
    merges = by_kind["fragment_merged"]
    assert [e["generation"] for e in merges] == sorted(e["generation"] for e in merges)
    assert len({e["generation"] for e in merges}) >= 2
    assert len(by_kind["syncer_finished"]) == 1 and by_kind["syncer_finished"][0]["generation"] == len(started)

    # nobody waited: every merge closed within its grace window (never beyond max_window_s), and rounds closed
    # without the slow learner and without the dead one
    for e in merges:  # a window that ended between two passes of the syncer's loop closes at the second one
        assert e["window_s"] <= min(e["window_deadline_s"], max_window_s) + e["tick_gap_s"] + 0.01, e
        expected = token_weights({int(i): n for i, n in e["tokens"].items()})
        assert e["weights"] == {str(i): w for i, w in expected.items()}, e  # token-weighted, as logged
        assert abs(sum(e["weights"].values()) - 1) < 1e-12
    assert any(2 not in e["learners"] and 2 in e["alive"] for e in merges)  # the straggler was not waited for
    assert any(2 in e["learners"] for e in merges)  # ... and its deltas count when they arrive
    # the dead learner was not waited for: rounds close on the quorum of the others within max_window_s, so while it
    # was dead and the syncer up, some closed without it. Whether the syncer also declared it lost is not asserted:
    # it judges a learner lost after watching its beat still for heartbeat_timeout_s (2 s), and the learner's restart
    # beats from its process start, long before it trains (20-30 s here), so whether the syncer, itself restarted
    # meanwhile, watched that silence long enough depends on the load. Its block was given back once either way
    # (above), by the syncer or by the restart.
    died = next(e["time"] for e in by_kind["fault_injected"] if e.get("replica") == 1 and e["kind"] == "kill")
    back = starts[(1, 1)]["time"] if (1, 1) in starts else by_kind["job_finished"][0]["time"]
    syncer_down = [(ended[g]["time"], started[g]["time"]) for g in ended]  # a leader's end to the next one's start
    overlap = sum(max(0.0, min(back, end) - max(died, begin)) for begin, end in syncer_down)
    up_while_dead = back - died - overlap
    lost = [e for e in by_kind["learner_lost"] if e["learner"] == 1]
    without_1 = [e for e in merges if died < e["time"] < back and 1 not in e["learners"]]
    if up_while_dead > 2 * max_window_s:  # rounds close within max_window_s: some closed without the dead one
        assert without_1, up_while_dead
    assert not lost or lost[0]["time"] > died  # a loss is never declared before the death

    # the learners kept training while a syncer was stopped (it lives on, stopped, until its launcher ends it: no
    # sooner than its lease's lapse, 1.5 s at least, and 4 s of grace after): each learner training then logged
    # steps in the 5 s after the stop
    metrics = read_metrics(tmp_path)
    for fault in (f for f in syncer_faults.values() if f["kind"] == "hang"):
        stopped = fault["time"]
        down = {m["replica"] for m in metrics if stopped < m["time"] < stopped + 5.0}
        training = {r for (r, _), e in starts.items() if e["time"] < stopped} - {1}  # learner 1 may die meanwhile
        assert down and training <= down, (training, down)

    # the global model improved
    evaluated = by_kind["global_evaluated"]
    finished = by_kind["syncer_finished"]
    assert len(finished) == 1 and finished[0]["blocks_done"] == steps * learners
    assert finished[0]["val_loss"] < evaluated[0]["val_loss"] - 0.1, (evaluated[0], finished[0])
    assert processes_of_run(str(tmp_path)) == []  # nothing left behind, on either node

    # one wandb run for the job (offline), written by node 0's launcher: each learner on its own step, the syncer's
    # merges with the global model's validation loss, the faults marked; no learner or syncer run of its own
    assert len(list(tmp_path.rglob("offline-run-*"))) == 1, list(tmp_path.rglob("offline-run-*"))
    run = read_run(tmp_path / "wandb")
    assert run.group == "diloco" and run.name.startswith("diloco-"), (run.name, run.group)
    rows = list(run.history.values())
    for learner in (0, 1, 2):
        steps_logged = [r[f"learner{learner}/step"] for r in rows if f"learner{learner}/step" in r]
        assert steps_logged and all(f"learner{learner}/loss_metrics/global_avg_loss" in r
                                    for r in rows if f"learner{learner}/step" in r)
    merged = [r for r in rows if "syncer/merges" in r]
    assert any("syncer/val_loss" in r for r in merged)
    assert sum(r.get("events/fault_injected", 0) for r in rows) == len(by_kind["fault_injected"])


@pytest.mark.multiprocess
def test_one_node_on_the_embedded_store_a_hung_syncer_is_ended_and_restarted_while_learners_train(tmp_path):
    """The default one-node path (the embedded store, one launcher): 2 learners of the tiny model; the syncer hangs
    (SIGSTOP) right after its 3rd merge. It holds no lease, so nothing takes over until its launcher sees its beat
    still for ``syncer_timeout_s``: it kills it and restarts it from its checkpoint. The learners train on
    meanwhile, the restarted syncer merges on from the checkpoint's state, counts the budget trained, and the
    launcher exits 0."""
    from conftest import launch

    # 640 blocks: about 25 s of training on 2 busy cores, longer than the hang's bound and the syncer's restart
    # (12 s from the hang to the restart's start in a run here), so that the restart merges while learners train
    steps, period, learners, syncer_timeout_s = 320, 8, 2, 3.0
    proc = launch(
        "train_configs/diloco.toml", "--model.flavor", "tiny", "--recover.replicas", str(learners),
        "--training.steps", str(steps), "--recover.diloco.inner_steps", str(period),
        "--recover.diloco.max_window_s", "2", "--recover.diloco.checkpoint_interval_s", "1",
        "--recover.diloco.eval_interval_s", "0", "--recover.diloco.syncer_timeout_s", str(syncer_timeout_s),
        "--metrics.no_enable_wandb", "--dump_folder", str(tmp_path),
        "--chaos.faults", '[{kind = "hang", process = "syncer", step = 3, phase = "merge"}]', timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "the syncer made no progress for" in proc.stderr and "restarting it from its checkpoint" in proc.stderr
    events = read_events(tmp_path / "events.jsonl")
    by_kind = collections.defaultdict(list)
    for e in events:
        by_kind[e["event"]].append(e)
    [hang] = [e for e in by_kind["fault_injected"] if e.get("process") == "syncer"]
    started = by_kind["syncer_started"]
    assert [e["resumed"] for e in started] == [False, True], started
    assert started[1]["time"] - hang["time"] >= syncer_timeout_s  # ended by its launcher, not before its bound
    assert started[1]["merges"] <= 3  # resumed a checkpoint saved before the hang (merges since it are redone)
    # the learners that had started trained while the syncer was stopped and before it was restarted (a learner
    # whose process came up after the hang, which 2 busy cores can make 10 s late, waits for the global model)
    stopped = hang["time"]
    running = {e["replica"] for e in by_kind["learner_started"] if e["time"] < stopped}
    metrics = read_metrics(tmp_path)
    assert running and {m["replica"] for m in metrics if stopped < m["time"] < started[1]["time"]} >= running
    assert sorted(collections.Counter(e["block"] for e in by_kind["block_claimed"])) == list(range(steps * learners))
    merges = by_kind["fragment_merged"]
    assert any(e["time"] > started[1]["time"] for e in merges)  # the restart merged on
    [finished] = by_kind["syncer_finished"]
    assert finished["blocks_done"] == steps * learners
    assert processes_of_run(str(tmp_path)) == []


BEAT_BEFORE_FAULT_S = 0.5
"""How long before a fault its learner's last beat or progress stamp may have been written: a learner's silence is
timed from that write (seen by the syncer), not from the fault (one run: 3.935 s from the fault for a 4 s timeout)."""


def two_learners_with_a_fault(tmp_path, steps: int, progress_timeout_s: float, fault: str, *extra: str):
    """A diloco job of 2 tiny learners (blocks of 4 inner steps, no evaluation) with one chaos fault, which must end
    trained (exit 0); returns (the launcher's result, its events by kind)."""
    from conftest import launch

    proc = launch(
        "train_configs/diloco.toml", "--model.flavor", "tiny", "--recover.replicas", "2",
        "--training.steps", str(steps), "--recover.diloco.inner_steps", "4", "--recover.diloco.max_window_s", "1",
        "--recover.diloco.eval_interval_s", "0", "--recover.progress_timeout_s", str(progress_timeout_s),
        "--metrics.no_enable_wandb", "--dump_folder", str(tmp_path), "--chaos.faults", f"[{fault}]", *extra,
        timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    by_kind = collections.defaultdict(list)
    for e in read_events(tmp_path / "events.jsonl"):
        by_kind[e["event"]].append(e)
    return proc, by_kind


@pytest.mark.multiprocess
def test_a_learner_whose_main_thread_hangs_is_named_and_its_block_trained_by_the_other(tmp_path):
    """Learner 1's main thread gets stuck in step 5's forward while its heartbeat thread beats on (the ``stall``
    fault). Its hang observer names it (``hang_threshold_s``, report only here); the syncer, which sees its
    progress stamp stand still, declares it lost after ``progress_timeout_s`` and gives its block back; learner 0
    trains that block too (waiting for it once the counter is past the budget), so the whole budget is trained and
    the launcher exits 0. The launcher ends the stuck learner as soon as the syncer named it lost (it cannot exit by
    itself; the observer here only reports) and starts it again."""
    steps, learners, progress_timeout_s = 20, 2, 6.0
    proc, by_kind = two_learners_with_a_fault(
        tmp_path, steps, progress_timeout_s, '{kind = "stall", replica = 1, step = 5, phase = "forward"}',
        "--recover.localize.hang_threshold_s", "3", "--recover.localize.no_end_hung")
    [stall] = by_kind["fault_injected"]
    [hang] = by_kind["hang_detected"]
    assert hang["replica"] == 1 and hang["kind"] == "stalled" and not hang["ended"], hang
    assert "replica 1 (start 0) was dropped from the job: ending its processes" in proc.stderr, proc.stderr[-3000:]
    assert "replica 1 exited with -9: restarting it (start 1" in proc.stderr, proc.stderr[-3000:]
    [lost] = by_kind["learner_lost"]
    assert lost["learner"] == 1 and "no progress (hung)" in lost["reason"], lost
    # counted from the last progress stamp, set before the stall
    assert lost["time"] - stall["time"] >= progress_timeout_s - BEAT_BEFORE_FAULT_S, (lost, stall)
    given_back = lost["requeued_block"]
    claims = [(e["replica"], e["block"]) for e in by_kind["block_claimed"]]
    assert claims.count((1, given_back)) == 1 and claims.count((0, given_back)) == 1, claims
    assert sorted({block for _, block in claims}) == list(range(steps * learners))
    [finished] = by_kind["syncer_finished"]
    assert finished["blocks_done"] == steps * learners
    assert processes_of_run(str(tmp_path)) == []


@pytest.mark.multiprocess
def test_a_learner_stopped_between_two_blocks_is_named_stopped_ended_and_restarted(tmp_path):
    """Learner 1 is SIGSTOPped (``hang``) right after step 5's block was counted, before it claims the next: it holds
    no block, so there is nothing to give back. Its heartbeat stands still: the syncer takes it for lost after
    ``heartbeat_timeout_s`` and, once the beat stood still for ``progress_timeout_s``, names it stopped (dropped),
    once; its launcher ends it and starts it again, and the budget is trained, every block claimed once."""
    # enough blocks that learner 0 alone trains well past the progress timeout and the other's restart (a tiny
    # block takes ~0.05 s): with fewer, the job ends trained before the stopped learner is named
    steps, learners, progress_timeout_s = 150, 2, 4.0
    proc, by_kind = two_learners_with_a_fault(tmp_path, steps, progress_timeout_s,
                                              '{kind = "hang", replica = 1, step = 5, phase = "block_end"}')
    [hang] = by_kind["fault_injected"]
    assert hang["replica"] == 1 and hang["phase"] == "block_end", hang
    [stopped] = by_kind["learner_stopped"]  # named once, though it stays stopped until its launcher ends it
    assert stopped["learner"] == 1 and stopped["start"] == 0, stopped
    # the syncer counts from its last beat, written before the fault (by up to a heartbeat interval, more while the
    # main thread holds the GIL): named after the progress timeout, well past the heartbeat timeout (2 s, lost)
    assert stopped["time"] - hang["time"] >= progress_timeout_s - BEAT_BEFORE_FAULT_S, (stopped, hang)
    lost = [e for e in by_kind["learner_lost"] if e["learner"] == 1]
    assert lost and lost[0]["requeued_block"] is None, lost  # it held no block
    assert "replica 1 (start 0) was dropped from the job: ending its processes" in proc.stderr, proc.stderr[-3000:]
    assert "replica 1 exited with -9: restarting it (start 1" in proc.stderr, proc.stderr[-3000:]
    claims = [e["block"] for e in by_kind["block_claimed"]]
    assert sorted(claims) == list(range(steps * learners)), claims  # none given back, none trained twice
    [finished] = by_kind["syncer_finished"]
    assert finished["blocks_done"] == steps * learners
    assert processes_of_run(str(tmp_path)) == []


def test_a_block_given_back_is_taken_once_and_given_back_once():
    from titan_recover.recover.diloco.blocks import claim_requeued, requeue_block

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set(DilocoKeys.block(1), "7 24 0")  # learner 1 died training block 7
    assert requeue_block(store, 1, "syncer.1") == 7
    assert requeue_block(store, 1, "1.1") is None  # its restart finds it given back already
    assert requeue_block(store, 1, "syncer.1") is None  # and so does the syncer, again
    assert claim_requeued(store, "0.0") == 7
    assert claim_requeued(store, "0.0") is None  # taken once, even by the same learner asking again
    assert claim_requeued(store, "2.0") is None
    store.set(DilocoKeys.block(2), "done 40 0")  # a learner that died between blocks gives nothing back
    assert requeue_block(store, 2, "syncer.1") is None


def test_a_learners_other_ranks_wait_for_rank_0s_claim_past_the_stores_timeout_and_stamp_progress_meanwhile():
    """Past the budget, rank 0 of a learner of 2 ranks waits for a block to come back (up to ``startup_timeout_s +
    2 x progress_timeout_s``, longer than the store's timeout); rank 1 waits for rank 0's claim meanwhile, in slices
    of at most ``most_s``, stamping its progress after each (so neither the hang observer nor the syncer takes a
    rank in a bounded wait for hung). Here the store's timeout is 0.3 s and rank 0 shares its claim 1.2 s late: rank
    1 reads it (the block given back, 7), and next the budget (rank 0 found none: the learner finishes)."""
    import threading

    from titan_recover.recover.diloco.blocks import read_claim, share_claim

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store.set_timeout(timedelta(seconds=0.3))  # after its own client connected, which a busy host may make slow
    stamps = []
    sharer = threading.Timer(1.2, share_claim, args=(store, 0, 0, 5, 7))
    sharer.start()
    start = time.monotonic()
    try:
        assert read_claim(store, learner=0, incarnation=0, count=5, waiting=lambda: stamps.append(time.monotonic()),
                          most_s=0.2) == 7
    finally:
        sharer.join()
    assert time.monotonic() - start >= 1.1  # it waited for the claim, past the store's timeout
    assert len(stamps) >= 4 and all(b - a < 1.0 for a, b in zip([start, *stamps], stamps))  # progress kept stamped
    share_claim(store, 0, 0, 6, 48)  # rank 0 found nothing given back: the budget, no block
    assert read_claim(store, learner=0, incarnation=0, count=6, most_s=0.2) == 48


def test_a_block_is_given_back_once_for_each_learner_start_that_held_it():
    """The syncer judges a learner lost from heartbeats a moment old; by the time it reads the learner's key, the
    learner's restart may have given back the dead start's block and claimed another. That one is the restart's:
    given back too, it would be trained twice. And a given-back block whose new holder dies too is given back
    again: a block given back once only would never be trained."""
    from titan_recover.recover.diloco import blocks

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for block in range(3):
        assert blocks.claim_block(store, f"{block}.0") == block
        blocks.record_training(store, block, block, step=0, incarnation=0)
    # learner 1's start 0 dies training block 1; its restart (start 1) gives block 1 back, learner 0 takes it, and
    # the restart claims block 3
    assert blocks.requeue_block(store, 1, "1.1") == 1
    assert blocks.claim_block(store, "0.0") == 1
    blocks.record_training(store, 0, 1, step=1, incarnation=0)
    assert blocks.claim_block(store, "1.1") == 3
    blocks.record_training(store, 1, 3, step=1, incarnation=1)
    # only now does the syncer, which last saw start 0 alive, judge learner 1 lost: block 3 is not start 0's
    assert blocks.requeue_block(store, 1, "syncer.1", incarnation_at_most=0) is None
    assert blocks.claim_block(store, "2.0") == 4
    # learner 0 dies training the given-back block 1: it goes back again, once
    assert blocks.requeue_block(store, 0, "syncer.1", incarnation_at_most=0) == 1
    assert blocks.requeue_block(store, 0, "0.1") is None  # learner 0's restart finds that hold given back
    assert blocks.claim_block(store, "2.0") == 1
    blocks.record_training(store, 2, 1, step=2, incarnation=0)
    blocks.record_trained(store, 2, 1, step=3, incarnation=0, who="2.0")
    # start 1 of learner 1, seen alive and then lost, gives back block 3
    assert blocks.requeue_block(store, 1, "syncer.1", incarnation_at_most=1) == 3
    assert blocks.blocks_trained(store) == 1


def test_the_global_model_is_assembled_from_row_shards_and_not_from_column_shards():
    from titan_recover.recover.diloco.syncer.global_model import assemble_rows

    w, b = torch.arange(12.0).reshape(4, 3), torch.arange(4.0)
    rows = [{"names": ["w", "b"], "shapes": [[2, 3], [2]], "global_shapes": [[4, 3], [4]]}] * 2
    flats = [torch.cat([w[:2].reshape(-1), b[:2]]), torch.cat([w[2:].reshape(-1), b[2:]])]
    whole = assemble_rows(rows, flats)
    assert torch.equal(whole["w"], w) and torch.equal(whole["b"], b)
    # column shards (tensor parallel): dim 0 does not add up to the whole shape
    columns = [{"names": ["w"], "shapes": [[4, 1]], "global_shapes": [[4, 2]]}] * 2
    assert assemble_rows(columns, [w[:, :1].reshape(-1), w[:, 1:2].reshape(-1)]) is None
    single = [{"names": ["w"], "shapes": [[4, 3]], "global_shapes": [[4, 3]]}]
    assert torch.equal(assemble_rows(single, [w.reshape(-1)])["w"], w)


def test_syncer_faults_are_checked():
    from titan_recover.recover.chaos.config import FaultSpec

    assert FaultSpec(kind="kill", process="syncer", phase="merge", step=3).process == "syncer"
    with pytest.raises(ValueError, match="cannot hit the syncer"):
        FaultSpec(kind="slow", process="syncer", phase="merge")
    with pytest.raises(ValueError, match="merge"):
        FaultSpec(kind="kill", process="syncer", phase="forward")


def test_a_learner_offers_its_parameters_again_to_a_syncer_that_replaced_one_without_a_global_model(monkeypatch):
    """The first syncer died before it had a global model: the learner offers its parameters to the next one (the
    offer went with the first syncer's store), and not to one that has a global model already."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from titan_recover.recover.diloco import learner as learner_module
    from titan_recover.recover.diloco.rules import DilocoKeys

    first, second, third = HashStore(), HashStore(), HashStore()
    third.set(DilocoKeys.VERSIONS, "[]")
    offered = []
    monkeypatch.setattr(learner_module, "offer_parameters",
                        lambda store, *args, **kwargs: offered.append(store) or 12)

    class Link:
        seen = [(1, first), (2, second), (2, second), (3, third), (3, third)]

        def current(self):
            self.generation, store = self.seen.pop(0)
            return store

        def drop(self):
            pass

    learner = learner_module.Learner.__new__(learner_module.Learner)
    learner.learner, learner.rank, learner.names, learner.params = 0, 0, ["w"], [torch.zeros(2)]
    learner.local = SimpleNamespace(locals=lambda: [torch.zeros(2)], ranges=[(0, 2)])
    learner.adopted = [(0, -1)]
    looks = []

    def adopt_ready():
        looks.append(1)
        if len(looks) == 5:
            learner.adopted = [(0, 3)]

    learner.adopt_ready, learner._wait = adopt_ready, lambda deadline, what: None
    store, size = learner._offer_until_adopted(Link(), deadline=0.0)
    assert offered == [first, second] and store is second and size == 12
