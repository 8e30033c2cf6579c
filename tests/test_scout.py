"""SCOUT end to end: silent corruption and stragglers named by consensus among replicas (docs/scout.md).

Corruption is injected as single bit flips at an exact (replica, rank, step, place); every run asserts that the
flip fired, who was blamed, and the outcome: the corrupt replica is evicted, its microbatches are computed by the
others in the same step, it rejoins with the majority's state, and the run ends bitwise equal to the failure-free
one (exact mode), which also shows that no corrupt update was committed.
"""

from __future__ import annotations

import statistics

import pytest

from conftest import EXACT_REFERENCE
from replica_runs import assert_all_equal_reference, metrics_by_replica, of, run_replicas
from titan_recover.recover.scout.consensus import replay_plan
from titan_recover.recover.children import processes_of_run
from titan_recover.recover.scout.verified import read_verified

pytestmark = pytest.mark.multiprocess

REPLICAS, STEPS = EXACT_REFERENCE["replicas"], EXACT_REFERENCE["steps"]
RESTARTS = ("--recover.max_restarts", "2", "--recover.rejoin_wait_s", "150")
REPLAY_INTERVAL = 3


def flip(replica, step, target, *, incarnation=0, bit=22):
    return {"kind": "bitflip", "target": target, "replica": replica, "rank": 0, "step": step, "phase": "forward",
            "bit": bit, "incarnation": incarnation}


