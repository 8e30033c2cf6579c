"""Pure parts of the replica-group protocol: liveness, membership, commit decisions, timeouts, chaos schedule."""

from __future__ import annotations

import time

import pytest

from titan_recover.config.apply import ConfigError
from titan_recover.job_config import build_config
from titan_recover.recover.chaos.config import ChaosConfig, FaultSpec
from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.groups.coordinator import describe_beats
from titan_recover.recover.groups.liveness import (absent_beat, decode_group_beat, encode_group_beat, group_beats, Heartbeat,
                                                 judge_liveness, LivenessWatch, WatchedTime)
from titan_recover.recover.groups.protocol import (
    all_joined,
    decide_commit,
    decide_members,
    decode_members,
    encode_members,
)


def test_liveness_dead_vs_hung():
    ages = {0: (0.1, 0.1), 1: (3.0, 3.0), 2: (0.05, 20.0), 3: None}  # (beat unchanged for, progress unchanged for)
    verdict = judge_liveness(7, ages, heartbeat_timeout_s=2.0, progress_timeout_s=10.0)
    assert verdict.dead_ranks == (1, 3) and verdict.hung_ranks == (2,) and not verdict.alive
    assert "replica 7 rank(s) [1, 3]: no heartbeat" in verdict.reason() and "hung" in verdict.reason()
    healthy = judge_liveness(7, {0: ages[0]}, 2.0, 10.0)
    assert healthy.alive and healthy.reason() == ""
    beat = Heartbeat(99.95, 80.0, 3, "forward", 2)
    assert Heartbeat.decode(beat.encode()) == beat


def beating(t: float, progress: float | None = None, incarnation: int = 0) -> Heartbeat:
    return Heartbeat(t, t if progress is None else progress, 1, "forward", incarnation)


def test_liveness_watch_counts_only_watched_time():
    """The coordinator judges a beat by how long it watched it stay unchanged, on its own clock: a member's clock
    running 100 s behind changes nothing, and a stall of the coordinator (or of its store) is not held against
    the members: after a 5 s gap between two looks every beat is still unchanged, and nobody is declared dead."""
    watch = LivenessWatch(heartbeat_timeout_s=2.0, progress_timeout_s=10.0, max_gap_s=0.25)
    t = 1000.0
    for i in range(20):  # both beat every 0.1 s; replica 1's clock is 100 s behind
        watch.look(t + 0.1 * i, {(0, 0): beating(t + 0.1 * i), (1, 0): beating(t - 100 + 0.1 * i)})
    assert watch.judge(0, [0], 0).alive and watch.judge(1, [0], 0).alive
    t += 1.9
    watch.look(t + 5.0, {(0, 0): beating(t), (1, 0): beating(t - 100)})  # 5 s stall: nothing new came in
    assert watch.judge(0, [0], 0).alive and watch.judge(1, [0], 0).alive
    assert watch.ages(0, [0], 0)[0][0] == pytest.approx(0.25) and watch.time.unwatched_s == pytest.approx(4.75)
    # replica 1 stops beating while the coordinator watches: dead once it has watched 2 s of silence
    t += 5.0
    for i in range(1, 30):
        watch.look(t + 0.1 * i, {(0, 0): beating(t + 0.1 * i), (1, 0): beating(t - 100 - 3.1)})
        if i < 17:
            assert watch.judge(1, [0], 0).alive, i
    assert watch.judge(1, [0], 0).dead_ranks == (0,) and watch.judge(0, [0], 0).alive


def test_liveness_watch_hung_restarted_and_forgotten():
    watch = LivenessWatch(heartbeat_timeout_s=2.0, progress_timeout_s=1.0, max_gap_s=0.25)
    for i in range(15):  # beating, but the main thread's progress stamp never moves
        watch.look(0.1 * i, {(0, 0): beating(0.1 * i, progress=0.0)})
    assert watch.judge(0, [0], 0).hung_ranks == (0,)
    # a later start of the group beats under the member's key: the member (start 0) is gone
    watch.look(1.6, {(0, 0): beating(1.6, incarnation=1)})
    assert watch.judge(0, [0], 0).dead_ranks == (0,) and watch.judge(0, [0], 1).alive
    watch.forget(0)
    assert watch.ages(0, [0], 1) == {0: None}


def test_a_stale_beat_of_an_earlier_start_never_takes_a_members_place():
    """Start 0 of replica 0 was dropped while stopped (its node frozen) and start 1 admitted; start 0 is thawed and
    its heartbeat thread writes a beat or two under the group's key before its launcher ends it. That is no news of
    start 1: the member stays alive while its own beats come between, is judged by the time its own beat stood still,
    and is dead once only the stale writer beats for the timeout. A member just admitted whose first read shows the
    stale beat is watched from then on like one that has not beaten yet. Before, the first stale read declared the
    healthy member dead (found by freezing a node's processes, replacing the node, then thawing them)."""
    watch = LivenessWatch(heartbeat_timeout_s=2.0, progress_timeout_s=10.0, max_gap_s=0.25)
    stale = beating(50.0, incarnation=0)
    for i in range(30):  # the member's beats and the stale one's interleave
        watch.look(0.1 * i, {(0, 0): beating(0.1 * i, incarnation=1) if i % 2 else stale}, {0: 1})
        assert watch.judge(0, [0], 1).alive, i
    for i in range(30, 60):  # the member is gone; only the stale writer beats: dead after 2 s of watched time
        watch.look(0.1 * i, {(0, 0): stale}, {0: 1})
        if i < 50:
            assert watch.judge(0, [0], 1).alive, i
    assert watch.judge(0, [0], 1).dead_ranks == (0,)
    fresh = LivenessWatch(heartbeat_timeout_s=2.0, progress_timeout_s=10.0, max_gap_s=0.25)
    fresh.look(0.0, {(0, 0): stale}, {0: 1})
    assert fresh.judge(0, [0], 1).alive and fresh.ages(0, [0], 1)[0] == (0.0, 0.0)
    fresh.look(0.1, {(0, 0): beating(0.1, incarnation=1)}, {0: 1})
    assert fresh.ages(0, [0], 1)[0] == (0.0, 0.0)
    # without the expected start (the diloco syncer), an earlier start than the one last seen is stale all the same
    syncer = LivenessWatch(heartbeat_timeout_s=2.0, progress_timeout_s=10.0, max_gap_s=0.25)
    syncer.look(0.0, {(0, 0): beating(0.0, incarnation=1)})
    syncer.look(0.1, {(0, 0): stale})
    assert syncer.judge(0, [0], 1).alive and syncer.ages(0, [0], 1)[0][0] == pytest.approx(0.1)


def test_watched_time_sits_out_stalls():
    window = WatchedTime(max_gap_s=0.25, now=10.0)
    for now in (10.1, 10.2, 12.2, 12.3):
        window.tick(now)
    assert window.elapsed_s == pytest.approx(0.55) and window.unwatched_s == pytest.approx(1.75)


def test_failure_report_says_what_the_coordinator_saw():
    """A rank declared dead is reported with what the watch counted, its beat's own age, and the incarnation of a
    later start of the group beating under the same key (the member's own beat then counts as missing)."""
    beats = {0: Heartbeat(97.0, 96.0, 12, "forward", incarnation=2), 1: Heartbeat(99.9, 99.9, 3, "startup", 3)}
    seen = describe_beats(beats, {0: (2.1, 2.1), 1: None}, incarnation=2, now=100.0)
    assert seen["0"] == {"age_s": 3.0, "step": 12, "phase": "forward", "quiet_s": 2.1, "still_s": 2.1}
    assert seen["1"]["incarnation"] == 3 and "quiet_s" not in seen["1"]


def test_membership_requires_every_rank_of_a_replica():
    joined = {0: {0, 1}, 1: {0}, 2: {0, 1}, 3: {0, 1}}
    decision = decide_members([0, 1, 2, 3], joined, ranks_per_replica=2, excluded=[3])
    assert decision.members == (0, 2) and decision.removed == (1, 3)
    assert "replica 1 rank(s) [1] did not join" in decision.reason and "replica 3 declared failed" in decision.reason
    assert all_joined([0, 2], joined, 2) and not all_joined([0, 1], joined, 2)
    assert decode_members(encode_members(decision.members, decision.reason)) == (decision.members, decision.reason)


def test_commit_decision():
    assert decide_commit(6, 6, fault_seen=True) == "commit"  # everyone finished: a late flag changes nothing
    assert decide_commit(5, 6, fault_seen=True) == "abort"
    assert decide_commit(5, 6, fault_seen=False) is None


def test_timeout_ordering_is_validated_with_both_values():
    with pytest.raises(ValueError, match=r"join_window_s \(3.0\) must be smaller than recover.heartbeat_timeout_s \(2.0\)"):
        RecoverConfig(join_window_s=3.0)
    with pytest.raises(ConfigError, match=r"heartbeat_timeout_s \(1.5\) must be smaller than recover.collective_timeout_s \(1.0\)"):
        build_config(None, ["--recover.replicas", "2", "--recover.heartbeat_timeout_s", "1.5",
                            "--recover.collective_timeout_s", "1.0"])
    with pytest.raises(ConfigError, match=r"min_replicas must be between 1 and recover.replicas \(2\)"):
        build_config(None, ["--recover.replicas", "2", "--recover.min_replicas", "3"])


