"""SCOUT's pure parts: signatures, the strict-majority vote, the replay plan, stragglers (docs/scout.md)."""

from __future__ import annotations

import struct

import pytest
import torch

from titan_recover.recover.scout.consensus import (
    _EVEN_WEIGHT,
    _PRIME,
    fingerprint,
    join_signature,
    replay_plan,
    robust_z,
    split_signature,
    StragglerDetector,
    vote,
)


def flip(t: torch.Tensor, index: int, bit: int) -> None:
    words = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).reshape(-1)
    words[index] ^= (1 << bit) if bit < 8 * t.element_size() - 1 else -(1 << bit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_single_bit_flip_changes_the_signature(dtype):
    torch.manual_seed(0)
    # 85 elements: int64 words and, for 2- and 4-byte elements, a tail that fills no word; a view that starts
    # inside an int64 word of its storage
    storage = torch.randn(90, dtype=dtype)
    tensors = [torch.randn(17, 5, dtype=dtype), torch.randn(64, dtype=dtype), storage[1:86]]
    clean = fingerprint(tensors)
    assert fingerprint([t.clone() for t in tensors]) == clean  # a function of the bits only
    for which, index in ((0, 0), (0, 33), (0, 84), (2, 0), (2, 84)):
        for bit in range(8 * dtype.itemsize):
            corrupt = [t.clone() for t in tensors]
            flip(corrupt[which], index, bit)
            assert fingerprint(corrupt) != clean, (which, index, bit)


def _signature_by_definition(tensors: list[torch.Tensor]) -> int:
    """docs/scout.md's definition, in Python integers: int64 words (trailing elements as words of their size), the
    sum of all and of the even-indexed ones, each wrapped to int64, combined modulo the prime."""
    every = even = 0
    for t in tensors:
        flat = t.reshape(-1)
        per = 8 // t.element_size()
        bulk = flat.numel() // per * per
        words = flat[:bulk].clone().view(torch.int64).tolist()
        tail = flat[bulk:].view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).tolist()
        every += sum(words) + sum(tail)
        even += sum(words[::2]) + sum(tail)
    wrap = lambda v: (v + 2**63) % 2**64 - 2**63  # noqa: E731
    return (wrap(every) + _EVEN_WEIGHT * wrap(even)) % _PRIME


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_signature_is_its_documented_definition(dtype):
    torch.manual_seed(1)
    for sizes in ((1,), (7,), (16,), (33, 100), (1001, 3), (4099,)):
        tensors = [torch.randn(n, dtype=dtype) * 1e30 for n in sizes]  # large values: the int64 sums wrap
        assert fingerprint(tensors) == _signature_by_definition(tensors), sizes


def test_no_single_bit_change_of_the_wrapping_sums_is_a_multiple_of_the_prime():
    # a flip of bit k of an int64 word changes each wrapped sum it is in by +-2**k or +-(2**k - 2**64), and the
    # even sum only if the word is even-indexed: the signature's change (all + weight * even) is never 0 mod prime
    for k in range(64):
        for every in (2**k, 2**k - 2**64):
            for even in (0, 2**k, 2**k - 2**64):
                for sign in (1, -1):
                    assert sign * (every + _EVEN_WEIGHT * even) % _PRIME != 0, (k, every, even)


def test_signature_covers_extra_scalars_and_order_of_tensors_only_through_values():
    a = [torch.ones(4), torch.zeros(3)]
    assert fingerprint(a, extra=[1.5]) != fingerprint(a, extra=[1.5000000000000002])
    assert fingerprint(a) != fingerprint(a, extra=[0.5])
    assert 0 <= fingerprint(a) < 2**32


def test_signature_halves_survive_a_float32_sum_of_one_slot():
    value = 0xDEADBEEF
    low, high = split_signature(value)
    summed = torch.tensor([low, 0.0, 0.0], dtype=torch.float32).sum(), torch.tensor([high, 0.0], dtype=torch.float32).sum()
    assert join_signature(float(summed[0]), float(summed[1])) == value


def test_vote_agrees_attributes_the_minority_and_says_inconclusive_without_a_strict_majority():
    agree = vote({0: 7, 1: 7, 2: 7}, "parameters")
    assert agree.decision == "agree" and agree.clean and agree.outliers == () and agree.majority == 7

    one_off = vote({0: 7, 1: 9, 2: 7}, "parameters")
    assert one_off.decision == "attributed" and one_off.outliers == (1,)
    assert one_off.majority == 7 and one_off.evidence == {0: 7, 1: 9, 2: 7}
    assert "2 of 3" in one_off.reason and "[1]" in one_off.reason

    four = vote({(0, 1): 1, (1, 1): 1, (2, 1): 1, (3, 1): 5})
    assert four.decision == "attributed" and four.outliers == ((3, 1),)

    pair = vote({0: 7, 1: 9})  # 1 of 2 is not more than half
    assert pair.decision == "inconclusive" and pair.outliers == () and pair.majority is None
    assert "no strict majority" in pair.reason

    tie = vote({0: 1, 1: 1, 2: 2, 3: 2})  # 2 of 4 is not a strict majority either
    assert tie.decision == "inconclusive" and tie.outliers == ()

    split3 = vote({0: 1, 1: 2, 2: 3})
    assert split3.decision == "inconclusive"
    assert vote({}).decision == "inconclusive"


