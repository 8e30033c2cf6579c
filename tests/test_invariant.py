"""The ReCoVer invariant end to end: a run that loses replicas equals the failure-free run (docs/invariant.md).

Each failure run is compared with a failure-free reference of the same layout: the loss at every step and every
final parameter within 1e-5 relative, the same tokens committed at every step; in exact mode bitwise
(``torch.equal``). The same schedule with the ``drop`` policy (torchft's semantics) must leave that bound, which
shows the bound is not met trivially. Faults are SIGKILLs (and one exception) at every phase of a step.
"""

from __future__ import annotations

import pytest

from conftest import EXACT_REFERENCE
from replica_runs import assert_same_trajectory, assert_survived, metrics_by_replica, run_replicas, \
    trajectory_deviation

pytestmark = pytest.mark.multiprocess

REPLICAS, STEPS = EXACT_REFERENCE["replicas"], 4
EXACT = ("--recover.quota.exact",)
OVERLAP = ("--recover.step.overlap_reduction",)
"""The reduction overlapped with the last backward: the default on GPUs, off by the CPU platform's default."""


def kill(replica, step, phase, kind="kill", rank=0):
    return {"kind": kind, "replica": replica, "rank": rank, "step": step, "phase": phase}


# schedule name -> (faults, replica -> first step it no longer contributes to); each loses two of the three
# replicas at different phases, and the last survivor computes every microbatch alone
SCHEDULES = {
    # one lost while computing; one by an exception in the optimizer step, after its step committed
    "forward+optimizer": ([kill(1, 2, "forward"), kill(2, 3, "optimizer", kind="raise")], {1: 2, 2: 4}),
    # one in backward; then the lowest replica between its reduction and the commit
    "backward+commit": ([kill(2, 2, "backward"), kill(0, 3, "commit")], {2: 2, 0: 3}),
}
# one while reducing, and another during the recovery from it (phase rebuild), in the same step: run in exact mode,
# where the same trajectory is bitwise (a stronger check than the 1e-5 bound)
HARDEST = ([kill(1, 2, "reduction"), kill(2, 2, "rebuild")], {1: 2, 2: 2})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_data):
    """Failure-free runs, one per (name, layout), made on first use and shared by the module's tests."""
    cache = {}

    def get(name: str, *, replicas: int, ranks: int, extra=(), parallelism=None):
        if name not in cache:
            folder = tmp_path_factory.mktemp(f"reference-{name}")
            proc, events = run_replicas(folder, replicas=replicas, ranks=ranks, steps=STEPS, faults=[],
                                        extra=extra, parallelism=parallelism)
            assert_survived(folder, proc, events, replicas=replicas, ranks=ranks, steps=STEPS, lost={})
            cache[name] = folder
        return cache[name]

    return get


def survivors_of(lost: dict[int, int], replicas: int = REPLICAS) -> list[int]:
    return sorted(set(range(replicas)) - set(lost))


def check_recovery(folder, events, lost):
    """Every lost replica's microbatches were taken over in the step it was lost (or the next, for a loss after
    the commit), and the quotas of later steps exclude it."""
    reassigned = [e for e in events if e["event"] == "microbatches_reassigned"]
    for replica, step in lost.items():
        assert any(replica in e["lost"] and e["step"] == step and e["extra"] for e in reassigned), (replica, step)
    metrics = metrics_by_replica(folder)[survivors_of(lost)[0]]
    for replica, step in lost.items():
        for later in range(step + 1, STEPS + 1):
            assert metrics[later][f"recover/quota/{replica}"] == 0


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_failure_run_equals_the_failure_free_run(tmp_path, reference, schedule):
    faults, lost = SCHEDULES[schedule]
    ref = reference("replicas", replicas=REPLICAS, ranks=1)
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=faults)
    injected = assert_survived(tmp_path, proc, events, replicas=REPLICAS, ranks=1, steps=STEPS, lost=lost)
    assert sorted((e["replica"], e["phase"]) for e in injected) == sorted((f["replica"], f["phase"]) for f in faults)
    check_recovery(tmp_path, events, lost)
    assert_same_trajectory(ref, tmp_path, survivors=survivors_of(lost), ranks=1, bitwise=False)


def test_exact_mode_failure_run_is_bitwise_the_failure_free_run(tmp_path, exact_reference):
    # the hardest schedule (two losses in one step, one during the recovery from the other); exact mode with
    # rejoining, promoted and evicted replicas: tests/test_rejoin.py, tests/test_scout.py
    faults, lost = HARDEST
    steps = EXACT_REFERENCE["steps"]
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=steps, faults=faults, extra=EXACT)
    assert_survived(tmp_path, proc, events, replicas=REPLICAS, ranks=1, steps=steps, lost=lost)
    check_recovery(tmp_path, events, lost)
    assert_same_trajectory(exact_reference, tmp_path, survivors=survivors_of(lost), ranks=1, bitwise=True)