def test_chaos_schedule_is_seeded_and_checked():
    config = ChaosConfig(faults=[FaultSpec(kind="kill", replica=1, step=2, phase="reduction")],
                         random_faults=3, seed=5, random_kinds=["kill", "hang"], random_steps=[2, 6])
    first, second = config.schedule(4, 2), config.schedule(4, 2)
    assert first == second and len(first) == 4 and first[0].replica == 1
    assert all(2 <= f.step <= 6 and f.kind in ("kill", "hang") for f in first[1:])
    with pytest.raises(ValueError, match=r"kind 'explode' is not registered; registered: bitflip, desync, hang, kill, raise, slow, stall"):
        FaultSpec(kind="explode")
    with pytest.raises(ConfigError, match=r"phase 'loading' must be one of forward, backward, reduction, commit, rebuild"):
        build_config(None, ["--chaos.faults", '[{kind="kill", phase="loading"}]'])
    config = build_config(None, ["--chaos.faults", '[{kind="hang", replica=2, step=3, phase="optimizer"}]'])
    assert config.chaos.faults == [FaultSpec(kind="hang", replica=2, rank=0, step=3, phase="optimizer")]


def test_chaos_monkey_logs_before_it_acts():
    from titan_recover.recover.chaos.kinds import InjectedFault
    from titan_recover.recover.chaos.monkey import ChaosMonkey

    class Events:
        def __init__(self):
            self.seen = []

        def emit(self, event, **fields):
            self.seen.append((event, fields))

    events = Events()
    schedule = [FaultSpec(kind="raise", replica=1, rank=0, step=3, phase="commit"),
                FaultSpec(kind="kill", replica=0, rank=0, step=3, phase="commit")]  # another rank's fault
    monkey = ChaosMonkey(schedule, replica=1, rank=0, events=events)
    monkey.maybe_inject(2, "commit")
    monkey.maybe_inject(3, "forward")
    assert events.seen == []
    with pytest.raises(InjectedFault):
        monkey.maybe_inject(3, "commit")
    assert events.seen[0][0] == "fault_injected" and events.seen[0][1]["kind"] == "raise"
    monkey.maybe_inject(3, "commit")  # a retried phase of the same step: each fault fires once
    assert len(events.seen) == 1


def test_slow_fault_makes_a_straggler_from_its_step_on():
    from titan_recover.recover.chaos.monkey import ChaosMonkey

    class Events:
        def emit(self, event, **fields):
            pass

    monkey = ChaosMonkey([FaultSpec(kind="slow", factor=3.0, replica=0, rank=0, step=2, phase="forward")],
                         replica=0, rank=0, events=Events())
    monkey.maybe_inject(1, "forward")
    assert monkey.slowdown == 1.0
    monkey.maybe_inject(2, "forward")
    assert monkey.slowdown == 3.0
    with pytest.raises(ValueError, match="factor must be >= 1"):
        FaultSpec(kind="slow", factor=0.5)


def test_commit_decision_carries_the_admitted_replicas():
    from titan_recover.recover.groups.protocol import CommitDecision

    assert CommitDecision("commit").encode() == "commit"
    assert CommitDecision.decode(b"commit") == CommitDecision("commit", ())
    both = CommitDecision("commit", (3, 4))
    assert CommitDecision.decode(both.encode()) == both and both.encode() == "commit+3,4"
    assert CommitDecision.decode("abort").outcome == "abort"
    asked = CommitDecision("commit", (3,), checkpoint=True)  # and a requested checkpoint of the step
    assert asked.encode() == "commit!+3" and CommitDecision.decode(asked.encode()) == asked
    assert CommitDecision.decode("commit!") == CommitDecision("commit", (), True)
    with pytest.raises(ValueError, match="only a commit admits"):
        CommitDecision("abort", (1,)).encode()
    with pytest.raises(ValueError, match="only a commit admits replicas or asks for a checkpoint"):
        CommitDecision("abort", checkpoint=True).encode()
    with pytest.raises(ValueError, match="not a commit decision"):
        CommitDecision.decode("maybe")


def test_only_a_complete_newer_incarnation_is_ready_to_join():
    from titan_recover.recover.groups.protocol import ready_to_join

    registered = {
        0: {0: 0, 1: 0},  # a member
        1: {0: 1, 1: 1},  # restarted: incarnation 1 > dropped 0, both ranks
        2: {0: 1},        # restarting: rank 1 not registered yet
        3: {0: 1, 1: 0},  # ranks of two incarnations (the old one still shutting down)
        4: {0: 0, 1: 0},  # the dropped incarnation itself
    }
    dropped = {1: 0, 2: 0, 3: 0, 4: 0}
    assert ready_to_join([0], registered, 2, dropped) == (1,)


def test_spares_hold_quota_only_while_an_active_replica_is_missing():
    from titan_recover.recover.groups.protocol import active_replicas

    assert active_replicas([3, 0, 1, 2], 3) == (0, 1, 2)  # spare 3 on standby
    assert active_replicas([0, 2, 3], 3) == (0, 2, 3)  # replica 1 lost: the spare is promoted
    assert active_replicas([0, 1, 2, 3], 3) == (0, 1, 2)  # 1 admitted again: 3 back on standby
    assert active_replicas([2, 0], 0) == (0, 2)


def test_admission_value_and_incarnations_round_trip():
    from titan_recover.recover.groups.member import incarnation_from_env
    from titan_recover.recover.groups.protocol import admitted_incarnations, decode_admission, encode_admission

    assert decode_admission(encode_admission(7, (1, 3))) == (7, (1, 3))
    assert decode_admission(b"7|") == (7, ())
    assert decode_admission(encode_admission(7, (1, 3), (2, 1))) == (7, (1, 3))  # the coordinator's admitted/e{e}
    assert admitted_incarnations(encode_admission(7, (1, 3), (2, 1))) == {1: 2, 3: 1}
    assert admitted_incarnations(encode_admission(7, (1, 3))) == {}
    beat = Heartbeat(1.5, 1.25, 4, "phase,with,commas", incarnation=2)
    assert Heartbeat.decode(beat.encode()) == beat
    assert incarnation_from_env({}) == 0
    assert incarnation_from_env({"TITAN_RECOVER_INCARNATION": "2"}) == 2
    assert incarnation_from_env({"TORCHELASTIC_RESTART_COUNT": "1"}) == 1


def test_chaos_faults_hit_only_the_incarnation_they_name():
    from titan_recover.recover.chaos.monkey import ChaosMonkey

    fired = []

    class Events:
        def emit(self, event, **fields):
            fired.append(fields)

    schedule = [FaultSpec(kind="slow", replica=1, step=3, incarnation=1)]
    first = ChaosMonkey(schedule, replica=1, rank=0, events=Events(), incarnation=0)
    first.maybe_inject(3, "forward")
    assert fired == [] and first.slowdown == 1.0
    restarted = ChaosMonkey(schedule, replica=1, rank=0, events=Events(), incarnation=1)
    restarted.maybe_inject(3, "forward")
    assert len(fired) == 1 and restarted.slowdown == 2.0


def test_time_triggered_fault_fires_once_per_job_at_its_offset(tmp_path):
    from titan_recover.recover.chaos.monkey import ChaosMonkey

    fired = []

    class Events:
        def emit(self, event, **fields):
            fired.append(fields)

    start = time.time()
    schedule = [FaultSpec(kind="slow", replica=1, at_s=30.0), FaultSpec(kind="slow", replica=1, at_s=0.0,
                                                                       phase="commit")]
    first = ChaosMonkey(schedule, replica=1, rank=0, events=Events(), run_dir=str(tmp_path), job_start=start)
    first.maybe_inject(1, "forward")  # not due yet (30 s after the start)
    assert fired == [] and first.slowdown == 1.0
    first.maybe_inject(1, "commit")  # due, its phase
    assert [f["at_s"] for f in fired] == [0.0] and first.slowdown == 2.0
    # 31 s after the start: any step, any start of the group (the step and incarnation of the spec are ignored)
    later = ChaosMonkey(schedule, replica=1, rank=0, events=Events(), incarnation=2, run_dir=str(tmp_path),
                        job_start=start - 31)
    later.maybe_inject(7, "forward")
    later.maybe_inject(8, "commit")  # fired by the earlier start of the job: not again
    assert [f["at_s"] for f in fired] == [0.0, 30.0] and fired[1]["elapsed_s"] >= 31
    assert sorted(p.name for p in (tmp_path / "chaos").iterdir()) == ["fault-0", "fault-1"]
    with pytest.raises(ValueError, match="need the run folder"):
        ChaosMonkey(schedule, replica=1, rank=0, events=Events(), job_start=start)
    with pytest.raises(ValueError, match="at_s must be >= 0"):
        FaultSpec(kind="kill", at_s=-1.0)
    config = build_config(None, ["--chaos.faults", '[{kind="kill", replica=2, at_s=40.0}]'])
    assert config.chaos.faults[0].at_s == 40.0


