"""Published figures the cluster projection is built from (scripts/project_cluster.py, docs/evidence.md), each with
its source, and the two derivations made from them: a failure rate scaled to another cluster size, and the steps
torchft's drop-the-step policy loses per failure, fitted to its published kept-steps figures.

Nothing here is measured by this project. A value the sources do not give is not here: the projection states it as
an assumption and prints the result's sensitivity to it.
"""

from __future__ import annotations

from dataclasses import dataclass

KOKOLIS = ("Kokolis et al., Revisiting Reliability in Large-Scale Machine Learning Research Clusters, HPCA 2025 "
           "(arXiv:2410.21680): projected job MTTF")
LLAMA3 = "Llama 3 Herd of Models (arXiv:2407.21783), sec. 3.3.4 and Table 5: 419 unexpected interruptions in 54 days on 16 384 H100s"
FT_HSDP = ("Salpekar et al., Training LLMs with Fault Tolerant HSDP on 100,000 GPUs (arXiv:2602.00277), abstract: "
           "failure-recovery stall 10 min synchronous, 3 min FT-HSDP; ETTR 44 % -> 80 % at O(100K) GPUs")
TORCHFT = ("PyTorch blog, Fault Tolerant Llama: training with 2000 synthetic failures every ~15 seconds and no "
           "checkpoints on Crusoe L40S (torchft + torchtitan, June 2025): steps kept under synthetic failures")


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    source: str


MTTF_H = {1024: Figure(7.9, "h", KOKOLIS), 16384: Figure(1.8, "h", KOKOLIS), 131072: Figure(14 / 60, "h", KOKOLIS)}
"""Mean time to a job-interrupting failure by job size (Kokolis et al.'s model fitted to 11 months of two clusters;
the 131 072-GPU value, about 14 minutes, is their projection)."""

LLAMA3_MTTF_H = Figure(54 * 24 / 419, "h", LLAMA3)
"""3.09 h between unexpected interruptions on 16 384 H100s."""

SYNC_RESTART_S = Figure(600.0, "s", FT_HSDP)
"""Whole-job stall per failure of synchronous training (restart and recovery) at O(100K) GPUs."""

FT_HSDP_STALL_S = Figure(180.0, "s", FT_HSDP)
"""The same stall with FT-HSDP (only the failed replica restarts; the job stalls while it is removed and rejoins)."""

FT_HSDP_ETTR = (0.44, 0.80)
"""ETTR at O(100K) GPUs: synchronous, FT-HSDP (the anchor the projection is compared with)."""

TORCHFT_KEPT = ((60.0, 0.81), (15.0, 0.13))
"""(seconds between synthetic failures, share of steps kept) in torchft's public fault-tolerant HSDP run."""


def scaled_mttf_h(devices: int, reference_devices: int, reference_mttf_h: float) -> float:
    """The MTTF of a job of ``devices`` accelerators from a published one at another size, assuming independent
    failures at a constant per-accelerator rate (rate proportional to the accelerators)."""
    if devices <= 0 or reference_devices <= 0 or reference_mttf_h <= 0:
        raise ValueError("devices, reference_devices and reference_mttf_h must be > 0")
    return reference_mttf_h * reference_devices / devices


def kept_fraction(lost_s: float, interval_s: float) -> float:
    """Share of steps a drop-the-step job keeps with a failure every ``interval_s`` seconds when each discards
    ``lost_s`` seconds of the job's steps (no capacity lost otherwise): ``1 - lost_s / interval_s``."""
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    return max(0.0, 1.0 - lost_s / interval_s)


def fit_drop_lost_s(points: tuple[tuple[float, float], ...] = TORCHFT_KEPT) -> float:
    """Seconds of the job's steps one failure discards, least-squares fitted to ``(interval_s, kept)`` points under
    ``kept = 1 - lost / interval``. An in-sample fit of published figures (it reproduces them by construction, up
    to the residual of one parameter for two points), not a prediction. The figures fix seconds, not steps: the
    steps follow from the run's step time."""
    if not points:
        raise ValueError("fit_drop_lost_s needs at least one (interval_s, kept) point")
    numerator = sum((1.0 - kept) / interval for interval, kept in points)
    denominator = sum(1.0 / interval ** 2 for interval, _ in points)
    return numerator / denominator