def test_parameter_flip_is_attributed_and_a_gradient_flip_is_caught_by_replay(tmp_path, exact_reference):
    """Replica 1's parameter gets a flipped bit at step 3: the parameter vote blames replica 1 before step 3
    commits, it is evicted, its microbatch is computed by the others in step 3, and it rejoins. At step 6 (a replay
    step) the holder of the replayed microbatch gets a flipped bit in that microbatch's gradient before the
    reduction: its parameters are still right, only the replay vote can see it; it is evicted in turn."""
    ids6 = {r: ((6 - 1) * REPLICAS + r,) for r in range(REPLICAS)}  # the even quota: replica r holds id 5*3 + r
    plan = replay_plan(6, 0, [g for ids in ids6.values() for g in ids], {g[0]: r for r, g in ids6.items()},
                       members=range(REPLICAS))
    holder = plan.holder
    faults = [flip(1, 3, "parameter"), flip(holder, 6, "gradient", incarnation=1 if holder == 1 else 0)]
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=faults,
                                extra=("--recover.quota.exact", *RESTARTS,
                                       "--recover.localize.replay_interval", str(REPLAY_INTERVAL),
                                       "--checkpoint.enable", "--checkpoint.interval", "2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fired = sorted((e["replica"], e["step"], e["kind"]) for e in of(events, "fault_injected"))
    assert fired == sorted([(1, 3, "bitflip"), (holder, 6, "bitflip")])

    blamed = {(e["step"], e["what"], e["replica"]) for e in of(events, "corruption_attributed")}
    assert (3, "parameters", 1) in blamed and (6, "replay", holder) in blamed
    assert {(s, r) for s, _, r in blamed} == {(3, 1), (6, holder)}  # nobody else, never a false attribution
    # only the holder's replay signature differed at step 6: its parameters agreed with the others'
    assert not [e for e in of(events, "corruption_attributed", step=6) if e["what"] == "parameters"]
    evicted = [(e["replica"], e["epoch"]) for e in of(events, "replica_evicted")]
    assert [r for r, _ in evicted] == [1, holder]
    # the steps that saw the corruption committed without the corrupt replica, everyone's microbatch in them
    for step, out in ((3, 1), (6, holder)):
        committed = of(events, "step_committed", step=step)
        assert committed and all(out not in e["members"] for e in committed)
        assert of(events, "microbatches_reassigned", step=step)
    admitted = [(e["replica"], e["after_step"]) for e in of(events, "replica_admitted")]
    assert [r for r, _ in admitted] == [1, holder]
    assert not of(events, "vote_inconclusive")
    # a checkpoint is verified by the clean vote of the next commit: every one but the final step's, recorded once,
    # by the checkpoint writer (the lowest member of the epoch that committed the next step), in the run's folder
    verified = [(e["step"], e["replica"]) for e in of(events, "checkpoint_verified")]
    assert sorted(step for step, _ in verified) == [2, 4, 6]
    for step, replica in verified:
        assert {min(e["members"]) for e in of(events, "step_committed", step=step + 1)} == {replica}
    assert read_verified(str(tmp_path / "checkpoint")) == [2, 4, 6]
    # both came back, and every replica ended bitwise where the failure-free run ended
    assert_all_equal_reference(exact_reference, tmp_path, events, replicas=[0, 1, 2])
    assert processes_of_run(str(tmp_path)) == []


def test_two_replicas_that_disagree_are_never_blamed_and_stop_without_committing(tmp_path, default_data):
    """With 2 replicas a mismatch has no strict majority: it is reported as inconclusive, nobody is attributed,
    the step is not committed and the job stops saying why (no checkpoint of an untrusted state)."""
    proc, events = run_replicas(tmp_path, replicas=2, ranks=1, steps=4, faults=[flip(1, 2, "parameter", bit=30)],
                                extra=("--checkpoint.enable", "--checkpoint.interval", "100"))
    assert proc.returncode != 0
    assert len(of(events, "fault_injected")) == 1
    inconclusive = of(events, "vote_inconclusive", step=2)
    assert {e["replica"] for e in inconclusive} == {0, 1} and all(e["action"] == "stop" for e in inconclusive)
    assert not of(events, "corruption_attributed") and not of(events, "replica_evicted")
    assert not of(events, "step_committed", step=2)
    stopped = of(events, "stopped")
    assert {e["replica"] for e in stopped} == {0, 1}
    assert all(e["step"] == 1 and not e["checkpoint_saved"] and "replicas disagree at step 2" in e["reason"]
               for e in stopped)
    assert "replicas disagree at step 2" in proc.stdout + proc.stderr
    assert sorted(metrics_by_replica(tmp_path)[0]) == [1]
    assert processes_of_run(str(tmp_path)) == []


def _flagged_steps(metrics: dict[int, dict[int, dict]], replica: int, threshold: float = 3.5) -> list[int]:
    """The steps at which ``replica``'s robust z-score of time per microbatch, computed here from the logged
    compute time and microbatch counts (median / MAD over replicas, MAD floored at 5 % of the median), is above
    ``threshold``: the detector's input and rule, recomputed apart from it."""
    flagged = []
    for step in sorted(metrics[replica]):
        logged = {r: metrics[r][step] for r in metrics}
        times = {r: m["recover/compute_s"] / m["recover/computed_here"] for r, m in logged.items()
                 if m["recover/computed_here"] > 0 and m["recover/compute_s"] > 0}
        if len(times) < 3 or replica not in times:  # a replica given no microbatch is not timed; two are not judged
            continue
        median = statistics.median(times.values())
        spread = 1.4826 * max(statistics.median(abs(t - median) for t in times.values()), 0.05 * median)
        if (times[replica] - median) / spread > threshold:
            flagged.append(step)
    return flagged


def test_a_five_times_slower_replica_is_confirmed_a_straggler_and_given_less_work(tmp_path, default_data):
    """Replica 2 computes every microbatch 5x slower from step 2 on: its robust z-score confirms it after
    ``straggler_confirm_steps`` steps, and the throughput policy gives it fewer of the step's microbatches.

    The score is measured against the spread of the healthy replicas, which on the 2-core machine is large: three
    replicas share two cores, and their times per microbatch differ by tens of percent within a step. A 3x slower
    replica then scores around the threshold of 3.5 and its confirmation moved by a step with the load, as the
    detector intends (a noisy comparison is no evidence); 5x scores well above it. Which steps were above the threshold is recomputed from the logged times, so every
    confirmation must fall exactly where the rule puts it."""
    slow = {"kind": "slow", "replica": 2, "rank": 0, "step": 2, "phase": "forward", "factor": 5.0}
    proc, events = run_replicas(tmp_path, replicas=3, ranks=1, steps=7, faults=[slow],
                                extra=("--recover.quota.policy", "throughput", "--recover.quota.microbatches", "9",
                                       "--recover.localize.straggler_confirm_steps", "2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(of(events, "fault_injected")) == 1
    confirmed = of(events, "straggler_confirmed")
    metrics = metrics_by_replica(tmp_path)
    # the rule, from the logged times: confirmed at the first of two consecutive steps above the threshold (a
    # healthy replica may cross it once on this machine: a noisy step, e.g. the first, is not a confirmation)
    first_pairs = {r: next((s for s in flagged if s - 1 in flagged), None)
                   for r, flagged in ((r, _flagged_steps(metrics, r)) for r in range(3))}
    first_confirmed = {r: min(e["step"] for e in confirmed if e["replica"] == r)
                       for r in {e["replica"] for e in confirmed}}
    assert first_confirmed == {r: s for r, s in first_pairs.items() if s is not None}, first_pairs
    assert first_pairs[2] is not None and first_pairs[2] <= 4, first_pairs
    assert all(e["seconds_per_microbatch"] > 2 * e["median"] for e in confirmed if e["replica"] == 2)
    logged = metrics_by_replica(tmp_path)[0]
    assert logged[1]["recover/quota/2"] == 3  # equal shares before it slowed down
    late = logged[STEPS - 1]
    assert late["recover/quota/2"] < late["recover/quota/0"] and late["recover/quota/2"] < late["recover/quota/1"]
    assert sum(late[f"recover/quota/{r}"] for r in range(3)) == 9