def test_coordinator_does_not_hold_its_own_stall_against_the_members(tmp_path):
    """The coordinator (in-process, with its real store) watches two members, with a heartbeat timeout of 0.5 s. It
    stalls 0.75 s while no beat comes in (as when its store's server thread was not scheduled and the members'
    beats queued behind): nobody is declared dead. Then replica 1 stops beating while the coordinator watches:
    declared dead once it watched 0.5 s of silence, with what the coordinator saw in the event.

    The wall time is compared with the watch's own account, measured in the same run: it never counts more than
    the wall time passed, it counts at most one look past the timeout, and the wall time up to the deciding look
    is the watched silence plus this process's own stalls (which a busy machine lengthens, and the watch leaves
    out). A watch that counted its stall against replica 1, or let the timeout pass by more than a look, fails."""
    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.events import read_events
    from titan_recover.recover.groups.keys import GroupKeys

    timeout_s = 0.5
    config = RecoverConfig(replicas=2, heartbeat_timeout_s=timeout_s, join_window_s=0.3)
    coordinator = Coordinator(config, job_store(), replicas=2, ranks_per_replica=1, run_dir=str(tmp_path))
    coordinator._publish(0, (0, 1), (), "all replicas registered", timing={})

    def beat(*replicas):
        for replica in replicas:
            coordinator.store.set(GroupKeys.heartbeat(replica),
                                  encode_group_beat({0: Heartbeat(time.time(), time.time(), 1, "forward")}))

    for _ in range(10):
        beat(0, 1)
        coordinator._watch_liveness()
        time.sleep(0.02)
    stall_s = 1.5 * timeout_s  # longer than the timeout: counted, it would declare both replicas dead
    time.sleep(stall_s)  # the coordinator stalls; nothing new is in the store
    coordinator._watch_liveness()
    beat(0, 1)
    before_last_beat = time.monotonic()
    coordinator._watch_liveness()  # the last look that sees replica 1 beat: its silence is counted from here
    watched_from, unwatched_before = time.monotonic(), coordinator.watch.time.unwatched_s
    assert not coordinator.excluded
    guard = watched_from + 60  # only against a watch that never decides
    while not coordinator.excluded:
        assert time.monotonic() < guard, "replica 1 was never declared dead"
        beat(0)  # replica 1 is silent from now on
        looked_at = time.monotonic()
        coordinator._watch_liveness()
        decided_by = time.monotonic()
        time.sleep(0.02)
    assert coordinator.excluded == {1}
    [detected] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "failure_detected"]
    quiet = detected["beats"]["0"]["quiet_s"]  # watched silence, rounded to the ms
    stalls = coordinator.watch.time.unwatched_s - unwatched_before
    assert timeout_s <= quiet <= timeout_s + coordinator.watch.max_gap_s + 0.001  # the first look past the timeout
    assert decided_by - before_last_beat >= quiet - 0.001  # never more watched than passed
    assert looked_at - watched_from <= quiet + stalls + 0.001  # the rest of the wall time: the watcher's stalls
    assert detected["replica"] == 1 and detected["unwatched_s"] >= stall_s - coordinator.watch.max_gap_s - 0.001
    assert coordinator.store.check([GroupKeys.fault(0)])


def test_a_stop_that_came_with_a_later_epoch_after_the_look_is_entered_as_a_stop():
    """Epoch 1 is published; the rank, woken by it, looks at ``stop`` (none yet), then the coordinator publishes
    epoch 2 with a stop (written before its members): the rank, reading the newest epoch (2), enters the stop,
    not epoch 2 as a normal one."""
    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.member import ReplicaMember, TooFewReplicas
    from titan_recover.recover.groups.protocol import encode_members

    job = job_store()
    member = ReplicaMember(RecoverConfig(replicas=2), replica=0, rank=0, ranks_per_replica=1,
                           address=f"127.0.0.1:{job.port}")

    class PublishedDuringTheLook:
        """The job's store, where epochs 1 and 2 and the stop land just after the rank's first look at ``stop``."""

        def __init__(self, store):
            self.store, self.looks = store, 0

        def __getattr__(self, name):
            return getattr(self.store, name)

        def check(self, keys):
            seen = self.store.check(keys)
            if keys == [GroupKeys.STOP] and self.looks == 0:
                self.looks += 1
                job.set(GroupKeys.STOP, "only 1 replica left: stopping")
                job.set(GroupKeys.members(2), encode_members((0,), "replica 1 lost"))
                job.set(GroupKeys.EPOCH, "2")
            return seen

    job.set(GroupKeys.members(0), encode_members((0, 1), "all replicas registered"))
    job.set(GroupKeys.members(1), encode_members((0, 1), "replica 2 lost"))  # what the rank's wait wakes on
    job.set(GroupKeys.EPOCH, "1")
    member.store = PublishedDuringTheLook(member.store)
    with pytest.raises(TooFewReplicas, match="only 1 replica left: stopping"):
        member.wait_for_epoch(0, 5.0)


def test_a_group_that_died_between_its_registration_and_its_first_beat_is_judged_without_waiting(tmp_path):
    """Replica 1 registered and died before its leader wrote the group's first beat: its beat key never exists. The
    coordinator's look reads it as silent without waiting for it (a TCPStore ``multi_get`` of a missing key waits
    for the store's timeout, here 5 s, stalling the coordinator's beat), and declares it dead after the heartbeat
    timeout while replica 0 beats. Keys once seen are then read together, in one request."""
    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys

    config = RecoverConfig(replicas=2, heartbeat_timeout_s=0.5, join_window_s=0.3)
    coordinator = Coordinator(config, job_store(), replicas=2, ranks_per_replica=1, run_dir=str(tmp_path))
    coordinator._publish(0, (0, 1), (), "all replicas registered", timing={})
    longest, deadline = 0.0, time.monotonic() + 30
    while not coordinator.excluded:
        assert time.monotonic() < deadline, "replica 1 was never declared dead"
        coordinator.store.set(GroupKeys.heartbeat(0),
                              encode_group_beat({0: Heartbeat(time.time(), time.time(), 1, "forward")}))
        looked_at = time.monotonic()
        coordinator._watch_liveness()
        longest = max(longest, time.monotonic() - looked_at)
        time.sleep(0.02)
    assert coordinator.excluded == {1}
    assert longest < 2.5, longest  # far below the store's 5 s timeout: no look waited for the missing key
    assert coordinator._beats_seen == {GroupKeys.heartbeat(0)}