def test_drop_mode_leaves_the_reference_trajectory(tmp_path, reference):
    faults, lost = SCHEDULES["backward+commit"]
    ref = reference("replicas", replicas=REPLICAS, ranks=1)
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=faults,
                                extra=("--recover.quota.policy", "drop"))
    assert_survived(tmp_path, proc, events, replicas=REPLICAS, ranks=1, steps=STEPS, lost=lost)
    metrics = metrics_by_replica(tmp_path)[1]
    # torchft's semantics: the batch shrinks with the replicas and the steps that saw a failure are discarded
    assert [metrics[s]["recover/microbatches"] for s in range(1, STEPS + 1)] == [3, 2, 1, 1]
    assert [metrics[s]["recover/discarded"] for s in range(1, STEPS + 1)] == [0, 1, 1, 0]
    assert {e["step"] for e in events if e["event"] == "step_discarded"} == {2, 3}
    assert trajectory_deviation(ref, tmp_path, replica=1) > 1e-5


def test_fsdp_inside_replicas_kill_during_reduction_without_a_backup(tmp_path, reference):
    # no backup of the gradient (recover.step.abort_recovery = "recompute"): the survivor computes its own
    # microbatches again after the aborted reduction, then the lost replica's; exact mode, so bitwise
    lost = {1: 3}
    ref = reference("fsdp-exact", replicas=2, ranks=2, extra=EXACT)
    proc, events = run_replicas(tmp_path, replicas=2, ranks=2, steps=STEPS, faults=[kill(1, 3, "reduction", rank=1)],
                                extra=(*EXACT, "--recover.step.abort_recovery", "recompute"))
    assert_survived(tmp_path, proc, events, replicas=2, ranks=2, steps=STEPS, lost=lost)
    redone = [e for e in events if e["event"] == "step_committed" and e["step"] == 3 and e["attempts"] > 1]
    assert redone, "the step's reduction was not redone in the new epoch"
    again = [e for e in events if e["event"] == "accumulation_recomputed"]
    assert again and {(e["replica"], e["step"]) for e in again} == {(0, 3)}, again
    assert_same_trajectory(ref, tmp_path, survivors=[0], ranks=2, bitwise=True)


def test_tensor_parallel_inside_replicas_kill_in_backward(tmp_path, reference):
    # with the reduction overlapped (the TP parameters' hooks report the gradients to it during the backward the
    # kill interrupts); the reference issues it after the backward
    tp = ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2")
    lost = {1: 2}
    ref = reference("tp", replicas=2, ranks=2, parallelism=tp)
    proc, events = run_replicas(tmp_path, replicas=2, ranks=2, steps=STEPS, faults=[kill(1, 2, "backward", rank=1)],
                                parallelism=tp, extra=OVERLAP)
    assert_survived(tmp_path, proc, events, replicas=2, ranks=2, steps=STEPS, lost=lost)
    check_recovery_steps = [e for e in events if e["event"] == "microbatches_reassigned" and e["step"] == 2]
    assert check_recovery_steps, "replica 1's microbatches were not taken over in step 2"
    assert_same_trajectory(ref, tmp_path, survivors=[0], ranks=2, bitwise=False)


def test_the_overlapped_reduction_changes_no_bit(tmp_path, reference):
    """Failure-free, the reduction issued during the last microbatch's backward (the default on GPUs) and after it
    (the default on CPU: the reference): the same losses, parameters and optimizer state, bit for bit; and only the
    run asked to overlap did."""
    ref = reference("replicas", replicas=REPLICAS, ranks=1)
    proc, events = run_replicas(tmp_path, replicas=REPLICAS, ranks=1, steps=STEPS, faults=[], extra=OVERLAP)
    assert_survived(tmp_path, proc, events, replicas=REPLICAS, ranks=1, steps=STEPS, lost={})
    for replica in range(REPLICAS):
        after, overlapped = metrics_by_replica(ref)[replica], metrics_by_replica(tmp_path)[replica]
        assert [after[s]["recover/overlapped"] for s in range(1, STEPS + 1)] == [0] * STEPS
        assert [overlapped[s]["recover/overlapped"] for s in range(1, STEPS + 1)] == [1] * STEPS
    assert_same_trajectory(ref, tmp_path, survivors=list(range(REPLICAS)), ranks=1, bitwise=True)
