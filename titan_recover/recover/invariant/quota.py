"""Microbatch quotas: which replica computes which global microbatch ids of a step (pure, deterministic).

A step consumes the ids ``[(step - 1) * M, step * M)``. A **policy** (registered by name, picked by
``[recover.quota] policy``) turns the live members and their measured speeds into a *count* per replica; the ids
are then dealt out in order, round-robin weighted by the counts, so that with equal counts and all replicas alive
replica ``i`` gets ids ``k = a * R + i``, exactly the microbatches TorchTitan's HSDP would give it.

A policy that ``redistributes`` (``even``, ``throughput``) gives the ids of lost replicas to survivors, so every
step still consumes all ``M`` ids. ``drop`` is the baseline that does not: every configured replica keeps its fixed
share whether it lives or not, so the batch shrinks when one dies (torchft's semantics).

Every rank evaluates the same function on the same inputs (members come from the coordinator's epoch, speeds
travel inside the reduction buffer), so every rank computes the same assignment without talking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from titan_recover.registry import Registry


@dataclass(frozen=True)
class QuotaInput:
    members: tuple[int, ...]
    """Live replicas, sorted."""
    total: int
    """Microbatch ids to hand out."""
    speeds: Mapping[int, float] = field(default_factory=dict)
    """Smoothed microbatches per second per replica; missing: unknown (treated as the mean of the known)."""
    replicas: int = 0
    """Configured replica groups (live or not); 0: the number of members."""

    @property
    def configured(self) -> tuple[int, ...]:
        return tuple(range(self.replicas)) if self.replicas else self.members


@dataclass(frozen=True)
class Assignment:
    ids: dict[int, tuple[int, ...]]
    """replica -> global microbatch ids it computes."""
    reason: str

    def count(self, replica: int) -> int:
        return len(self.ids.get(replica, ()))


CountFn = Callable[[QuotaInput], tuple[dict[int, int], str]]
"""Counts per replica (summing to ``total``) and a reason for the logs."""


@dataclass(frozen=True)
class QuotaPolicy:
    counts: CountFn
    redistributes: bool = True
    """Lost replicas' ids go to survivors in the same step (the ReCoVer invariant). False: they are skipped."""
    uses_speeds: bool = False
    """The counts depend on measured speeds (ranks of a replica must then agree on its speed)."""

    def __call__(self, inp: QuotaInput) -> tuple[dict[int, int], str]:
        return self.counts(inp)


POLICIES: Registry[QuotaPolicy] = Registry("quota policy")


def register_policy(name: str, *, redistributes: bool = True, uses_speeds: bool = False) -> Callable[[CountFn], CountFn]:
    def add(counts: CountFn) -> CountFn:
        POLICIES.register(name)(QuotaPolicy(counts, redistributes=redistributes, uses_speeds=uses_speeds))
        return counts

    return add


def policies() -> list[str]:
    return POLICIES.names()


def get_policy(name: str) -> QuotaPolicy:
    return POLICIES.get(name)


def _largest_remainder(weights: Mapping[int, float], total: int) -> dict[int, int]:
    """Integer counts proportional to ``weights`` summing to ``total``; ties go to the lower replica id."""
    weight_sum = sum(weights.values())
    exact = {m: total * w / weight_sum for m, w in weights.items()}
    counts = {m: math.floor(x) for m, x in exact.items()}
    left = total - sum(counts.values())
    for m in sorted(weights, key=lambda m: (-(exact[m] - counts[m]), m))[:left]:
        counts[m] += 1
    return counts


@register_policy("even")
def even(inp: QuotaInput) -> tuple[dict[int, int], str]:
    """Equal shares; the remainder goes one each to the lowest replica ids."""
    counts = _largest_remainder({m: 1.0 for m in inp.members}, inp.total)
    return counts, f"even over {len(inp.members)} replicas"


@register_policy("throughput", uses_speeds=True)
def throughput(inp: QuotaInput) -> tuple[dict[int, int], str]:
    """Shares proportional to measured speed, so all replicas finish their share at about the same time."""
    known = [inp.speeds[m] for m in inp.members if inp.speeds.get(m, 0) > 0]
    if not known:
        counts, _ = even(inp)
        return counts, "throughput: no speed measured yet, even"
    mean = sum(known) / len(known)
    weights = {m: inp.speeds.get(m, 0) if inp.speeds.get(m, 0) > 0 else mean for m in inp.members}
    counts = _largest_remainder(weights, inp.total)
    shown = ", ".join(f"{m}: {weights[m]:.2f}/s" for m in inp.members)
    return counts, f"throughput ({shown})"