def job_store():
    """The job's store as the launcher hosts it (in this process)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def test_coordinator_state_round_trips_and_says_how_to_resume():
    from titan_recover.recover.groups.protocol import CoordinatorState, resume_action

    state = CoordinatorState(3, (0, 2), "replica 1 rank(s) [0] did not join", (1,), (7, (1,)), {0: 0, 2: 1},
                             {1: 0}, (1,), "")
    assert CoordinatorState.decode(state.encode()) == state
    assert resume_action(None, -1) == "form_first"
    assert resume_action(state, 2) == "finish"  # died between its write-ahead record and the epoch
    assert resume_action(state, 3) == "resume"
    with pytest.raises(ValueError, match="another job"):
        resume_action(state, 5)
    with pytest.raises(ValueError, match="state is missing"):
        resume_action(None, 0)


def test_only_the_starts_a_launcher_named_found_the_epoch_after_a_cold_restart():
    from titan_recover.recover.groups.protocol import founders

    # replica 0: its named start (2) registered both ranks; replica 1: an older start (1) is still registered as
    # rank 1; replica 2: not restarted (-1); replica 3: its launcher has not said yet
    registered = {0: {0: 2, 1: 2}, 1: {0: 2, 1: 1}}
    assert founders(registered, {0: 2, 1: 2, 2: -1}, ranks_per_replica=2) == ((0,), False)
    assert founders({**registered, 1: {0: 2, 1: 2}}, {0: 2, 1: 2, 2: -1}, ranks_per_replica=2) == ((0, 1), True)
    assert founders({}, {0: -1, 1: -1}, ranks_per_replica=2) == ((), True)


class _Starts:
    """The store each start of the coordinator writes through. ``tcp``: the launcher's store, the same for every
    start. ``etcd``: each start leads once the start before it lost its lease (revoked here: its death), and writes
    through its fenced store, as a standby coordinator does (coordinator_process.py)."""

    def __init__(self, kind: str, request):
        self.kind, self.election, self.count = kind, None, 0
        if kind == "tcp":
            self.store = job_store()
        else:
            from datetime import timedelta
            import uuid

            from titan_recover.recover.stores import open_store

            self.store = open_store(f"etcd://{request.getfixturevalue('etcd_server')}",
                                    timeout=timedelta(seconds=5), prefix=f"resume-{uuid.uuid4().hex}")
            request.addfinalizer(self.resign)  # the last start's lease is not left refreshed for the session

    def resign(self) -> None:
        if self.election is not None:
            self.election.resign()

    def next(self):
        if self.kind == "tcp":
            return self.store
        from datetime import timedelta

        from etcd3gw.lease import Lease

        from titan_recover.recover.groups.keys import GroupKeys
        from titan_recover.recover.stores.leader import LeaderElection

        if self.election is not None:  # the previous start dies: its lease lapses
            self.store.cluster.call(lambda client: Lease(self.election.lease, client=client).revoke())
        self.count += 1
        self.election = LeaderElection(self.store, GroupKeys.COORDINATOR_LEADER, f"start-{self.count}")
        self.election.campaign(timedelta(seconds=5))
        return self.election.fenced()


@pytest.mark.parametrize("kind", ["tcp", pytest.param("etcd", marks=pytest.mark.multiprocess)])
def test_a_restarted_coordinator_resumes_the_epoch_it_was_publishing(tmp_path, kind, request):
    """A coordinator dies after writing epoch 1's state ahead and before members can read the epoch (as the
    ``publish`` chaos phase does): the next start publishes exactly that epoch, keeps the incarnations and the
    drop, and a fault it did not see while nobody coordinated is handled once it is back. On the launcher's store,
    and on etcd, where each start is a newly elected leader writing through its fence."""
    from titan_recover.recover.events import read_events
    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys, raise_fault_flag
    from titan_recover.recover.groups.protocol import CoordinatorState, decode_members

    starts = _Starts(kind, request)
    store = starts.store
    config = RecoverConfig(replicas=3, join_window_s=0.3, heartbeat_timeout_s=2.0)
    first = Coordinator(config, starts.next(), replicas=3, ranks_per_replica=1, run_dir=str(tmp_path))
    first.incarnation = {0: 0, 1: 0, 2: 0}
    first._publish(0, (0, 1, 2), (), "all replicas registered", timing={})
    first.dropped[1] = 0
    first._save(CoordinatorState(1, (0, 2), "replica 1 lost", (1,), None, dict(first.incarnation),
                                 dict(first.dropped)))  # ... and dies here
    assert int(store.get(GroupKeys.EPOCH)) == 0

    second = Coordinator(config, starts.next(), replicas=3, ranks_per_replica=1, run_dir=str(tmp_path))
    assert second.start == 1 and second._resume()
    assert int(store.get(GroupKeys.EPOCH)) == 1 and second.members == (0, 2)
    assert decode_members(store.get(GroupKeys.members(1))) == ((0, 2), "replica 1 lost")
    assert store.get(GroupKeys.dropped(1)).decode().startswith("0|")
    assert second.incarnation == {0: 0, 1: 0, 2: 0}
    if kind == "etcd":  # the dead start's fence refuses its writes
        from titan_recover.recover.stores.etcd import NotLeader

        with pytest.raises(NotLeader, match="start-2 holds it"):
            first._beat()

    # a fault raised while no coordinator ran: the next start forms the epoch after it from who joins
    raise_fault_flag(store, 1, "replica 2 rank 0: collective failed")
    store.set(GroupKeys.join(2, 0), "0")
    third = Coordinator(config, starts.next(), replicas=3, ranks_per_replica=1, run_dir=str(tmp_path))
    assert third._resume() and third.epoch == 1
    third._form_next_epoch()
    assert third.epoch == 2 and third.members == (0,)
    assert decode_members(store.get(GroupKeys.members(2)))[0] == (0,)
    starts = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "coordinator_started"]
    assert [(e["start"], e["action"]) for e in starts] == [(1, "finish"), (2, "resume")]


def test_a_coordinator_is_held_to_its_start_bound_until_it_beats_then_to_its_timeout():
    from titan_recover.recover.children import BeatWatch

    watch = BeatWatch(b"0:1.0", timeout_s=10.0, start_s=300.0)  # a previous start's last beat
    assert watch.quiet_s(b"0:1.0", now=100.0) == (0.0, 300.0)
    assert watch.quiet_s(b"0:1.0", now=150.0) == (50.0, 300.0)  # still importing: not judged by the beat timeout
    assert watch.quiet_s(b"1:2.0", now=151.0) == (0.0, 10.0)  # it beat: from now on the beat timeout
    assert watch.quiet_s(b"1:2.0", now=162.5) == (11.5, 10.0)
    assert watch.quiet_s(b"1:3.0:warming", now=163.0) == (0.0, 300.0)  # a first compile follows: the start bound
    assert BeatWatch(b"", 10.0, 20.0, warming_s=300.0).quiet_s(b"1:3.0:warming", now=1.0) == (0.0, 300.0)


@pytest.mark.multiprocess  # a fresh interpreter importing torch: seconds, not the fast tier's
def test_the_coordinator_imports_no_client_module():
    """The coordinator is a process of its own: it shares keys and pure decisions with the ranks, not their code."""
    import subprocess
    import sys

    probe = ("import sys; import titan_recover.recover.groups.coordinator; "
             "print(sorted(m for m in sys.modules if m.startswith('titan_recover.recover.') and "
             "any(part in m for part in ('groups.member', 'groups.replica_sync', 'ftpg', 'modes'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_long_waits_are_cut_in_doubling_slices_up_to_a_cap():
    """A rank blocked on an epoch looks at ``stop`` between slices: 1 s, then doubling, capped (few c10d
    timed-out-wait lines in a long wait, and a stop still seen within the cap)."""
    from itertools import islice

    from titan_recover.recover.groups.member import wait_slices

    assert list(islice(wait_slices(1.0, 4.0), 5)) == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert list(islice(wait_slices(0.3, 1.0), 4)) == [0.3, 0.6, 1.0, 1.0]


def test_a_group_beat_carries_every_rank_and_a_missing_rank_dies_by_the_timeout_not_at_once():
    beats = {0: Heartbeat(10.0, 9.5, 4, "forward", 1), 1: Heartbeat(10.1, 9.0, 4, "phase,with,commas", 1)}
    assert decode_group_beat(encode_group_beat(beats)) == beats
    only_leader = encode_group_beat({0: beats[0]})
    read = group_beats({3: only_leader}, {3: [0, 1]}, {3: 1})
    assert read[(3, 0)] == beats[0] and read[(3, 1)] == absent_beat(1)
    watch = LivenessWatch(heartbeat_timeout_s=2.0, progress_timeout_s=10.0, max_gap_s=1.0)
    for now in (0.0, 0.5, 1.0, 1.5):  # the leader beats, rank 1 never appears
        watch.look(now, {(3, 0): beating(100 + now, incarnation=1), (3, 1): absent_beat(1)})
    assert watch.judge(3, [0, 1], incarnation=1).alive  # 1.5 s missing: not yet
    watch.look(2.5, {(3, 0): beating(102.5, incarnation=1), (3, 1): absent_beat(1)})
    assert watch.judge(3, [0, 1], incarnation=1).dead_ranks == (1,)


def _until(condition, what: str, guard_s: float = 60.0) -> None:
    """Wait until ``condition()``; ``guard_s`` only ends a wait for something that never happens (it bounds no
    latency the test asserts)."""
    deadline = time.monotonic() + guard_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


class _CountingStore:
    """A store client that counts its requests (by method name)."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)
        return counted


def test_the_leader_relays_its_groups_beats_flag_and_join_so_other_ranks_never_ask_the_job_store():
    """Two ranks of replica 0 with their group's own store (a HashStore here, torchrun's in a job): rank 1 beats
    into the group's store; the leader relays both beats as one key; a fault flag raised in the job's store reaches
    rank 1 through the leader's mirror; both ranks join the next epoch in the group's store and the last one in
    writes the group's join to the job's store, counted once. Rank 1's heartbeat thread makes no other request of
    the job's store."""
    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys, raise_fault_flag
    from titan_recover.recover.groups.member import ReplicaMember

    job, group = job_store(), HashStore()
    config = RecoverConfig(replicas=1, heartbeat_interval_s=0.05)
    address = f"127.0.0.1:{job.port}"
    with pytest.raises(ValueError, match="through the group's own store"):
        ReplicaMember(config, replica=0, rank=1, ranks_per_replica=2, address=address)
    ranks = [ReplicaMember(config, replica=0, rank=r, ranks_per_replica=2, address=address, group_store=lambda: group)
             for r in (0, 1)]
    other = _CountingStore(ranks[1]._hb_store)
    ranks[1]._hb_store = other
    try:
        for member in reversed(ranks):
            member.register()
        for member in ranks:  # members of epoch 0 (what wait_for_epoch would record)
            member.epoch, member.members, member.admitted = 0, (0,), True
        ranks[1].progress(step=7, phase="backward")

        def relayed():
            beats = decode_group_beat(job.get(GroupKeys.heartbeat(0))) if job.check([GroupKeys.heartbeat(0)]) else {}
            return sorted(beats) == [0, 1] and (beats[1].step, beats[1].phase) == (7, "backward")

        _until(relayed, "the leader relays rank 1's beat")  # waited for, not slept for: no bound on the machine
        assert other.calls == []  # rank 1 beat, and never through the job's store
        assert not job.check(["hb/0/1"]) and group.check([GroupKeys.rank_beat(1)])
        raise_fault_flag(job, 0, "a peer died")
        _until(lambda: ranks[1].fault_seen(0), "the flag reaches rank 1")
        assert group.check([GroupKeys.fault(0)])
        _until(lambda: ranks[1].fault_flag(0) is not None, "the flag's value follows the join")
        assert ranks[1].fault_flag(0) == job.get(GroupKeys.fault(0))  # when and why, read in the group's store
        _until(lambda: job.add(GroupKeys.joined_count(1), 0) == 1, "the group is counted in")
        ranks_in, writer = job.get(GroupKeys.join(1, 0)).decode().split("|")
        assert ranks_in == "0,1" and group.add(GroupKeys.joined_ranks(1), 0) == 2
        assert other.calls == (["compare_set", "add"] if writer == "1" else [])
    finally:
        for member in ranks:
            member.close()


