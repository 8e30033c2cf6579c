"""Pure parts of the replica-group protocol: liveness, membership, commit decisions, timeouts, chaos schedule."""

from __future__ import annotations

import time

import pytest

from titan_recover.config.apply import ConfigError
from titan_recover.config.loader import build_config
from titan_recover.recover.chaos import ChaosConfig, FaultSpec
from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.protocol import (
    all_joined,
    decide_commit,
    decide_members,
    decode_members,
    encode_members,
    Heartbeat,
    judge_liveness,
)


def test_liveness_dead_vs_hung():
    now = 100.0
    beats = {
        0: Heartbeat(99.9, 99.9, 3, "forward"),  # healthy
        1: Heartbeat(97.0, 97.0, 3, "reduction"),  # no beat for 3 s: dead or stopped
        2: Heartbeat(99.95, 80.0, 3, "forward"),  # beating, main thread stuck 20 s: hung
        3: None,  # never beat
    }
    verdict = judge_liveness(7, beats, now, heartbeat_timeout_s=2.0, progress_timeout_s=10.0)
    assert verdict.dead_ranks == (1, 3) and verdict.hung_ranks == (2,) and not verdict.alive
    assert "replica 7 rank(s) [1, 3]: no heartbeat" in verdict.reason() and "hung" in verdict.reason()
    healthy = judge_liveness(7, {0: beats[0]}, now, 2.0, 10.0)
    assert healthy.alive and healthy.reason() == ""
    assert Heartbeat.decode(beats[2].encode()) == beats[2]


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
    from titan_recover.recover.chaos import ChaosMonkey, InjectedFault

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
    from titan_recover.recover.chaos import ChaosMonkey, FaultSpec

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
    from titan_recover.recover.protocol import CommitDecision

    assert CommitDecision("commit").encode() == "commit"
    assert CommitDecision.decode(b"commit") == CommitDecision("commit", ())
    both = CommitDecision("commit", (3, 4))
    assert CommitDecision.decode(both.encode()) == both and both.encode() == "commit+3,4"
    assert CommitDecision.decode("abort").outcome == "abort"
    with pytest.raises(ValueError, match="only a commit admits"):
        CommitDecision("abort", (1,)).encode()
    with pytest.raises(ValueError, match="not a commit decision"):
        CommitDecision.decode("maybe")


def test_only_a_complete_newer_incarnation_is_ready_to_join():
    from titan_recover.recover.protocol import ready_to_join

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
    from titan_recover.recover.protocol import active_replicas

    assert active_replicas([3, 0, 1, 2], 3) == (0, 1, 2)  # spare 3 on standby
    assert active_replicas([0, 2, 3], 3) == (0, 2, 3)  # replica 1 lost: the spare is promoted
    assert active_replicas([0, 1, 2, 3], 3) == (0, 1, 2)  # 1 admitted again: 3 back on standby
    assert active_replicas([2, 0], 0) == (0, 2)


def test_admission_value_and_incarnations_round_trip():
    from titan_recover.recover.member import incarnation_from_env
    from titan_recover.recover.protocol import decode_admission, encode_admission, Heartbeat

    assert decode_admission(encode_admission(7, (1, 3))) == (7, (1, 3))
    assert decode_admission(b"7|") == (7, ())
    beat = Heartbeat(1.5, 1.25, 4, "phase,with,commas", incarnation=2)
    assert Heartbeat.decode(beat.encode()) == beat
    assert incarnation_from_env({}) == 0
    assert incarnation_from_env({"TITAN_RECOVER_INCARNATION": "2"}) == 2
    assert incarnation_from_env({"TORCHELASTIC_RESTART_COUNT": "1"}) == 1


def test_chaos_faults_hit_only_the_incarnation_they_name():
    from titan_recover.recover.chaos import ChaosMonkey, FaultSpec

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
    from titan_recover.recover.chaos import ChaosMonkey

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
