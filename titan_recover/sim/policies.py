"""Resilience policies simulated on a :class:`~titan_recover.sim.model.Trace`, registered by name.

A policy returns an :class:`Outcome`; ``goodput`` is useful training per second of wall time, as a share of what
the job's active replica groups compute failure-free (1.0: as if nothing happened and nothing was paid for).
Useful training is what ends up in the model: checkpoint-restart loses the work since the newest checkpoint at
every failure; the synchronous modes lose none (the survivors recompute a lost group's share in the same step),
they run slower while groups are missing or straggling; torchft's drop-the-step policy loses the step a failure hits
and trains a smaller batch until the group is back; Decoupled DiLoCo loses a dead learner's unsent progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from titan_recover.registry import Registry
from titan_recover.sim.model import Cluster, Costs, Trace


@dataclass(frozen=True)
class Outcome:
    policy: str
    goodput: float
    """Useful work / wall time, relative to the active groups' failure-free throughput."""
    per_device: float
    """The same per device of the job (spares included): what the accelerators bought are worth."""
    failures: int


POLICIES: Registry[Callable[[Cluster, Costs, Trace, int], Outcome]] = Registry("simulated policy")
register_policy = POLICIES.register


def down_intervals(trace: Trace, repair_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Per replica group, the union of ``[failure, failure + repair_s)``: a group failing again while down stays
    down until the later repair. Returns (starts, ends) over all groups."""
    if trace.failures == 0:
        return np.empty(0), np.empty(0)
    order = np.lexsort((trace.failure_times, trace.failure_groups))
    groups, times = trace.failure_groups[order], trace.failure_times[order]
    starts, ends = [], []
    current_group, start, end = None, 0.0, 0.0
    for g, t in zip(groups.tolist(), times.tolist()):
        if g == current_group and t <= end:
            end = max(end, t + repair_s)
            continue
        if current_group is not None:
            starts.append(start)
            ends.append(end)
        current_group, start, end = g, t, t + repair_s
    starts.append(start)
    ends.append(end)
    return np.array(starts), np.minimum(np.array(ends), trace.horizon_s)


def integrate(horizon_s: float, changes: list[tuple[np.ndarray, np.ndarray, int]],
              rate: Callable[[list[int]], float]) -> float:
    """Integral over ``[0, horizon_s)`` of ``rate(counts)``, where counts[i] is the number of open intervals of the
    i-th family ``(starts, ends, _)``: a sweep over every start and end, O(E log E)."""
    times, deltas, family = [], [], []
    for i, (starts, ends, _) in enumerate(changes):
        times += [starts, ends]
        deltas += [np.ones(len(starts), dtype=np.int64), -np.ones(len(ends), dtype=np.int64)]
        family += [np.full(len(starts), i), np.full(len(ends), i)]
    if not times or sum(len(t) for t in times) == 0:
        return rate([0] * len(changes)) * horizon_s
    t = np.concatenate(times)
    d = np.concatenate(deltas)
    f = np.concatenate(family)
    order = np.argsort(t, kind="stable")
    counts = [0] * len(changes)
    total, previous = 0.0, 0.0
    for time, delta, fam in zip(t[order].tolist(), d[order].tolist(), f[order].tolist()):
        time = min(max(time, 0.0), horizon_s)
        total += rate(counts) * (time - previous)
        previous = time
        counts[fam] += delta
    return total + rate(counts) * (horizon_s - previous)


def _straggles(trace: Trace, confirm_s: float) -> tuple[tuple, tuple]:
    """Straggle intervals split in the part before the quota policy confirmed them and the part after."""
    s, d = trace.straggle_starts, trace.straggle_durations
    first = np.minimum(d, confirm_s)
    unconfirmed = (s, np.minimum(s + first, trace.horizon_s), 0)
    confirmed = (np.minimum(s + first, trace.horizon_s), np.minimum(s + d, trace.horizon_s), 0)
    return unconfirmed, confirmed


@register_policy("checkpoint_restart")
def checkpoint_restart(cluster: Cluster, costs: Costs, trace: Trace, spares: int = 0) -> Outcome:
    """One synchronous job: a checkpoint every ``checkpoint_interval_s`` of training (its blocking part costs
    ``checkpoint_save_s``, the first after each start ``first_save_extra_s`` more); any failure restarts the whole
    job (``job_restart_s``) from the newest checkpoint complete by then (``checkpoint_write_s`` after its blocking
    part). A straggling group slows every step by its factor."""
    kept, ready = checkpoints_at_failures(costs, trace.failure_times.tolist())
    useful = sum(kept) * costs.checkpoint_interval_s  # the work since the newest complete checkpoint is lost
    if ready < trace.horizon_s:
        useful += _trained(trace.horizon_s - ready, costs)  # the end keeps its work
    unconfirmed, confirmed = _straggles(trace, math.inf)
    f = cluster.straggler_factor
    slowed = integrate(trace.horizon_s, [unconfirmed], lambda c: 1.0 if c[0] == 0 else 1.0 / f)
    useful *= slowed / trace.horizon_s  # the share of full speed over the run
    goodput = useful / trace.horizon_s
    return Outcome("checkpoint_restart", goodput, goodput, trace.failures)


def checkpoints_at_failures(costs: Costs, failures: list[float]) -> tuple[list[int], float]:
    """Checkpoint-restart under ``failures`` (sorted times): for each, the checkpoints complete since the start it
    hit (0 for one during a restart, which restarts it again), and when the job trains again after the last."""
    kept, ready = [], costs.startup_s
    for failure in failures:
        kept.append(_checkpoints(failure - ready, costs) if failure > ready else 0)
        ready = max(ready, failure) + costs.job_restart_s
    return kept, ready


def _checkpoints(elapsed: float, costs: Costs) -> int:
    """Checkpoints complete ``elapsed`` seconds after a job started training: the first after an interval and
    its longer save, each later one a cycle (interval and save) after it, each ``checkpoint_write_s`` after its
    blocking part."""
    first = costs.checkpoint_interval_s + costs.checkpoint_save_s + costs.first_save_extra_s
    written = elapsed - costs.checkpoint_write_s
    if written < first:
        return 0
    return 1 + math.floor((written - first) / (costs.checkpoint_interval_s + costs.checkpoint_save_s))


def _trained(elapsed: float, costs: Costs) -> float:
    """Training seconds in the first ``elapsed`` seconds after a job started training (the saves' blocking parts
    left out)."""
    interval = costs.checkpoint_interval_s
    first = interval + costs.checkpoint_save_s + costs.first_save_extra_s
    if elapsed < first:
        return min(elapsed, interval)
    cycle = interval + costs.checkpoint_save_s
    left = elapsed - first
    return interval + math.floor(left / cycle) * interval + min(left % cycle, interval)


def _synchronous(name: str, cluster: Cluster, costs: Costs, trace: Trace, spares: int) -> Outcome:
    groups, f = cluster.groups, cluster.straggler_factor
    down = (*down_intervals(trace, costs.group_restart_s + costs.transfer_s), 0)
    unconfirmed, confirmed = _straggles(trace, costs.straggler_confirm_s)

    def rate(counts: list[int]) -> float:
        missing, waiting, slow = counts
        live = min(groups, groups + spares - missing)
        if live <= 0:
            return 0.0
        slow = min(slow, live)
        # the quota gives a confirmed straggler 1/f of a share; restarting groups may take shared compute
        share = cluster.capacity(live - slow + slow / f, taken=missing * costs.restart_load)
        return share / f if waiting else share  # an unconfirmed straggler holds every step back

    useful = integrate(trace.horizon_s, [down, unconfirmed, confirmed], rate)
    per_failure = costs.detect_s + (costs.spare_promotion_s if spares else 0.0)
    useful = max(0.0, useful - costs.startup_s - trace.failures * per_failure)
    goodput = useful / trace.horizon_s
    return Outcome(name, goodput, goodput * groups / (groups + spares), trace.failures)


@register_policy("recover")
def recover(cluster: Cluster, costs: Costs, trace: Trace, spares: int = 0) -> Outcome:
    """titan_recover with quotas: a failed group's microbatches are recomputed by the others in the same step (no
    work lost; ``detect_s`` of stall); until it rejoins (``group_restart_s + transfer_s``) the others carry the
    global batch, slower; a straggler holds every step back until confirmed, then gets ``1 / factor`` of a share."""
    return _synchronous("recover", cluster, costs, trace, 0)


@register_policy("recover_spares")
def recover_spares(cluster: Cluster, costs: Costs, trace: Trace, spares: int = 0) -> Outcome:
    """As ``recover``, with ``spares`` warm spare groups: a spare takes a lost group's share at the next step;
    the restarted group becomes a spare. Spares are not hit by failures in this model."""
    return _synchronous("recover_spares", cluster, costs, trace, spares)


@register_policy("drop_step")
def drop_step(cluster: Cluster, costs: Costs, trace: Trace, spares: int = 0) -> Outcome:
    """torchft's fault-tolerant HSDP: a failure discards the step in flight and every later step goes on with the
    groups that are left (a smaller global batch, no recomputation) until the lost group rejoins
    (``group_restart_s + transfer_s``); each failure, its rejoin included, costs the job ``drop_lost_steps`` steps.
    No quota: a straggler holds every step back for as long as it straggles. No spares.

    The smaller batch's tokens count as trained here, as they do in ETTR, but they are not the failure-free
    run's batch: the trajectory differs from it (ReCoVer's invariant is lost), which no goodput figure shows."""
    groups, f = cluster.groups, cluster.straggler_factor
    down = (*down_intervals(trace, costs.group_restart_s + costs.transfer_s), 0)
    unconfirmed, _ = _straggles(trace, math.inf)

    def rate(counts: list[int]) -> float:
        missing, slow = counts
        live = max(0, groups - missing)
        share = cluster.capacity(live, taken=missing * costs.restart_load)
        return share / f if slow else share

    useful = integrate(trace.horizon_s, [down, unconfirmed], rate)
    useful = max(0.0, useful - costs.startup_s - trace.failures * costs.drop_lost_steps * costs.step_s)
    goodput = useful / trace.horizon_s
    return Outcome("drop_step", goodput, goodput, trace.failures)


@register_policy("diloco")
def diloco(cluster: Cluster, costs: Costs, trace: Trace, spares: int = 0) -> Outcome:
    """Decoupled DiLoCo: learners never wait for each other, so a dead or slow learner costs only its own share;
    a dead learner's unsent progress (half of ``diloco_inner_steps`` of its steps on average) is lost."""
    groups, f = cluster.groups, cluster.straggler_factor
    down = (*down_intervals(trace, costs.group_restart_s + costs.transfer_s), 0)
    straggles = (trace.straggle_starts, np.minimum(trace.straggle_starts + trace.straggle_durations,
                                                   trace.horizon_s), 0)

    def rate(counts: list[int]) -> float:
        missing, slow = counts
        live = max(0, groups - missing)
        slow = min(slow, live)
        return cluster.capacity(live - slow + slow / f, taken=missing * costs.restart_load)

    useful = integrate(trace.horizon_s, [down, straggles], rate) - costs.startup_s
    lost = trace.failures * (costs.diloco_inner_steps / 2) * costs.step_s / groups
    goodput = max(0.0, useful - lost) / trace.horizon_s
    return Outcome("diloco", goodput, goodput, trace.failures)


def simulate(policy: str, cluster: Cluster, costs: Costs, trace: Trace, spares: int = 0) -> Outcome:
    return POLICIES.get(policy)(cluster, costs, trace, spares)