def test_a_leader_completes_its_groups_join_for_a_rank_that_finished_training():
    """Rank 1 finished training (its heartbeat stopped, so it never joins): the leader, seeing its ``done`` in the
    group's store at its next beat, writes and counts the group's join itself."""
    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys, raise_fault_flag
    from titan_recover.recover.groups.member import ReplicaMember

    job, group = job_store(), HashStore()
    config = RecoverConfig(replicas=1, heartbeat_interval_s=0.05)
    ranks = [ReplicaMember(config, replica=0, rank=r, ranks_per_replica=2, address=f"127.0.0.1:{job.port}",
                           group_store=lambda: group) for r in (0, 1)]
    try:
        for member in ranks:
            member.register()
            member.epoch, member.members, member.admitted = 0, (0,), True
        ranks[1].finish()
        raise_fault_flag(job, 0, "a peer died")
        _until(lambda: job.add(GroupKeys.joined_count(1), 0) == 1, "the leader counts its group in")
        assert job.get(GroupKeys.join(1, 0)) == b"0,1|0" and group.add(GroupKeys.joined_ranks(1), 0) == 1
    finally:
        ranks[0].close()


def test_the_coordinator_names_the_ranks_a_group_left_out_was_missing(tmp_path):
    """After a flag: group 0's join is complete, group 1's leader reported rank 0 only, group 2 (its leader gone)
    reported nothing: the new epoch keeps group 0 and says which ranks of the others did not join."""
    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys, raise_fault_flag
    from titan_recover.recover.groups.protocol import decode_members

    store = job_store()
    config = RecoverConfig(replicas=3, join_window_s=0.3, min_replicas=1)
    coordinator = Coordinator(config, store, replicas=3, ranks_per_replica=2, run_dir=str(tmp_path))
    coordinator.incarnation = {0: 0, 1: 0, 2: 0}
    coordinator._publish(0, (0, 1, 2), (), "all replicas registered", timing={})
    raise_fault_flag(store, 0, "replica 2 rank 0: collective failed")
    store.set(GroupKeys.join(1, 0), "0,1|1")
    store.add(GroupKeys.joined_count(1), 1)
    store.set(GroupKeys.joining(1, 1), "0")
    coordinator._form_next_epoch()
    members, reason = decode_members(store.get(GroupKeys.members(1)))
    assert members == (0,)
    assert "replica 1 rank(s) [1] did not join" in reason and "replica 2 rank(s) [0, 1] did not join" in reason