def test_replay_plan_is_a_function_of_seed_and_step_and_never_replays_on_the_holder():
    ids = [30, 31, 32, 33]
    holder_of = {30: 0, 31: 1, 32: 2, 33: 3}
    plans = [replay_plan(s, 0, ids, holder_of, members=(0, 1, 2, 3)) for s in range(1, 41)]
    assert plans == [replay_plan(s, 0, ids, holder_of, members=(0, 1, 2, 3)) for s in range(1, 41)]
    assert {p.microbatch for p in plans} == set(ids)  # every id gets sampled over 40 steps
    for p in plans:
        assert p.holder == holder_of[p.microbatch] and p.holder not in p.replayers and len(p.replayers) == 2
        assert p.witnesses == (p.holder, *p.replayers)
    # ring order after the holder, among the members only
    plan = replay_plan(5, 0, [7], {7: 2}, members=(0, 2, 3))
    assert plan.replayers == (3, 0)
    assert replay_plan(5, 0, [7], {7: 2}, members=(2,)) is None
    assert replay_plan(5, 1, ids, holder_of, (0, 1, 2, 3)) is not None


def test_robust_z_ignores_spread_within_a_few_percent():
    z = robust_z({0: 1.0, 1: 1.01, 2: 0.99, 3: 3.0})
    assert z[3] > 10 and all(abs(z[r]) < 1 for r in (0, 1, 2))
    assert max(abs(v) for v in robust_z({0: 1.0, 1: 1.0, 2: 1.0}).values()) == 0.0


def test_straggler_is_confirmed_after_consecutive_steps_and_recovers():
    detector = StragglerDetector(threshold=3.5, confirm_steps=3)
    slow = {0: 0.1, 1: 0.3, 2: 0.1}
    changes = [detector.observe(s, slow) for s in (1, 2, 3)]
    assert changes[0] == [] and changes[1] == []
    assert [(c.replica, c.state, c.step) for c in changes[2]] == [(1, "confirmed", 3)]
    assert detector.stragglers == {1}
    # a single fast step does not clear it; three do
    assert detector.observe(4, {0: 0.1, 1: 0.1, 2: 0.1}) == []
    assert detector.observe(5, slow) == []
    assert detector.stragglers == {1}
    for s in (6, 7):
        assert detector.observe(s, {0: 0.1, 1: 0.1, 2: 0.1}) == []
    recovered = detector.observe(8, {0: 0.1, 1: 0.1, 2: 0.1})
    assert [(c.replica, c.state) for c in recovered] == [(1, "recovered")] and detector.stragglers == set()
    # an interrupted run of slow steps does not confirm; two replicas are never judged
    fresh = StragglerDetector(confirm_steps=2)
    assert fresh.observe(1, slow) == [] and fresh.observe(2, {0: 0.1, 1: 0.1, 2: 0.1}) == []
    assert fresh.observe(3, slow) == [] and fresh.stragglers == set()
    assert StragglerDetector(confirm_steps=1).observe(1, {0: 0.1, 1: 0.9}) == []
    # a step nobody could judge, or one the slow replica reported nothing in, breaks its run of slow steps
    for gap in ({0: 0.1, 1: 0.3}, {0: 0.1, 2: 0.1, 3: 0.1}):
        broken = StragglerDetector(confirm_steps=2)
        assert broken.observe(1, slow) == [] and broken.observe(2, gap) == [] and broken.observe(3, slow) == []
        assert broken.stragglers == set()
    # a confirmed straggler that left is no straggler any more
    left = StragglerDetector(confirm_steps=1)
    assert [c.state for c in left.observe(1, slow)] == ["confirmed"]
    left.observe(2, {0: 0.1, 2: 0.1, 3: 0.1})
    assert left.stragglers == set()


def test_float_bits_of_a_loss_enter_the_signature_exactly():
    loss = 2.718281828459045
    nudged = struct.unpack("<d", (struct.unpack("<q", struct.pack("<d", loss))[0] ^ 1).to_bytes(8, "little", signed=True))[0]
    assert fingerprint([], extra=[loss]) != fingerprint([], extra=[nudged])


class Events:
    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})


