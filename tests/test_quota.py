"""Quota policies and in-step reassignment (pure)."""

from __future__ import annotations

import itertools

import pytest

from titan_recover.recover.invariant.quota import assign, deal, get_policy, policies, reassign_orphans


def test_even_with_all_replicas_matches_hsdp_order():
    a = assign("even", step=3, per_step=8, members=[0, 1, 2, 3])
    # replica i gets k = a * R + i of the step's ids [16, 24)
    assert a.ids == {0: (16, 20), 1: (17, 21), 2: (18, 22), 3: (19, 23)}


def test_even_spreads_the_remainder():
    a = assign("even", step=1, per_step=8, members=[0, 2, 3])
    assert sorted(len(v) for v in a.ids.values()) == [2, 3, 3]
    assert sorted(itertools.chain(*a.ids.values())) == list(range(8))


def test_throughput_follows_speed():
    a = assign("throughput", step=1, per_step=12, members=[0, 1, 2], speeds={0: 2.0, 1: 1.0, 2: 1.0})
    assert {m: len(v) for m, v in a.ids.items()} == {0: 6, 1: 3, 2: 3}
    unknown = assign("throughput", step=1, per_step=6, members=[0, 1, 2], speeds={0: 2.0, 1: 1.0})
    # replica 2 has no measurement yet: it is assumed as fast as the mean of the others (1.5/s)
    assert {m: unknown.count(m) for m in (0, 1, 2)} == {0: 3, 1: 1, 2: 2}
    assert "no speed measured" in assign("throughput", step=1, per_step=4, members=[0, 1]).reason


def test_reassign_orphans_is_exactly_once_through_successive_losses():
    a = assign("even", step=2, per_step=8, members=[0, 1, 2, 3])
    b = reassign_orphans("even", a, survivors=[0, 2, 3])
    assert b.ids[0][:2] == a.ids[0] and b.ids[2][:2] == a.ids[2]  # survivors keep what they computed
    c = reassign_orphans("even", b, survivors=[0, 3])
    everything = sorted(itertools.chain(*c.ids.values()))
    assert everything == list(range(8, 16))  # every id of the step, once
    assert "lost" in c.reason


def test_policy_registry_and_errors():
    assert {"even", "throughput"} <= set(policies())
    with pytest.raises(ValueError, match="registered: drop, even, throughput"):
        get_policy("fastest")
    with pytest.raises(ValueError, match="do not add up"):
        deal([1, 2, 3], {0: 1, 1: 1})
    with pytest.raises(ValueError, match="no live replica"):
        assign("even", 1, 4, [])


def test_orphans_go_where_the_load_is_lowest():
    from titan_recover.recover.invariant.quota import Assignment

    # replica 2 had already taken over more than its share: the lost ids go to the others first
    current = Assignment({0: (0, 1), 1: (2, 3), 2: (4, 5, 6, 7)}, "")
    after = reassign_orphans("even", current, survivors=[0, 2])
    assert after.ids[2] == (4, 5, 6, 7) and after.ids[0] == (0, 1, 2, 3)
    # towards measured speeds: the faster survivor ends with the larger share
    current = Assignment({0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7, 8)}, "")
    after = reassign_orphans("throughput", current, survivors=[0, 1], speeds={0: 3.0, 1: 1.0})
    assert sorted(after.ids[0] + after.ids[1]) == list(range(9)) and len(after.ids[0]) > len(after.ids[1])