def test_a_groups_other_ranks_enter_the_epoch_their_leader_found_without_asking_the_job_store():
    """The leader waits for the next epoch in the job's store and passes what it found on in its group's store: the
    group's other rank enters the same epoch from there, with no request of the job's store, also when it waits
    after an epoch the leader went past (the leader entered epoch 3 from epoch 1); a stop and an epoch that leaves
    the group out reach it the same way. The leader reads what woke it in one request."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.member import Excluded, ReplicaMember, TooFewReplicas
    from titan_recover.recover.groups.protocol import encode_members

    job, group = job_store(), HashStore()
    config = RecoverConfig(replicas=2)
    address = f"127.0.0.1:{job.port}"
    leader, other = (ReplicaMember(config, replica=1, rank=r, ranks_per_replica=2, address=address,
                                   group_store=lambda: group) for r in (0, 1))
    other.store = _CountingStore(other.store)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(other.wait_for_epoch, -1, 20.0)
        job.set(GroupKeys.members(0), encode_members((0, 1), "all replicas registered"))
        job.set(GroupKeys.EPOCH, "0")
        assert leader.wait_for_epoch(-1, 5.0) == (0, (0, 1), "all replicas registered")
        assert waiting.result(timeout=20) == (0, (0, 1), "all replicas registered") and other.epoch == 0

        for epoch in (1, 2, 3):
            job.set(GroupKeys.members(epoch), encode_members((0, 1), f"epoch {epoch}"))
        job.set(GroupKeys.EPOCH, "3")
        assert leader.wait_for_epoch(0, 5.0)[0] == 3
        assert other.wait_for_epoch(1, 5.0) == (3, (0, 1), "epoch 3")  # it was still in epoch 1

        job.set(GroupKeys.members(4), encode_members((0,), "replica 1 rank(s) [1] did not join"))
        job.set(GroupKeys.EPOCH, "4")
        leader.store = _CountingStore(leader.store)
        for member in (leader, other):
            with pytest.raises(Excluded, match="replica 1 left out of epoch 4"):
                member.wait_for_epoch(3, 5.0)
        job.set(GroupKeys.STOP, "only 1 replica(s) left")  # the coordinator writes a stop before the members
        job.set(GroupKeys.members(5), encode_members((1,), "only 1 replica(s) left"))
        for member in (leader, other):
            with pytest.raises(TooFewReplicas, match="only 1 replica"):
                member.wait_for_epoch(4, 5.0)
    assert other.store.calls == []
    # the leader, woken by the next epoch's members, looks at the stop, then reads the newest epoch and its members
    # in one request; woken by a stop, it reads the stop's reason and whether it is untrusted
    assert leader.store.calls == ["wait", "check", "multi_get"] + ["wait", "check", "get", "check"]


def test_missing_keys_are_found_by_halving_a_check_of_all_of_them():
    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import missing_keys

    store = _CountingStore(HashStore())
    keys = [f"join/e1/{g}" for g in range(128)]
    for key in keys:
        if key not in ("join/e1/5", "join/e1/77"):
            store.store.set(key, "1")
    assert missing_keys(store, keys) == ["join/e1/5", "join/e1/77"]
    assert 2 < len(store.calls) <= 2 * 2 * 7 + 1  # two of 128: a few checks, not 128
    store.calls.clear()
    assert missing_keys(store, keys[:5] + keys[6:77]) == [] and store.calls == ["check"]  # every one there: one
    store.calls.clear()
    assert missing_keys(store, keys, expected=40) == ["join/e1/5", "join/e1/77"]
    assert len(store.calls) == 128  # halving would cost more than a check each: one each
    assert missing_keys(store, []) == []


def test_the_coordinator_reads_joins_in_a_few_requests_and_evictions_only_when_a_vote_named_some(tmp_path):
    """128 groups, one of which never joins: the coordinator finds it without a request per group; a vote's
    evictions are read only once its marker says there are some (the next epoch, where every member joins: one
    request for the joins), and the voted-out group is left out."""
    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys, raise_fault_flag
    from titan_recover.recover.groups.protocol import decode_members

    class Keys(_CountingStore):
        """Also records the keys of every ``check``."""

        def __init__(self, store):
            super().__init__(store)
            self.checked = []

        def check(self, keys):
            self.checked.append(list(keys))
            return self.store.check(keys)

    groups = 128
    store = job_store()
    config = RecoverConfig(replicas=groups, join_window_s=0.3, min_replicas=1)
    coordinator = Coordinator(config, store, replicas=groups, ranks_per_replica=1, run_dir=str(tmp_path))
    coordinator.incarnation = {g: 0 for g in range(groups)}
    coordinator._publish(0, tuple(range(groups)), (), "all replicas registered", timing={})
    coordinator.store = counted = Keys(store)
    for epoch, evicted in ((0, None), (1, 9)):
        raise_fault_flag(store, epoch, f"replica 5 rank 0: collective failed (epoch {epoch})")
        if evicted is not None:
            store.set(GroupKeys.evicted(epoch, evicted), "step 3: its parameters differ")
            store.set(GroupKeys.evictions(epoch), "1")
        for g in coordinator.members:
            if g != 5:
                store.set(GroupKeys.join(epoch + 1, g), "0|0")
                store.add(GroupKeys.joined_count(epoch + 1), 1)
        counted.checked.clear()
        before = len(coordinator.members)
        coordinator._form_next_epoch()
        joins = [keys for keys in counted.checked if keys[0].startswith("join/")]
        evictions = [keys for keys in counted.checked if keys[0].startswith("evicted/")]
        assert len(joins) <= 1 + 2 * 7 + 1, len(joins)  # all of them, two halves a level, group 5's report
        assert len(evictions) == (1 if evicted is None else 1 + before)  # the marker, then each member's key
        members, reason = decode_members(store.get(GroupKeys.members(epoch + 1)))
        assert members == tuple(g for g in range(groups) if g not in (5, evicted))
        assert ("replica 5 rank(s) [0] did not join" if evicted is None else "replica 9 declared failed") in reason


def _two_groups_of_two(config=None):
    """Replica groups 0 and 1 of two ranks each, members of epoch 0, with the job's store and a store per group
    (HashStores, as torchrun's would be): their ``ReplicaSync`` by (replica, rank), and the job's store."""
    from torch.distributed import HashStore

    from titan_recover.recover.events import EventLog
    from titan_recover.recover.groups.member import ReplicaMember
    from titan_recover.recover.groups.replica_sync import ReplicaSync

    config = config or RecoverConfig(replicas=2, collective_timeout_s=10.0)
    job = job_store()
    groups = {replica: HashStore() for replica in (0, 1)}
    syncs = {}
    for replica in (0, 1):
        for rank in (0, 1):
            member = ReplicaMember(config, replica=replica, rank=rank, ranks_per_replica=2,
                                   address=f"127.0.0.1:{job.port}", group_store=lambda r=replica: groups[r])
            member.epoch, member.members, member.admitted = 0, (0, 1), True
            syncs[(replica, rank)] = ReplicaSync(config, member, EventLog(None, f"{replica}/{rank}"))
    return syncs, job, groups


def _barrier_in_threads(syncs, step, timeout_s=20.0):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(syncs)) as pool:
        futures = {key: pool.submit(sync.commit_barrier, step) for key, sync in syncs.items()}
        return {key: future.result(timeout=timeout_s) for key, future in futures.items()}


def test_the_commit_barrier_counts_groups_in_the_job_store_and_passes_the_decision_on_in_each_group():
    from titan_recover.recover.groups.keys import GroupKeys

    syncs, job, groups = _two_groups_of_two()
    decisions = _barrier_in_threads(syncs, 3)
    assert set(decisions.values()) == {"commit"}
    assert job.add(GroupKeys.reduced(0, 3), 0) == 2  # one per group, not one per rank
    assert all(g.get(GroupKeys.decision(0, 3)) == b"commit" for g in groups.values())
    assert not job.check([GroupKeys.fault(0)])


def test_ranks_waiting_in_a_commit_barrier_stamp_their_progress_so_none_is_taken_for_hung(monkeypatch):
    """Group 1 never counts in (its main thread is stuck); group 0's ranks wait in the barrier until its timeout.
    While they wait, each stamps its progress at every slice of the wait (slices of 0.1 s here): no gap between
    stamps comes near the wait (1 s). Unstamped, a wait longer than ``progress_timeout_s`` had the coordinator
    declare the waiting ranks hung as well, and a stall of one group lost the job every group (the fault soak)."""
    import itertools

    from titan_recover.recover.groups import member
    from titan_recover.recover.groups.keys import GroupKeys

    monkeypatch.setattr(member, "wait_slices", lambda: itertools.repeat(0.1))
    syncs, job, _ = _two_groups_of_two(RecoverConfig(replicas=2, heartbeat_interval_s=0.02, join_window_s=0.05,
                                                     heartbeat_timeout_s=0.1, collective_timeout_s=1.0))
    waiting = {key: sync for key, sync in syncs.items() if key[0] == 0}
    stamps = {key: [] for key in waiting}
    for key, sync in waiting.items():
        monkeypatch.setattr(sync.member, "progress", lambda *a, key=key, **k: stamps[key].append(time.monotonic()))
    started = time.monotonic()
    decisions = _barrier_in_threads(waiting, 3)
    ended = time.monotonic()
    assert set(decisions.values()) == {"abort"}  # timed out waiting for group 1, and said so
    assert "commit barrier of step 3 timed out" in job.get(GroupKeys.fault(0)).decode()
    assert ended - started >= 1.0
    for key, times in stamps.items():
        gaps = [b - a for a, b in zip([started, *times], [*times, ended])]
        assert max(gaps) < 0.6, (key, gaps)  # stamped all along, not once before a 1 s wait


def test_an_admission_barrier_waits_while_the_transfer_moves_and_not_once_it_stands_still():
    """Group 1 reaches the admission's barrier only after 4 timeouts (a long state transfer); group 0 waits for
    it: as long as the transfer's counter moves (a chunk every fifth of a timeout) the wait goes on and the
    admission commits; with the counter standing still the wait ends after a timeout or two, flag raised, aborted."""
    import threading

    from titan_recover.recover.groups.keys import GroupKeys

    timeout = 0.3
    for moves, expected in ((True, "commit"), (False, "abort")):
        syncs, job, _ = _two_groups_of_two(RecoverConfig(replicas=2, heartbeat_interval_s=0.02, join_window_s=0.05,
                                                         heartbeat_timeout_s=0.1, collective_timeout_s=timeout))
        moving = GroupKeys.transferred(0)
        stop = threading.Event()

        def donor():  # the transfer's chunks, until the barrier is over
            while not stop.wait(timeout / 5):
                if moves:
                    job.add(moving, 1)

        def barrier(key):  # group 1's ranks come once their part of the transfer is through (or failed: the flag)
            arrives = time.monotonic() + 4 * timeout
            while key[0] == 1 and time.monotonic() < arrives and not job.check([GroupKeys.fault(0)]):
                time.sleep(0.01)
            return syncs[key].commit_barrier("admit5", moving=moving)

        threading.Thread(target=donor, daemon=True).start()
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(4)
        try:
            futures = {key: pool.submit(barrier, key) for key in syncs}
            decisions = {key: f.result(timeout=30) for key, f in futures.items()}
        finally:
            stop.set()
            pool.shutdown(wait=False)
        assert set(decisions.values()) == {expected}, (moves, decisions)
        assert job.check([GroupKeys.fault(0)]) == (not moves)


def test_a_rank_that_saw_a_fault_aborts_the_step_for_every_group():
    """Rank 1 of group 0 saw the fault flag before the barrier: it proposes ``abort`` without counting in; its
    leader, waiting for it, wakes by the passed-on decision, and group 1 (counted in) reads it from the job."""
    syncs, job, groups = _two_groups_of_two()
    syncs[(0, 1)]._fault_seen = lambda: True  # what its heartbeat thread would have recorded
    assert set(_barrier_in_threads(syncs, 4).values()) == {"abort"}


def test_a_flag_while_a_rank_never_arrives_wakes_every_waiting_rank_with_abort():
    """Rank 1 of group 1 never reaches the barrier (stuck in its collective); the others wait: group 0 in the job's
    store, group 1's leader for its rank. The flag, seen by each leader's heartbeat thread, stores ``abort`` and
    passes it on in each group: every waiting rank returns ``abort``, woken by that decision and not by the
    barrier's timeout (a rank that times out raises the epoch's flag, which stays down here). The test waits for
    the ranks to be inside the barrier instead of sleeping, so no step depends on the machine's speed."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from titan_recover.recover.groups.keys import GroupKeys

    syncs, job, groups = _two_groups_of_two()
    waiting = {key: sync for key, sync in syncs.items() if key != (1, 1)}
    leaders = ((0, 0), (1, 0))
    with ThreadPoolExecutor(len(waiting)) as pool:
        futures = {key: pool.submit(sync.commit_barrier, 5) for key, sync in waiting.items()}
        _until(lambda: all(syncs[k].member.waiting_on == (0, 5) for k in waiting), "every rank waits in the barrier")
        assert not any(f.done() for f in futures.values())
        for leader in leaders:  # as their heartbeat threads do on the flag
            threading.Thread(target=syncs[leader].member._abort_barrier, args=(0, 5)).start()
        decisions = {key: f.result(timeout=4 * syncs[(0, 0)].config.collective_timeout_s)
                     for key, f in futures.items()}
    assert set(decisions.values()) == {"abort"}
    assert not job.check([GroupKeys.fault(0)])  # nobody timed out: the passed-on decision woke every rank


def test_a_group_looks_at_the_flag_as_one_and_its_other_ranks_never_ask_the_job_store():
    """Before a collective each rank looks at its epoch's fault flag (``catch_up``). The leader looks and passes its
    answer on in the group's store; rank 1 takes it. A flag raised between the leader's look and rank 1's does not
    split the group (rank 1 stays in epoch 0 with its leader, although the job's store holds the flag); at the next
    look both move, and rank 1 enters the leader's epoch and reads the ledger's epochs (one it went past included)
    in the group's store. Rank 1 makes no request of the job's store."""
    from titan_recover.recover.groups.keys import GroupKeys, raise_fault_flag
    from titan_recover.recover.groups.protocol import encode_members

    syncs, job, groups = _two_groups_of_two()
    leader, other = syncs[(0, 0)], syncs[(0, 1)]
    other.member.store = _CountingStore(other.member.store)
    leader.catch_up(step=1)
    raise_fault_flag(job, 0, "replica 1 rank 0: collective failed")
    other.catch_up(step=1)
    assert (leader.epoch, other.epoch) == (0, 0)

    for epoch, members in ((1, (0, 1)), (2, (0,))):  # the coordinator published two epochs since
        job.set(GroupKeys.members(epoch), encode_members(members, f"epoch {epoch}"))
    job.set(GroupKeys.EPOCH, "2")
    leader.build_group = other.build_group = lambda *args, **kwargs: None  # no collective in this test
    leader.catch_up(step=1)
    other.catch_up(step=1)
    assert (leader.epoch, other.epoch) == (2, 2) and other.members == (0,)
    assert [other.members_of(e) for e in (1, 2)] == [(0, 1), (0,)]
    assert other.member.store.calls == []