def localizer(groups=3, **overrides):
    from titan_recover.recover.config import LocalizeConfig
    from titan_recover.recover.scout.localize import Localizer

    events = Events()
    return Localizer(LocalizeConfig(**overrides), replica=0, rank=1, groups=groups, events=events), events


def reduced(groups, parameters: dict[int, int], replay: dict[int, int] | None = None) -> list[float]:
    """The evidence section as the reduction leaves it: each replica's own slots, summed."""
    from titan_recover.recover.scout.localize import Localizer
    from titan_recover.recover.config import LocalizeConfig

    total = [0.0] * (6 * groups)
    for replica in range(groups):
        own = Localizer(LocalizeConfig(), replica=replica, rank=1, groups=groups, events=Events())
        part = own.evidence(parameters.get(replica), (replay or {}).get(replica))
        total = [a + b for a, b in zip(total, part)]
    return total


def test_localizer_votes_from_the_summed_slots_and_refuses_with_the_outlier_named():
    judge, events = localizer()
    assert judge.judge(4, (0, 1, 2), reduced(3, {0: 11, 1: 11, 2: 11})) is None and judge.clean
    refusal = judge.judge(5, (0, 1, 2), reduced(3, {0: 11, 1: 99, 2: 11}))
    assert refusal.evict == (1,) and refusal.stop is None and not judge.clean
    [attributed] = [e for e in events.records if e["event"] == "corruption_attributed"]
    assert attributed["replica"] == 1 and attributed["rank"] == 1 and attributed["step"] == 5
    assert attributed["what"] == "parameters" and attributed["evidence"] == {"0": 11, "1": 99, "2": 11}
    # a replica that is not a member (dropped, or not yet admitted) is no witness
    assert judge.judge(6, (0, 2), reduced(3, {0: 11, 1: 99, 2: 11})) is None


def test_two_replicas_that_disagree_are_inconclusive_and_stop_or_continue_as_configured():
    judge, events = localizer(groups=2)
    refusal = judge.judge(3, (0, 1), reduced(2, {0: 1, 1: 2}))
    assert refusal.evict == () and refusal.stop.startswith("replicas disagree at step 3")
    assert [e["event"] for e in events.records] == ["vote_inconclusive"]
    lenient, events = localizer(groups=2, on_inconclusive="continue")
    assert lenient.judge(3, (0, 1), reduced(2, {0: 1, 1: 2})) is None and not lenient.clean
    assert [e["action"] for e in events.records] == ["continue"]


def test_replay_vote_attributes_the_holder_or_a_replayer():
    judge, events = localizer(groups=4, replay_interval=2)
    holders = {0: (8,), 1: (9,), 2: (10,), 3: (11,)}
    assert judge.replay_for(3, holders, (0, 1, 2, 3)) is None  # not a replay step
    plan = judge.replay_for(4, holders, (0, 1, 2, 3))
    assert plan is not None and len(plan.replayers) == 2
    params = {r: 5 for r in range(4)}
    clean = {w: 77 for w in plan.witnesses}
    assert judge.judge(4, (0, 1, 2, 3), reduced(4, params, clean)) is None
    corrupt_holder = {**clean, plan.holder: 78}
    refusal = judge.judge(4, (0, 1, 2, 3), reduced(4, params, corrupt_holder))
    assert refusal.evict == (plan.holder,)
    assert events.records[-1]["what"] == "replay" and events.records[-1]["replica"] == plan.holder
    # after the holder's eviction the retried reduction has the two replayers, who agree
    survivors = tuple(r for r in range(4) if r != plan.holder)
    assert judge.judge(4, survivors, reduced(4, params, corrupt_holder)) is None


def test_straggler_reports_come_from_rank_zero_only():
    from titan_recover.recover.config import LocalizeConfig
    from titan_recover.recover.scout.localize import Localizer

    events = Events()
    rank0 = Localizer(LocalizeConfig(straggler_confirm_steps=2), replica=0, rank=0, groups=3, events=events)
    rank1 = Localizer(LocalizeConfig(straggler_confirm_steps=2), replica=0, rank=1, groups=3, events=events)
    for step in (1, 2):
        for judge in (rank0, rank1):
            judge.observe_speeds(step, [10.0, 10.0, 3.0])
    assert [(e["event"], e["replica"], e["step"]) for e in events.records] == [("straggler_confirmed", 2, 2)]
    assert rank1.detector.stragglers == {2}


