"""The cluster, its costs, and the trace of failures and stragglers drawn for one simulated run.

Everything here is pure and seeded: the same (cluster, horizon, seed) gives the same trace, and a trace drawn with
a higher failure rate contains the one drawn with a lower (thinned from one stream), so policies are compared on
the same events and "more failures never give more goodput" is tested on coupled traces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HOUR_S = 3600.0
DAY_S = 24 * HOUR_S


@dataclass(frozen=True)
class Cluster:
    devices: int = 16384
    """Accelerators in the job (active replica groups x devices per group; spares come on top)."""
    devices_per_group: int = 64
    """A replica group: one model copy, sharded inside (FSDP / TP / PP)."""
    devices_per_node: int = 8
    mtbf_device_h: float = 50_000.0
    """Mean time between failures of one device (Llama 3's 16k-GPU run: about 50 000 h per GPU)."""
    node_failure_share: float = 0.1
    """Share of failures that take a whole node (all its devices at once: power, NIC, host)."""
    straggler_rate_per_group_h: float = 0.0
    """Straggler episodes per replica group per hour (thermal throttling, a slow link, a noisy neighbour)."""
    straggler_factor: float = 3.0
    """A straggling group computes this many times slower."""
    straggler_duration_s: float = 600.0
    compute_units: int = 0
    """0: every group computes on its own accelerators (throughput proportional to the groups computing). n > 0:
    all groups share n compute units, as the CPU benchmark's one-thread replica processes share this machine's
    cores: throughput proportional to ``min(groups computing, n)``."""

    def capacity(self, computing: float, taken: float = 0.0) -> float:
        """Throughput with ``computing`` groups' worth of work going on, as a share of all active groups'; with
        shared compute units, ``taken`` of them busy with something else (restarting groups starting up)."""
        if self.compute_units:
            free = max(0.0, self.compute_units - taken)
            return min(computing, free) / min(self.groups, self.compute_units)
        return computing / self.groups

    def __post_init__(self) -> None:
        if self.devices < self.devices_per_group or self.devices % self.devices_per_group:
            raise ValueError(f"devices ({self.devices}) must be a positive multiple of devices_per_group "
                             f"({self.devices_per_group})")
        if self.mtbf_device_h <= 0 or not 0 <= self.node_failure_share <= 1 or self.straggler_factor < 1:
            raise ValueError("mtbf_device_h must be > 0, node_failure_share in [0, 1], straggler_factor >= 1")
        if self.compute_units < 0:
            raise ValueError(f"compute_units must be >= 0, got {self.compute_units}")

    @property
    def groups(self) -> int:
        return self.devices // self.devices_per_group

    @property
    def failure_rate_per_s(self) -> float:
        """Failure events per second in the whole job (a node failure is one event)."""
        device_rate = self.devices / (self.mtbf_device_h * HOUR_S)
        # a node failure replaces devices_per_node device failures by one event
        return device_rate * ((1 - self.node_failure_share) + self.node_failure_share / self.devices_per_node)


@dataclass(frozen=True)
class Costs:
    """Seconds each mechanism costs (calibrated from the CPU benchmarks: docs/simulator.md)."""

    startup_s: float = 0.0
    """From launching the job until it trains at ``step_s``: process start-up, model build, and what its first
    steps take longer than later ones (warm-up). Nothing trains in it."""
    step_s: float = 10.0
    """One synchronous training step of the job."""
    checkpoint_save_s: float = 5.0
    """Blocking part of one (async) checkpoint save."""
    first_save_extra_s: float = 0.0
    """How much longer the blocking part of a job's first save after each (re)start takes than
    ``checkpoint_save_s`` (an asynchronous save's first one sets up its staging and background writer)."""
    checkpoint_interval_s: float = 1800.0
    """Training time between checkpoints (checkpoint-restart)."""
    checkpoint_write_s: float = 0.0
    """After a save's blocking part, until the checkpoint is complete on storage and a restart can load it (an
    asynchronous save's background write): a failure within it restarts from the checkpoint before. 0: complete
    when the blocking part ends."""
    job_restart_s: float = 600.0
    """A whole-job restart, from a failure until the job trains at ``step_s`` again: scheduling, process start-up,
    loading the newest checkpoint, the first steps' warm-up."""
    detect_s: float = 2.0
    """titan_recover: from a failure to the survivors' new epoch (heartbeat timeout / connection error)."""
    spare_promotion_s: float = 10.0
    """titan_recover with spares: the extra stall of a failure when a spare takes the lost group's share."""
    group_restart_s: float = 300.0
    """A failed replica group's restart (processes, on a healthy or replacement node) until it asks to join."""
    transfer_s: float = 30.0
    """Streaming the state from a peer to a rejoining group (PHOENIX)."""
    straggler_confirm_s: float = 30.0
    """titan_recover: how long a straggler slows every step before the quota policy gives it less work."""
    drop_lost_steps: float = 1.0
    """torchft's drop-the-step policy: the job's steps a failure costs, its group's rejoin included (the step in
    flight is discarded, the quorum and communicators are rebuilt, the group is admitted again). At least the step
    in flight; ``titan_recover.sim.published.fit_drop_lost_s`` reads the seconds from torchft's published figures."""
    diloco_inner_steps: int = 50
    """Decoupled DiLoCo: a learner's unsent progress averages half of this many of its steps when it dies."""
    restart_load: float = 0.0
    """Shared compute units (``Cluster.compute_units``) a restarting group takes from the others while it is down:
    on one CPU machine its start-up competes for the cores; on a cluster it starts on its own hosts (0)."""


@dataclass(frozen=True)
class Trace:
    """One run's events, sorted by time: failures (time, replica group, devices lost) and straggles
    (start, group, duration)."""

    horizon_s: float
    failure_times: np.ndarray
    failure_groups: np.ndarray
    straggle_starts: np.ndarray
    straggle_groups: np.ndarray
    straggle_durations: np.ndarray

    @property
    def failures(self) -> int:
        return len(self.failure_times)


def young_daly_interval(cluster: Cluster, costs: Costs) -> float:
    """The checkpoint interval that maximises checkpoint-restart's goodput to first order (Young 1974, Daly 2006):
    ``sqrt(2 x save cost x MTBF of the job)``, the save cost being the blocking part of a checkpoint."""
    return (2 * costs.checkpoint_save_s / cluster.failure_rate_per_s) ** 0.5


MAX_RATE_SCALE = 8.0
"""Failures are thinned from one stream drawn at this multiple of the cluster's rate."""


def draw_trace(cluster: Cluster, horizon_s: float, seed: int = 0, rate_scale: float = 1.0) -> Trace:
    """Failures as a Poisson process of the cluster's rate (x ``rate_scale``); each hits a uniformly drawn device
    (or its node); straggles as a Poisson process per group. The failures are thinned from one stream drawn at
    ``MAX_RATE_SCALE`` times the rate and the straggles come from a stream of their own, so for one seed a larger
    ``rate_scale`` only adds failures to the same trace."""
    if not 0 <= rate_scale <= MAX_RATE_SCALE:
        raise ValueError(f"rate_scale must be in [0, {MAX_RATE_SCALE}], got {rate_scale}")
    rng = np.random.default_rng([seed, 0])
    count = rng.poisson(cluster.failure_rate_per_s * MAX_RATE_SCALE * horizon_s)
    times = np.sort(rng.uniform(0.0, horizon_s, count))
    keep = rng.uniform(0.0, 1.0, count) < rate_scale / MAX_RATE_SCALE
    devices = rng.integers(0, cluster.devices, count)
    node_wide = rng.uniform(0.0, 1.0, count) < cluster.node_failure_share
    # a node failure takes the node's devices; with groups of whole nodes that is one group (a node spread over
    # two groups would take both: the model keeps the first)
    first_device = np.where(node_wide, devices - devices % cluster.devices_per_node, devices)
    groups = first_device // cluster.devices_per_group
    straggles = np.random.default_rng([seed, 1])
    s_rate = cluster.straggler_rate_per_group_h / HOUR_S * cluster.groups
    s_count = straggles.poisson(s_rate * horizon_s) if s_rate > 0 else 0
    s_starts = np.sort(straggles.uniform(0.0, horizon_s, s_count))
    s_groups = straggles.integers(0, cluster.groups, s_count)
    s_durations = straggles.exponential(cluster.straggler_duration_s, s_count)
    return Trace(horizon_s, times[keep], groups[keep], s_starts, s_groups, s_durations)