def test_a_rank_whose_leader_is_in_another_epoch_at_a_look_or_passes_nothing_on_stops_with_a_sentence():
    from titan_recover.recover.groups.keys import GroupKeys

    syncs, _, groups = _two_groups_of_two()
    groups[0].set(GroupKeys.look(1), "3 stay")
    with pytest.raises(RuntimeError, match="replica 0 rank 1 is in epoch 0 and its group's leader in epoch 3"):
        syncs[(0, 1)].catch_up(step=1)
    # a leader that passes nothing on: the wait ends by its bound with a sentence naming what and which setting
    from titan_recover.recover.groups.member import TooFewReplicas
    with pytest.raises(TooFewReplicas, match=r"replica 1 rank 1: its group's leader \(rank 0\) passed on no look at "
                                             r"the fault flag within 0.05 s \(recover.agree_timeout_s\): it is gone"):
        syncs[(1, 1)].member.from_leader(GroupKeys.look(1), 0.05, waiting_for="look at the fault flag",
                                         bound="recover.agree_timeout_s", error=TooFewReplicas, then="it is gone")


def test_a_groups_store_keeps_only_the_last_barriers_keys_whatever_the_steps():
    """Steps of looks and commit barriers: once every rank of a group counted in at a barrier, its leader hands the
    group's keys of the barrier before and of the looks so far to its heartbeat thread, which deletes them. After
    any number of steps a group's store holds the last barrier's three keys (the heartbeat thread's deletion is
    called directly here: these members run no heartbeat thread)."""
    from titan_recover.recover.groups.keys import GroupKeys

    syncs, job, groups = _two_groups_of_two()
    for step in range(1, 6):
        for sync in syncs.values():
            sync.catch_up(step)
        assert set(_barrier_in_threads(syncs, step).values()) == {"commit"}
        for replica in (0, 1):
            syncs[(replica, 0)].member._delete_discarded()
            assert groups[replica].num_keys() == 3  # reduced, decision and ready of this step
    last = [GroupKeys.reduced(0, 5), GroupKeys.decision(0, 5), GroupKeys.group_ready(0, 5)]
    assert all(g.check(last) for g in groups.values())
    assert not any(g.check([GroupKeys.look(5)]) or g.check([GroupKeys.decision(0, 4)]) for g in groups.values())


def test_only_a_groups_leader_holds_a_step_for_a_restarting_group_and_its_other_ranks_wait_in_the_groups_store():
    """``rejoin_wait_s``: replica 1 was dropped and has a restart left. Replica 0's leader holds the step boundary,
    looking in the job's store, until the new start's ranks all asked to join; its other rank waits for the
    leader's word in the group's store and makes no request of the job's store; the same for the replicas the
    admission then let in. With every group a member, no rank makes any request to hold."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import HashStore

    from titan_recover.recover.events import EventLog
    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.member import ReplicaMember
    from titan_recover.recover.groups.replica_sync import ReplicaSync
    from titan_recover.recover.phoenix.admission import Admission

    job, group = job_store(), HashStore()
    config = RecoverConfig(replicas=2, max_restarts=1, rejoin_wait_s=60.0)
    admissions = []
    for rank in (0, 1):
        member = ReplicaMember(config, replica=0, rank=rank, ranks_per_replica=2, address=f"127.0.0.1:{job.port}",
                               group_store=lambda: group)
        member.epoch, member.members, member.admitted = 1, (0,), True
        member.store = _CountingStore(member.store)
        admissions.append(Admission(ReplicaSync(config, member, EventLog(None, f"0/{rank}"))))
    leader, other = (a.sync.member for a in admissions)
    job.set(GroupKeys.dropped(1), f"0|{time.time()}")
    with ThreadPoolExecutor(2) as pool:
        holding = [pool.submit(a._hold_for_restarts, 3) for a in admissions]
        _until(lambda: "check" in leader.store.calls, "the leader looks for replica 1's new start")
        assert not any(h.done() for h in holding)
        for rank in (0, 1):
            job.set(GroupKeys.join_request(1, rank), "1")
        for h in holding:
            h.result(timeout=30)
    assert other.store.calls == [] and group.check([GroupKeys.held(3)])
    # the replicas an admission from epoch 0 let in (the leader reads them, its rank takes them from it)
    job.set(GroupKeys.admitted(1), "3|1")
    assert [a._admitted_since(0) for a in admissions] == [(1,), (1,)]
    assert other.store.calls == []
    leader.store.calls.clear()
    for a in admissions:
        a.sync.member.members = (0, 1)
        a._hold_for_restarts(4)
    assert leader.store.calls == other.store.calls == []


def test_a_joining_groups_ranks_all_enter_the_epoch_its_leader_was_admitted_to():
    """A restarted group of two ranks: each asks to join in the job's store; the leader waits for the epoch that
    admits it and passes it on with the admission; rank 1 enters the same epoch from its group's store, its only
    job-store request its join request, also when the coordinator moved on to a later epoch before rank 1 would
    have looked. A job that ends first ends both waits with ``JobOver``."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.member import JobOver, ReplicaMember
    from titan_recover.recover.groups.protocol import encode_admission, encode_members

    def joiners(incarnation):
        job, group = job_store(), HashStore()
        ranks = [ReplicaMember(RecoverConfig(replicas=2), replica=1, rank=r, ranks_per_replica=2,
                               address=f"127.0.0.1:{job.port}", incarnation=incarnation, group_store=lambda: group)
                 for r in (0, 1)]
        ranks[1].store = _CountingStore(ranks[1].store)
        return job, ranks

    job, (leader, other) = joiners(1)
    job.set(GroupKeys.members(2), encode_members((0,), "replica 1 rank(s) [0] did not join"))
    job.set(GroupKeys.EPOCH, "2")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(other.wait_for_admission, 20.0)
        job.set(GroupKeys.admitted(3), encode_admission(5, (1,)))
        job.set(GroupKeys.members(3), encode_members((0, 1), "admitted [1] after step 5"))
        job.set(GroupKeys.members(4), encode_members((0, 1), "a fault during the admission"))
        job.set(GroupKeys.EPOCH, "4")
        assert leader.wait_for_admission(5.0) == (4, (0, 1), "a fault during the admission", "5|1")
        assert waiting.result(timeout=20) == (4, (0, 1), "a fault during the admission", "5|1")
    assert other.epoch == 4 and other.admitted and other.store.calls == ["set"]
    assert other.entered_members_of(4) == (0, 1)

    job, (leader, other) = joiners(2)
    job.set(GroupKeys.FINISHED, "trained")
    for member in (leader, other):
        with pytest.raises(JobOver, match="the job ended before this replica was admitted"):
            member.wait_for_admission(5.0)


def test_a_joiner_enters_only_an_epoch_that_admitted_its_own_start():
    """Start 2 of replica 1 asks to join while the coordinator (hung, restarting) has not yet handled the loss of
    start 0: the current epoch still lists replica 1, with no admission. Then the coordinator admits the request
    start 1 left before it was lost too. Start 2 takes neither for its own (it would train in an epoch the
    coordinator watches another start in, and be declared dead): it waits, and enters the epoch admitting it."""
    from concurrent.futures import ThreadPoolExecutor

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.member import ReplicaMember
    from titan_recover.recover.groups.protocol import encode_admission, encode_members

    job = job_store()
    joiner = ReplicaMember(RecoverConfig(replicas=2), replica=1, rank=0, ranks_per_replica=1,
                           address=f"127.0.0.1:{job.port}", incarnation=2)
    job.set(GroupKeys.members(0), encode_members((0, 1), "all replicas registered"))
    job.set(GroupKeys.EPOCH, "0")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(joiner.wait_for_admission, 20.0)
        time.sleep(0.3)  # it looked at epoch 0, which lists replica 1 (start 0's), and went on waiting
        job.set(GroupKeys.members(1), encode_members((0,), "replica 1 rank(s) [0]: no heartbeat"))
        job.set(GroupKeys.admitted(2), encode_admission(4, (1,), (1,)))  # start 1's request, start 1 lost
        job.set(GroupKeys.members(2), encode_members((0, 1), "admitted [1] after step 4"))
        job.set(GroupKeys.EPOCH, "2")
        time.sleep(0.3)
        assert not waiting.done()
        job.set(GroupKeys.members(3), encode_members((0,), "replica 1 rank(s) [0]: no heartbeat"))
        job.set(GroupKeys.admitted(4), encode_admission(5, (1,), (2,)))
        job.set(GroupKeys.members(4), encode_members((0, 1), "admitted [1] after step 5"))
        job.set(GroupKeys.EPOCH, "4")
        assert waiting.result(timeout=20) == (4, (0, 1), "admitted [1] after step 5", "5|1|2")
    assert joiner.epoch == 4 and joiner.admitted