@register_policy("drop", redistributes=False)
def drop(inp: QuotaInput) -> tuple[dict[int, int], str]:
    """Fixed equal shares over all configured replicas, live or not: a lost replica's ids are not computed."""
    counts = _largest_remainder({m: 1.0 for m in inp.configured}, inp.total)
    lost = [m for m in inp.configured if m not in inp.members]
    return counts, f"drop: fixed shares over {len(inp.configured)} replicas" + (f", {lost} lost" if lost else "")


def deal(ids: Sequence[int], counts: Mapping[int, int]) -> dict[int, tuple[int, ...]]:
    """Deal ``ids`` in order, one per turn to each replica that still has quota left (sorted replica order)."""
    if sum(counts.values()) != len(ids):
        raise ValueError(f"counts {dict(counts)} do not add up to {len(ids)} ids")
    left = dict(counts)
    out: dict[int, list[int]] = {m: [] for m in sorted(counts)}
    queue = list(ids)
    while queue:
        for m in sorted(left):
            if left[m] > 0 and queue:
                out[m].append(queue.pop(0))
                left[m] -= 1
    return {m: tuple(v) for m, v in out.items()}


def assign(policy: str, step: int, per_step: int, members: Sequence[int],
           speeds: Mapping[int, float] | None = None, *, replicas: int = 0) -> Assignment:
    """The assignment of step ``step``'s ids (``[(step - 1) * per_step, step * per_step)``) to ``members``
    (``replicas``: configured replica groups, for policies that also count the dead ones)."""
    if not members:
        raise ValueError("no live replica to assign microbatches to")
    first = (step - 1) * per_step
    counts, reason = get_policy(policy)(QuotaInput(tuple(sorted(members)), per_step, dict(speeds or {}), replicas))
    return Assignment(deal(range(first, first + per_step), counts), reason)


def reassign_orphans(policy: str, current: Assignment, survivors: Sequence[int],
                     speeds: Mapping[int, float] | None = None) -> Assignment:
    """After losing replicas mid-step: survivors keep their ids (their accumulation holds them) and the ids of
    the lost replicas are dealt among the survivors so that each one's whole load comes as close as it can to the
    policy's share of the step (a survivor that held less, such as an idle spare, takes more). Exactly-once: every
    id stays assigned once."""
    if not get_policy(policy).redistributes:
        raise ValueError(f"quota policy {policy!r} does not redistribute lost replicas' microbatches")
    survivors = tuple(sorted(survivors))
    orphans = sorted(i for m, ids in current.ids.items() if m not in survivors for i in ids)
    if not survivors:
        raise ValueError("no survivor to take the lost replicas' microbatches")
    held = {m: len(current.ids.get(m, ())) for m in survivors}
    target, reason = get_policy(policy)(QuotaInput(survivors, sum(held.values()) + len(orphans), dict(speeds or {})))
    counts = {m: max(0, target[m] - held[m]) for m in survivors}
    # a survivor already above its share keeps what it holds: the others' deficits then exceed the orphans, and
    # the excess is taken back from the highest ids (deterministic, the same on every rank)
    for m in sorted(survivors, reverse=True):
        excess = sum(counts.values()) - len(orphans)
        if excess <= 0:
            break
        counts[m] -= min(counts[m], excess)
    extra = deal(orphans, counts)
    ids = {m: current.ids.get(m, ()) + extra.get(m, ()) for m in survivors}
    lost = sorted(m for m in current.ids if m not in survivors)
    return Assignment(ids, f"replicas {lost} lost: their {len(orphans)} microbatches to survivors towards "
                           f"{reason}")


@dataclass(kw_only=True, slots=True)
class QuotaConfig:
    """``[recover.quota]``: the step's global microbatches and who computes which (docs/invariant.md)."""

    policy: str = "even"
    """Registered quota policy: ``even`` (equal shares), ``throughput`` (shares proportional to measured speed),
    ``drop`` (baseline with torchft's semantics: a lost replica's microbatches are skipped and the step in which it
    is lost is discarded)."""

    microbatches: int = 0
    """M, replica microbatches per step (global ids ``(step - 1) * M ... step * M - 1``). 0: replicas x gradient
    accumulation steps of one replica, the batch of the same job without failures."""

    exact: bool = False
    """Accumulate every microbatch's gradient and reduce across replicas in float64, cast back once: the committed
    gradient then does not depend on which replica computed which microbatch (bitwise-equal failure runs), at twice
    the gradient memory of the accumulator and twice the bytes reduced."""

    speed_smoothing: float = 0.5
    """Weight of the newest measurement in the speed estimate of each replica (exponential moving average)."""

    def __post_init__(self) -> None:
        get_policy(self.policy)  # raises, naming the registered policies
        if self.microbatches < 0:
            raise ValueError(f"recover.quota.microbatches must be >= 0 (0: replicas x accumulation), got {self.microbatches}")
        if not 0 < self.speed_smoothing <= 1:
            raise ValueError(f"recover.quota.speed_smoothing must be in (0, 1], got {self.speed_smoothing}")