def test_chaos_bit_flips_land_where_and_when_they_are_told():
    from titan_recover.recover.chaos.config import FaultSpec
    from titan_recover.recover.chaos.kinds import flip_bit
    from titan_recover.recover.chaos.monkey import ChaosMonkey

    t = torch.tensor([1.0, 2.0])
    flip_bit(t, 1, 22)
    assert t.tolist() == [1.0, 3.0]  # the top mantissa bit of 2.0
    flip_bit(t, 0, 31)
    assert t.tolist() == [-1.0, 3.0]
    events = Events()
    param, grad = torch.ones(3), torch.zeros(3)
    schedule = [FaultSpec(kind="bitflip", target="parameter", step=2, phase="forward", bit=23),
                FaultSpec(kind="bitflip", target="gradient", step=3, phase="backward", element=2, bit=30)]
    monkey = ChaosMonkey(schedule, 0, 0, events)
    monkey.tensors = {"parameter": lambda: [param], "gradient": lambda: [grad]}
    monkey.maybe_inject(2, "forward")
    assert param.tolist() == [0.5, 1.0, 1.0] and grad.tolist() == [0, 0, 0]
    monkey.maybe_inject(3, "backward")
    assert grad.tolist() == [0, 0, 0]  # lands after the backward
    monkey.after_backward()
    assert grad[2].item() == 2.0 and grad[:2].tolist() == [0, 0]
    monkey.after_backward()
    assert grad[2].item() == 2.0  # once
    assert [e["event"] for e in events.records] == ["fault_injected", "fault_injected"]
    activation = FaultSpec(kind="bitflip", target="activation", step=4, phase="forward", element=1, bit=31)
    monkey = ChaosMonkey([activation], 0, 0, events)
    output = torch.ones(2, 2, requires_grad=True) * 1.0  # a non-leaf output, as a layer's
    monkey.maybe_inject(4, "forward")
    monkey.on_activation(output)
    assert output.tolist() == [[1.0, -1.0], [1.0, 1.0]]
    monkey.on_activation(output)  # once
    assert output.tolist() == [[1.0, -1.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="target 'weights' must be one of parameter, gradient, activation"):
        FaultSpec(kind="bitflip", target="weights")


def test_localize_config_errors_say_what_to_change():
    from titan_recover.recover.config import LocalizeConfig

    with pytest.raises(ValueError, match="on_inconclusive must be one of stop, continue, got 'ignore'"):
        LocalizeConfig(on_inconclusive="ignore")
    with pytest.raises(ValueError, match="replay_interval must be >= 0"):
        LocalizeConfig(replay_interval=-1)
    with pytest.raises(ValueError, match="straggler_confirm_steps >= 1"):
        LocalizeConfig(straggler_confirm_steps=0)
    assert not LocalizeConfig(vote=False).witnesses and LocalizeConfig(vote=False, replay_interval=5).witnesses


def test_a_checkpoint_is_verified_only_by_a_clean_vote_its_writer_took_part_in():
    """Checkpoint 4 (interval 2) written by replica 0: step 5's clean vote verifies it while 0 votes; if step 5's
    vote evicted 0 and the epoch without it then voted clean, the majority's state says nothing of what 0 wrote."""
    from titan_recover.recover.scout.verified import verifies_previous

    assert verifies_previous(5, 2, clean=True, previous_writer=0, members=(0, 1, 2))
    assert not verifies_previous(5, 2, clean=True, previous_writer=0, members=(1, 2))  # the writer was evicted
    assert not verifies_previous(5, 2, clean=False, previous_writer=0, members=(0, 1, 2))
    assert not verifies_previous(5, 2, clean=True, previous_writer=None, members=(0, 1, 2))  # first step here
    assert not verifies_previous(4, 2, clean=True, previous_writer=0, members=(0, 1, 2))  # no checkpoint at 3
    assert not verifies_previous(1, 2, clean=True, previous_writer=0, members=(0, 1, 2))  # step 0 is no checkpoint


def test_recovery_picks_the_newest_verified_complete_checkpoint(tmp_path):
    from titan_recover.recover.scout.verified import mark_verified, read_verified, step_to_load

    folder = tmp_path / "checkpoint"
    for step, complete in ((2, True), (4, True), (6, True), (8, False)):
        (folder / f"step-{step}").mkdir(parents=True)
        if complete:
            (folder / f"step-{step}" / ".metadata").write_text("x")
    assert step_to_load(str(folder)) == (None, "no verification record: TorchTitan's newest checkpoint")
    mark_verified(str(folder), 2)
    mark_verified(str(folder), 4)
    mark_verified(str(folder), 8)  # verified, but its save never completed
    mark_verified(str(folder), 4)
    assert read_verified(str(folder)) == [2, 4, 8]
    chosen, reason = step_to_load(str(folder))
    assert chosen == 4 and "unverified newer: [6]" in reason

    # what the checkpoint manager loads with this choice, and its event: tests/test_checkpoint.py

    bare = tmp_path / "bare"
    (bare / "step-3").mkdir(parents=True)
    (bare / "step-3" / ".metadata").write_text("x")
    mark_verified(str(bare), 7)
    assert step_to_load(str(bare)) == (None, "no verified checkpoint among [3]: loading the newest, unverified")