def test_an_admission_that_keeps_failing_leaves_the_joiners_out_and_the_members_train_on():
    """Every try of an admission failed (a joiner whose memory keeps failing the checksum): after the step's
    epochs, the members vote the joiners out (their names, the marker, the epoch's flag, as after corruption) and
    move to the next epoch, instead of ending the job; a joiner that ran out of tries ends with a sentence."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.phoenix.admission import Admission

    store, moves = HashStore(), []

    class Sync:
        joining, pending, epoch, members = False, (4, (2,)), 5, (0, 1, 2)
        config = SimpleNamespace(step=SimpleNamespace(max_epochs_per_step=1))
        member = SimpleNamespace(store=store, replica=0, rank=0)

        def next_epoch(self, step):
            moves.append((self.epoch, store.check([GroupKeys.fault(self.epoch)])))
            self.epoch += 1

    admission = Admission(Sync())
    admission._admitted_since = lambda before: (2,)
    admission._attempt = lambda *args: False
    admission.admit_pending(5, state=None)
    evicted_in = moves[-1][0]
    assert len(moves) == 1 + 2 + 1 and moves[-1][1]  # asked, two tries, then out with the flag up
    assert store.get(GroupKeys.evicted(evicted_in, 2)).decode().startswith("step 5: admission after step 4 failed")
    assert store.check([GroupKeys.evictions(evicted_in)]) and not store.check([GroupKeys.evicted(evicted_in, 1)])

    joiner_sync = Sync()
    joiner_sync.joining, joiner_sync.member = True, SimpleNamespace(store=HashStore(), replica=2, rank=0)
    joiner = Admission(joiner_sync)
    joiner._wait_until_admitted = lambda: (4, (2,))
    joiner._attempt = lambda *args: False
    with pytest.raises(RuntimeError, match="replica 2: admission after step 4 failed in 2 consecutive epochs; "
                                           "this joiner ends"):
        joiner.admit_pending(5, state=None)


def test_a_coordinator_whose_first_epoch_stops_the_job_waits_for_its_members_and_records_the_verdict(tmp_path):
    """Fewer replicas registered than ``min_replicas``: epoch 0 is published with the stop, and the coordinator
    then waits for the members to finish and records ``stopped`` (exit 1 after that), instead of exiting at once,
    which its launcher would take for a crash and answer with a restart (and, without restarts, another reason)."""
    import threading

    from torch.distributed import HashStore

    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys

    store = HashStore()
    config = RecoverConfig(replicas=2, min_replicas=2, startup_timeout_s=0.3)
    store.set(GroupKeys.register(0, 0), "1,host,1,0")
    coordinator = Coordinator(config, store, replicas=2, ranks_per_replica=1, run_dir=str(tmp_path))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", coordinator.run()), daemon=True)
    thread.start()
    _until(lambda: store.check([GroupKeys.STOP]), "epoch 0 is published with the stop")
    assert "fewer than recover.min_replicas = 2" in store.get(GroupKeys.STOP).decode()
    thread.join(1.0)
    assert thread.is_alive() and not store.check([GroupKeys.FINISHED])  # the member has not finished yet
    store.set(GroupKeys.done(0, 0), "1")
    thread.join(10.0)
    assert result == {"code": 1} and store.get(GroupKeys.FINISHED) == b"stopped"


def test_after_a_stop_a_member_that_dies_is_not_waited_for(tmp_path):
    """The job stops (a launcher's stop request) while a member dies, as when a preempted node's group leaves while
    the job stops: the survivors finish, and the coordinator records ``stopped`` once the dead member's heartbeat
    timed out, instead of waiting forever for it to finish. No fault flag is raised for it: no epoch follows."""
    import threading

    from torch.distributed import HashStore

    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys

    from titan_recover.recover.groups.liveness import encode_group_beat, Heartbeat

    store = HashStore()
    config = RecoverConfig(replicas=2, heartbeat_timeout_s=1.0, startup_timeout_s=5.0)  # no beat moves: dead after 1 s
    for replica in (0, 1):
        store.set(GroupKeys.register(replica, 0), f"{replica},host,1,0")
        store.set(GroupKeys.heartbeat(replica), encode_group_beat({0: Heartbeat(time.time(), time.time(), 1, "x")}))
    coordinator = Coordinator(config, store, replicas=2, ranks_per_replica=1, run_dir=str(tmp_path))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", coordinator.run()), daemon=True)
    thread.start()
    _until(lambda: store.check([GroupKeys.members(0)]), "epoch 0 is formed of both")
    store.set(GroupKeys.STOP, "stop requested (a test)")
    store.set(GroupKeys.done(0, 0), "1")  # replica 0 finished (as ReplicaMember.finish does); replica 1 never
    store.add(GroupKeys.DONE_COUNT, 1)  # beats again
    thread.join(15.0)
    assert result == {"code": 1} and store.get(GroupKeys.FINISHED) == b"stopped"
    assert not store.check([GroupKeys.fault(0)])
    # named lost, so that a stop's checkpoint writer found dead passes its turn on (tests/test_stop_checkpoint.py)
    assert store.check([GroupKeys.stop_lost(1)]) and not store.check([GroupKeys.stop_lost(0)])


def test_a_replica_restarted_before_epoch_0_joins_by_admission_not_as_a_member_of_epoch_0(tmp_path):
    """Replica 1's first start crashed while building its model and its launcher restarted it (incarnation 1)
    before epoch 0 was formed: it waits to be admitted (a joiner), so epoch 0 is formed of replica 0 alone at once
    (not after the start-up timeout), and the reason says why."""
    from torch.distributed import HashStore

    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.protocol import decode_members

    store = HashStore()
    store.set(GroupKeys.register(0, 0), "1,host,1,0")
    store.set(GroupKeys.register(1, 0), "2,host,1,1")
    coordinator = Coordinator(RecoverConfig(replicas=2, startup_timeout_s=60.0), store, replicas=2,
                              ranks_per_replica=1, run_dir=str(tmp_path))
    started = time.monotonic()
    assert coordinator._form_first_epoch()
    assert time.monotonic() - started < 30
    members, reason = decode_members(store.get(GroupKeys.members(0)))
    assert members == (0,) and "replicas [1] restarted before epoch 0: they join by admission" in reason


def test_each_epochs_group_closes_the_one_before_and_side_groups_close_nothing(monkeypatch):
    """The group of a new epoch replaces the previous epoch's, which is closed then (a NCCL communicator would
    hold its device buffers until the process exits); a side group (a state transfer's) closes nothing, and the
    epoch's group stays in use."""
    from types import SimpleNamespace

    from titan_recover.recover.groups import replica_sync

    built = []

    class Group:
        def __init__(self, members, tag):
            self.members, self.tag, self.closed = members, tag, False
            built.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(replica_sync, "build_group",
                        lambda config, store, **kw: Group(kw["members"], kw["tag"]))
    member = SimpleNamespace(store=None, epoch=0, members=(0, 1), replica=0, rank=0, incarnation=0,
                             progress=lambda *a, **k: None, watches_faults=False)
    sync = replica_sync.ReplicaSync(RecoverConfig(replicas=2), member, events=None)
    first = sync.build_group()
    member.epoch, member.members = 1, (0, 2)
    side = sync.build_group(members=(0,), tag="transfer", host=True)
    assert sync.group is first and not first.closed and not side.closed
    second = sync.build_group()
    assert sync.group is second and second.members == (0, 2)
    assert first.closed and not second.closed and not side.closed


@pytest.mark.parametrize("outcome", ["transferred", "failed"])
def test_a_state_transfers_group_is_closed_when_the_transfer_is_over(monkeypatch, outcome):
    """The group of a donor and its joiners is used for one transfer: closed after it, whether the transfer went
    through or failed (a group left open would keep its threads and connections to the end of the run)."""
    from types import SimpleNamespace

    from titan_recover.recover.ftpg.base import FaultDetected
    from titan_recover.recover.phoenix import admission as admission_module
    from titan_recover.recover.phoenix.state_transfer import TransferStats

    class Group:
        closed = False

        def close(self):
            self.closed = True

    group, emitted = Group(), []

    def transfer(state, broadcast, **kwargs):
        assert not group.closed  # in use until the transfer is over
        if outcome == "failed":
            raise FaultDetected("replica 1: lost during the transfer", raised_here=False)
        return TransferStats(bytes=8, chunks=1)

    monkeypatch.setattr(admission_module, "transfer", transfer)
    member = SimpleNamespace(replica=0, progress=lambda **kw: None)
    sync = SimpleNamespace(member=member, epoch=3, chaos=None, build_group=lambda **kw: group,
                           events=SimpleNamespace(emit=lambda name, **kw: emitted.append(name)))
    admission = admission_module.Admission(sync)
    if outcome == "failed":
        with pytest.raises(FaultDetected, match="lost during the transfer"):
            admission._transfer(state=None, donor=0, joiners=(1,), step=5)
    else:
        admission._transfer(state=None, donor=0, joiners=(1,), step=5)
        assert emitted == ["state_transferred"]
    assert group.closed


def test_a_hold_for_a_restart_never_outlasts_rejoin_wait_s_whatever_the_coordinators_clock():
    """The drop's time is the coordinator's wall clock, on another host perhaps: a member's host whose clock is
    behind would otherwise hold the whole job for the skew on top of ``rejoin_wait_s``. The hold's end is fixed at
    the first sight, on the leader's monotonic clock."""
    from types import SimpleNamespace

    from titan_recover.recover.phoenix.admission import Admission

    admission = Admission(SimpleNamespace(config=SimpleNamespace(rejoin_wait_s=10.0)))
    now, mono = time.time(), time.monotonic()
    ahead = admission._hold_end(1, 0, dropped_at=now + 3600) - mono  # the coordinator's clock an hour ahead
    assert 9.0 < ahead <= 10.5
    assert 6.0 < admission._hold_end(2, 0, dropped_at=now - 3) - mono <= 7.5  # dropped 3 s ago
    assert admission._hold_end(3, 0, dropped_at=now - 3600) - mono <= 0.5  # long ago: no hold
    assert admission._hold_end(1, 0, dropped_at=now - 3600) - mono == ahead  # fixed at the first sight
