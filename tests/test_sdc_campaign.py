"""The silent-data-corruption campaign's core (benchmarks/sdc_campaign.py) on a few hand-placed flips: in one
process, three replicas of the tiny model, a few steps."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sdc_campaign as campaign  # noqa: E402

from titan_recover.recover.scout.consensus import replay_plan  # noqa: E402

SETUP = campaign.Setup(steps=2, window=2)


@pytest.fixture(scope="module")
def base(default_data):
    torch.set_num_threads(1)
    tokens = campaign.AddressableTokens(default_data, SETUP.seq_len)
    return campaign.run_base(SETUP, tokens, names=("replay_1", "params_only"), log=lambda *a, **k: None)


def flip(kind: str, *, step: int = 2, replica: int = 1, bit: int = 31, element: int = 7, microbatch=None):
    return campaign.Flip(kind, "sign" if bit == 31 else "exponent", step, replica, bit, element, microbatch)


@pytest.mark.multiprocess  # trains nine models: the slower tier
def test_base_runs_are_clean_and_every_setting_commits_the_same_state(base):
    # run_base raises on a refused clean step and on settings that committed different states
    assert base.clusters["replay_1"].votes == 2 * SETUP.total_steps  # parameters + replay, every step
    assert base.clusters["params_only"].votes == SETUP.total_steps
    assert all(c.false == 0 for c in base.clusters.values())


@pytest.mark.multiprocess  # trains nine models: the slower tier
def test_a_sign_bit_parameter_flip_is_detected_and_attributed_with_replay_off(base):
    result = campaign.inject(base, base.clusters["replay_off"], flip("parameter", replica=2, element=12345))
    assert (result.outcome, result.attributed, result.latency, result.what) == ("detected", True, 0, ("parameters",))


@pytest.mark.multiprocess  # trains nine models: the slower tier
def test_an_optimizer_state_flip_is_seen_at_once_by_the_state_signature_and_later_by_the_parameters_alone(base):
    moment = flip("exp_avg", replica=0, bit=30, element=200_000)
    at_once = campaign.inject(base, base.clusters["replay_off"], moment)
    assert (at_once.outcome, at_once.attributed, at_once.latency) == ("detected", True, 0)
    later = campaign.inject(base, base.clusters["params_only"], moment)
    assert (later.outcome, later.attributed, later.latency) == ("detected", True, 1)  # after the optimizer step


@pytest.mark.multiprocess  # trains nine models: the slower tier
def test_a_gradient_flip_on_a_microbatch_that_is_not_replayed_escapes(base):
    # exponent bit 30 of an element of the first attention weight's gradient (after the embedding's 131072): nonzero
    step = 2
    replayed = replay_plan(step, SETUP.replay_seed, [3, 4, 5], {3: 0, 4: 1, 5: 2}, [0, 1, 2]).microbatch
    other = next(g for g in (3, 4, 5) if g != replayed)
    corrupt = flip("gradient", step=step, replica=campaign.holder(SETUP, other), bit=30, element=131_072 + 5,
                   microbatch=other)
    for cluster in ("replay_off", "replay_1"):
        result = campaign.inject(base, base.clusters[cluster], corrupt)
        assert result.outcome == "escaped" and result.latency is None, cluster
        assert result.clean_votes == (1 if cluster == "replay_off" else 2) and result.false == 0
    # the same flip on the replayed microbatch is caught by the replay vote and named
    caught = campaign.inject(base, base.clusters["replay_1"], flip(
        "gradient", step=step, replica=campaign.holder(SETUP, replayed), bit=30, element=131_072 + 5,
        microbatch=replayed))
    assert (caught.outcome, caught.attributed, caught.what) == ("detected", True, ("replay",))


def test_injected_microbatches_do_not_depend_on_the_replay_plan():
    sizes = {"gradient": 1000, "activation": 1000}
    setups = [campaign.Setup(replay_seed=s) for s in (0, 1)]
    for kind in sizes:
        draws = [[campaign.draw(s, kind, "mantissa", 1, i, sizes) for i in range(300)] for s in setups]
        assert draws[0] == draws[1]  # another replay seed, another plan: the same flips
    plans = [{step: replay_plan(step, s.replay_seed, ids := [(step - 1) * 3 + j for j in range(3)],
                                {g: g % 3 for g in ids}, [0, 1, 2]).microbatch for step in range(2, 51)} for s in setups]
    assert plans[0] != plans[1]
    # uniform over the step's microbatches: about a third of the flips land on the replayed one, not all
    hits = sum(d.microbatch == plans[0][d.step] for d in draws[0])
    assert 60 < hits < 140
    assert {d.microbatch - (d.step - 1) * 3 for d in draws[0]} == {0, 1, 2}
