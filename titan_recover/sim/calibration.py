"""The simulator's costs read from measured runs, and its prediction of those runs (docs/evidence.md).

A run is the record ``benchmarks/effective_throughput.py`` writes: ``mode``, ``commits`` (seconds since the
launch, step) of every step committed (a restarted job commits the steps after its checkpoint again), ``events``
(fault_injected, training_started, full_strength, ... with ``t`` in seconds since the launch) and ``end_s`` (the
last step's commit).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

from titan_recover.sim.model import Cluster, Costs, Trace
from titan_recover.sim.policies import simulate

POLICY = {"failure_free": "recover", "ckpt_restart": "checkpoint_restart", "recover": "recover",
          "recover_spares": "recover_spares"}
"""The simulated policy of each benchmark mode."""


MAX_SLOWDOWN = 64
"""``predict`` gives up (0 tokens/s) on a run that would take this many times its failure-free time."""


def periodic_failures(every_s: float, victims: int, first_s: float = 40.0,
                      until_s: float = 1e5) -> list[tuple[float, int]]:
    """``(time, replica)`` of a failure every ``every_s`` seconds from ``first_s`` until ``until_s`` (a constant
    failure rate), replicas 1..``victims`` hit in turn: the schedule of ``effective_throughput.py --every``."""
    return [(float(t), 1 + i % victims) for i, t in enumerate(np.arange(first_s, until_s, every_s))]


def periodic_run(mode: str, every_s: float, victims: int, first_s: float = 40.0, horizon_s: float = 1e5) -> dict:
    """A run record with ``periodic_failures``, for as long as the job runs: what ``predict`` needs of a run."""
    events = [{"event": "fault_injected", "t": t, "replica": replica}
              for t, replica in periodic_failures(every_s, victims, first_s, horizon_s)]
    return {"mode": mode, "events": events}


def commit_intervals(commits: list) -> dict[int, list[float]]:
    """``{step: [seconds since the previous step's commit]}``; a restart's first commit has none."""
    out: dict[int, list[float]] = {}
    for (t0, s0), (t1, s1) in zip(commits, commits[1:]):
        if s1 == s0 + 1:
            out.setdefault(s1, []).append(t1 - t0)
    return out


def fault_steps(run: dict) -> set[int]:
    """Steps whose commit interval contains a fault: the first step committed after it."""
    hit = set()
    for fault in (e["t"] for e in run["events"] if e["event"] == "fault_injected"):
        later = [s for t, s in run["commits"] if t >= fault]
        if later:
            hit.add(later[0])
    return hit


def saves_at_faults(run: dict, checkpoint_interval: int) -> list[dict]:
    """For each fault of a checkpoint-restart run: ``t``; ``save``, the newest step of a save committed before it
    (a multiple of ``checkpoint_interval``; 0: none yet); ``since_s``, the seconds from that step's commit to the
    fault (None without a save); ``resumed_from``, the step rank 0's next start resumed from. ``resumed_from <
    save`` means that save was not complete when the fault came (an asynchronous write still going on)."""
    starts = [(e["t"], e["resumed_from"]) for e in run["events"]
              if e["event"] == "training_started" and e["source"] == "0/0"]
    out = []
    for fault in (e["t"] for e in run["events"] if e["event"] == "fault_injected"):
        before = [(t, s) for t, s in run["commits"] if t < fault]
        save = before[-1][1] // checkpoint_interval * checkpoint_interval if before else 0
        committed = [t for t, s in before if s == save]
        later = [(t, step) for t, step in starts if t > fault]
        out.append({"t": fault, "save": save, "since_s": fault - committed[-1] if save and committed else None,
                    "resumed_from": min(later)[1] if later else None})
    return out


def repairs(events: list[dict]) -> list[tuple[float, float]]:
    """``(fault, back)`` for each lost group that came back: from the fault to the end of the group's own state
    transfer (its rank 0's ``state_transferred`` as the joiner), after which it computes its share again. Another
    group lost meanwhile does not lengthen it (the job's ``full_strength`` waits for every group); runs recorded
    before joiners logged their transfer fall back to the first ``full_strength`` after the fault."""
    faults = [(e["t"], e["replica"]) for e in events if e["event"] == "fault_injected"]
    joined = [(e["t"], e["replica"]) for e in events
              if e["event"] == "state_transferred" and e.get("role") == "joiner" and e.get("rank", 0) == 0]
    full = [e["t"] for e in events if e["event"] == "full_strength"]
    out = []
    for fault, replica in faults:
        back = [t for t, r in joined if r == replica and t > fault] if joined else [t for t in full if t > fault]
        if back:
            out.append((fault, min(back)))
    return out


def job_starts(run: dict) -> list[tuple[float, list[tuple[float, int]]]]:
    """A checkpoint-restart run's starts: ``(t, commits)`` for the launch (t = 0) and each restart (rank 0's
    ``training_started`` after a fault), with the commits of that start, up to the next fault."""
    faults = sorted(e["t"] for e in run["events"] if e["event"] == "fault_injected")
    starts = [0.0] + sorted(e["t"] for e in run["events"] if e["event"] == "training_started"
                            and e["source"] == "0/0" and faults and e["t"] > faults[0])
    out = []
    for t in starts:
        end = min((f for f in faults if f > t), default=math.inf)
        out.append((t, [(c, s) for c, s in run["commits"] if t < c < end]))
    return out


def _trains_from(commits: list[tuple[float, int]], step_s: float) -> float:
    """When a start's job trains at ``step_s``: its second commit less two steps, or its first less one where it
    has one only (the warm-up of its first steps counted as time it did not train)."""
    if len(commits) > 1 and commits[1][1] == commits[0][1] + 1:
        return commits[1][0] - 2 * step_s
    return commits[0][0] - step_s


def _save_steps(starts: list, interval: int) -> tuple[list[float], list[float]]:
    """The intervals of the steps after a save (a save's blocking part falls in them): each start's first, and the
    others."""
    first, later = [], []
    for _, commits in starts:
        saves = [t1 - t0 for (t0, s0), (t1, s1) in zip(commits, commits[1:])
                 if s1 == s0 + 1 and (s1 - 1) % interval == 0]
        first += saves[:1]
        later += saves[1:]
    return first, later


def start_figures(run: dict, checkpoint_interval: int) -> dict[str, list[float]]:
    """What the starts of a checkpoint-restart run (:func:`job_starts`) show, plainly, for the warm-up terms of
    :func:`calibrate`: ``second_step``, the launch's second step (its commit interval); ``first_saves``, each
    start's first step after a save; ``later_saves``, the other steps after a save; ``restart_first_commit``, from
    each restart's ``training_started`` to its first commit; ``to_started``, from each fault to the next
    ``training_started`` (the restart as read before the warm-up was; seconds)."""
    starts = job_starts(run)
    launch = starts[0][1]
    first, later = _save_steps(starts, checkpoint_interval)
    faults = [e["t"] for e in run["events"] if e["event"] == "fault_injected"]
    return {"second_step": [launch[1][0] - launch[0][0]] if len(launch) > 1 and launch[1][1] == launch[0][1] + 1
            else [], "first_saves": first, "later_saves": later,
            "restart_first_commit": [own[0][0] - t for t, own in starts[1:] if own],
            "to_started": [min(t for t, _ in starts if t > f) - f for f in faults if any(t > f for t, _ in starts)]}


def _checkpoint_costs(starts: list, events: list[dict], interval: int, step_s: float) -> dict[str, float]:
    """``checkpoint_save_s``, ``first_save_extra_s``, ``checkpoint_write_s`` and ``checkpoint_interval_s`` of a
    checkpoint-restart run: the extra interval of the steps after a save, a start's first save apart."""
    first, later = _save_steps(starts, interval)
    save = max(0.0, statistics.median(later or first) - step_s)
    written = [e["write_s"] for e in events if e["event"] == "checkpoint_complete" and e["source"] == "0/0"]
    return {"checkpoint_interval_s": interval * step_s, "checkpoint_save_s": save,
            "first_save_extra_s": max(0.0, statistics.median(first) - step_s - save) if first else 0.0,
            "checkpoint_write_s": statistics.median(written) if written else 0.0}


def calibrate(run: dict, checkpoint_interval: int, compute_units: int = 0) -> Costs:
    """The costs of one run, read from its timeline:

    * ``step_s``: median interval between commits, leaving out the first two steps, the steps after a checkpoint
      save, the steps a fault fell in and (replica-group modes) the steps while a lost group restarts;
      ``startup_s``: launch to the second commit, less two steps (the first steps' warm-up included: a
      calibration run's second step is slower than later ones, ``docs/results/checkpoint_starts.txt``);
    * checkpoint-restart: ``checkpoint_save_s``, the median extra interval of a step after a save that is not a
      start's first, ``first_save_extra_s``, how much more the first save after each start (:func:`job_starts`)
      adds, ``checkpoint_write_s``, the median of rank 0's ``checkpoint_complete`` (an asynchronous save's write
      after its blocking part; 0 in a run recorded without them), and ``job_restart_s``, the mean from a fault to
      the restarted job's second commit, less two steps (to its first, less one, where it failed again before its
      second; faults after which it committed nothing before the next are left out);
    * the replica-group modes: ``detect_s``, the mean extra interval of the steps a fault fell in,
      ``group_restart_s``, the mean from a fault to the lost group's return (:func:`repairs`, its state transfer
      included), and, with ``compute_units`` shared by the groups (one CPU machine), ``restart_load``: the compute
      units a restarting group's start-up takes, from how much slower the steps between a fault and that group's
      return are.
    """
    commits, events = run["commits"], run["events"]
    restart_mode = run["mode"] == "ckpt_restart"
    hit = fault_steps(run)
    faults = [e["t"] for e in events if e["event"] == "fault_injected"]
    down = repairs(events)
    steady, restarting = [], []
    for (t0, s0), (t1, s1) in zip(commits, commits[1:]):
        if s1 != s0 + 1 or s1 <= 2 or s1 in hit or restart_mode and (s1 - 1) % checkpoint_interval == 0:
            continue
        if any(f < t1 <= b for f, b in down):
            restarting.append(t1 - t0)
        else:
            steady.append(t1 - t0)
    step_s = statistics.median(steady)
    starts = job_starts(run) if restart_mode else [(0.0, [c for c in commits if c[0] < min(faults, default=math.inf)])]
    launched = starts[0][1] or commits  # a fault before the first commit: its stall counts as start-up
    costs = {"step_s": step_s, "startup_s": _trains_from(launched, step_s), "spare_promotion_s": 0.0,
             "transfer_s": 0.0}
    if restart_mode:
        costs.update(_checkpoint_costs(starts, events, checkpoint_interval, step_s))
        restarts = [_trains_from(own, step_s) - f for f in faults for t, own in starts[1:]
                    if t > f and own and not any(f < g < t for g in faults)]
        costs["job_restart_s"] = statistics.mean(restarts) if restarts else 0.0
    elif faults:
        per_step = commit_intervals(commits)
        stalls = [d - step_s for s in hit for d in per_step.get(s, [])]
        costs["detect_s"] = max(0.0, statistics.mean(stalls)) if stalls else 0.0
        costs["group_restart_s"] = statistics.mean(b - f for f, b in down) if down else 0.0
        if compute_units and restarting:
            slowdown = statistics.median(restarting) / step_s
            costs["restart_load"] = max(0.0, compute_units * (1 - 1 / slowdown))
    return Costs(**costs)


def predict(run: dict, costs: Costs, *, steps: int, replicas: int, tokens_per_step: int,
            compute_units: int) -> float:
    """The simulator's committed tokens per second for ``run``: the wall time at which its policy has trained
    ``steps`` steps under the run's failures (times and groups as they fired), one-process groups sharing
    ``compute_units``. Nothing of the run but its failures is used; the costs may come from another run. 0.0
    when the policy would need more than ``MAX_SLOWDOWN`` times its failure-free time."""
    cluster = Cluster(devices=replicas, devices_per_group=1, devices_per_node=1, compute_units=compute_units)
    faults = sorted((e["t"], e["replica"]) for e in run["events"] if e["event"] == "fault_injected")
    spares = 1 if run["mode"] == "recover_spares" else 0

    def trained(horizon: float) -> float:
        before = [(t, g) for t, g in faults if t < horizon]
        trace = Trace(horizon, np.array([t for t, _ in before], dtype=float),
                      np.array([g for _, g in before], dtype=np.int64), np.empty(0), np.empty(0, dtype=np.int64),
                      np.empty(0))
        return simulate(POLICY[run["mode"]], cluster, costs, trace, spares).goodput * horizon / costs.step_s

    low, high = 0.0, costs.startup_s + steps * costs.step_s
    limit = MAX_SLOWDOWN * high
    while trained(high) < steps:  # failures only add time: widen until the budget fits
        if high > limit:
            return 0.0  # the policy makes (almost) no progress under these failures
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if trained(middle) >= steps else (middle, high)
    return steps * tokens_per_step / high


SAME_JOB = ("failure_free", "recover")
"""Modes that run the same job until its first fault (the replica groups, no spare): their steady step and their
start-up are one quantity, measured in both."""


def medians(per_round: list[dict[str, Costs]]) -> dict[str, Costs]:
    """Each mode's costs over rounds of runs (``{mode: Costs}`` each): the median of each cost over the rounds; the
    step and the start-up of the modes in :data:`SAME_JOB` over all their runs together."""
    out = {}
    for mode in per_round[0]:
        fields = {f.name: statistics.median(getattr(r[mode], f.name) for r in per_round)
                  for f in dataclasses.fields(Costs)}
        if mode in SAME_JOB:
            for name in ("step_s", "startup_s"):
                fields[name] = statistics.median(getattr(r[m], name) for r in per_round for m in SAME_JOB if m in r)
        fields["diloco_inner_steps"] = int(fields["diloco_inner_steps"])
        out[mode] = Costs(**fields)
    return out


def round_median_errors(errors: dict[str, list[float]]) -> dict[str, float]:
    """The error of a prediction against a mode's typical run: ``errors`` holds each mode's signed relative errors
    (predicted / measured - 1), one per round, each run predicted from its own failures; the result, each mode's
    median of them. The simulator has no model of the host's noise, so it predicts the typical run; the largest
    single-run error also grows with the number of rounds (the worst of more noisy draws), the median does not."""
    return {mode: statistics.median(signed) for mode, signed in errors.items() if signed}


def combined(costs: dict[str, Costs]) -> dict[str, float]:
    """One set of mechanism costs for the simulator at scale: the failure-free run's step, checkpointing and the
    whole-job restart from checkpoint-restart, the stall and the group's repair from recover, and what a spare's
    take-over adds to the stall."""
    return {"step_s": costs["failure_free"].step_s,
            "checkpoint_save_s": costs["ckpt_restart"].checkpoint_save_s,
            "job_restart_s": costs["ckpt_restart"].job_restart_s,
            "detect_s": costs["recover"].detect_s,
            "group_restart_s": costs["recover"].group_restart_s,
            "transfer_s": 0.0,
            "spare_promotion_s": max(0.0, costs["recover_spares"].detect_s - costs["recover"].detect_s)}
