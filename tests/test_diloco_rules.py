"""Decoupled DiLoCo's pure rules (docs/diloco.md): fragments, schedule, quorum, grace window, merge, outer step."""

from __future__ import annotations

import pytest
import torch

from titan_recover.recover.diloco.rules import (
    due_fragments,
    grace_window,
    merge_deltas,
    OuterOptimizer,
    quorum_reached,
    quorum_size,
    split_fragments,
    token_weights,
)


def test_fragments_cover_every_parameter_once_with_near_equal_sizes():
    assert split_fragments([10] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_fragments([100, 1, 1, 1, 100, 1, 1, 1], 2) == [(0, 4), (4, 8)]
    ranges = split_fragments([5, 1000, 3, 3, 3, 900, 7], 3)
    assert [i for a, b in ranges for i in range(a, b)] == list(range(7)) and all(b > a for a, b in ranges)
    assert split_fragments([1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_fragments([1, 2, 3], 1) == [(0, 3)]
    with pytest.raises(ValueError, match="between 1 and the number of parameters"):
        split_fragments([1, 2], 3)


def test_each_fragment_is_due_once_per_period_and_the_syncs_are_staggered():
    period, fragments = 8, 4
    due = {step: due_fragments(step, fragments, period) for step in range(1, 4 * period + 1)}
    for f in range(fragments):
        steps = [s for s, fs in due.items() if f in fs]
        assert len(steps) == 4 and all(b - a == period for a, b in zip(steps, steps[1:]))
    assert all(len(fs) <= 1 for fs in due.values())  # never two fragments after the same inner step
    assert [s for s, fs in due.items() if fs][:4] == [2, 4, 6, 8]
    assert due_fragments(5, 1, 5) == [0] and due_fragments(4, 1, 5) == []


def test_quorum_and_token_weighted_merge():
    assert not quorum_reached({0: 10}, 2) and quorum_reached({0: 10, 2: 5}, 2)
    assert token_weights({0: 300, 1: 100}) == {0: 0.75, 1: 0.25}
    deltas = {1: torch.tensor([4.0, 0.0]), 0: torch.tensor([0.0, 8.0])}
    merged = merge_deltas(deltas, {0: 300, 1: 100})
    assert merged.dtype == torch.float64 and merged.tolist() == [1.0, 6.0]
    with pytest.raises(ValueError, match="a merge needs tokens"):
        token_weights({0: 0})


def test_the_quorum_shrinks_to_the_learners_alive_or_delivered():
    assert quorum_size(2, alive={0, 1, 2}, delivered=[]) == 2
    assert quorum_size(3, alive={0}, delivered=[0]) == 1  # the others are dead: one learner merges alone
    assert quorum_size(3, alive={0}, delivered=[2]) == 2  # a dead learner's delta still counts
    assert quorum_reached({0: 10}, quorum_size(3, alive={0}, delivered=[0]))


def test_grace_window_waits_only_while_the_late_tokens_outweigh_the_delay():
    delivered = {0: 1000, 1: 1000}
    # a learner 1 s late with a full share, period 10 s: gain 1/3 > cost 0.1 -> wait 1 s
    wait = grace_window(delivered, {2: (1.0, 1000)}, period_s=10, max_window_s=5)
    assert wait.deadline_s == 1.0 and wait.waiting_for == (2,)
    # 3x slower learner expected 4 s late: gain 1/3 < cost 0.4 -> merge now
    now = grace_window(delivered, {2: (4.0, 1000)}, period_s=10, max_window_s=5)
    assert now.deadline_s == 0 and now.waiting_for == () and "gain 0.33 <= cost 0.40" in now.reason
    # beyond the cap: never waited for, whatever it brings
    capped = grace_window(delivered, {2: (6.0, 10**9)}, period_s=100, max_window_s=5)
    assert capped.waiting_for == () and "cap" in capped.reason
    # two late learners: the first is worth it, and counting its tokens the second is not
    both = grace_window({0: 1000}, {1: (0.5, 1000), 2: (4.0, 1000)}, period_s=10, max_window_s=5)
    assert both.waiting_for == (1,) and both.deadline_s == 0.5
    # nobody pending (a dead learner is not pending): merge at once
    assert grace_window(delivered, {}, period_s=10, max_window_s=5).deadline_s == 0
    overdue = grace_window(delivered, {2: (-0.5, 1000)}, period_s=10, max_window_s=5)
    assert (overdue.deadline_s, overdue.waiting_for) == (0.0, ()) and "overdue" in overdue.reason


def test_outer_optimizer_is_nesterov_sgd_on_the_merged_delta_and_round_trips():
    start = torch.tensor([1.0, 2.0])
    outer = OuterOptimizer(start, lr=0.7, momentum=0.9)
    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for delta in (torch.tensor([0.1, -0.2]), torch.tensor([0.3, 0.1])):
        got = outer.step(delta.to(torch.float64)).clone()
        reference.grad = delta
        sgd.step()
        assert torch.equal(got, reference.detach())
    saved = outer.state_dict()
    again = OuterOptimizer(torch.zeros(2), lr=0.7, momentum=0.9)
    again.load_state_dict(saved)
    delta = torch.tensor([0.05, 0.05])
    assert torch.equal(again.step(delta).clone(), outer.step(delta).clone())
