#!/usr/bin/env python3
"""Effective training time ratio (ETTR) projected to 1 024, 16 384 and ~100 000 accelerators from published failure
rates and restart costs and this project's measured recovery costs (docs/evidence.md "Cluster projection").

    python scripts/project_cluster.py [--calibration docs/results/calibration.json] [--days 30] [--seeds 3]
                                      [--out docs/results/cluster_projection.txt]

ETTR = useful training time / wall time (the simulator's goodput, titan_recover/sim/policies.py), the mean over
``--seeds`` traces of ``--days`` days, for checkpoint-restart (checkpoints at each size's Young/Daly interval),
torchft's drop-the-step policy, titan_recover (``recover``) and titan_recover with one spare group per 64.
Inputs (printed with their sources, ``titan_recover/sim/published.py``): the job MTTF at each size (Kokolis et
al.; ~100 000 scaled linearly from their 16 384-GPU figure), the synchronous restart stall (FT-HSDP's 10 min at
O(100K), used at every size), the seconds torchft loses per failure (fitted to its published kept-steps figures);
the recovery costs of titan_recover and the blocking part of a save are read from ``--calibration`` (the format
scripts/validate_simulator.py writes) and carried over in units of the measured step, at a cluster step of
``Costs().step_s``. What no source gives is an assumption; the sensitivity table varies each one.

Writes the printed tables to ``--out`` under a header line (command, date, commit). Last line:
``ettr_recover_1k=... ettr_ckpt_1k=... ettr_drop_1k=... ettr_recover_16k=... ... ettr_drop_100k=...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import subprocess
import sys
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_recover.sim import published  # noqa: E402
from titan_recover.sim.model import Cluster, Costs, DAY_S, draw_trace, young_daly_interval  # noqa: E402
from titan_recover.sim.policies import simulate  # noqa: E402

SIZES = {"1k": 1024, "16k": 16384, "100k": 99968}
"""Accelerators per projected job; ~100 000 rounded down to whole replica groups of 64."""
DEVICES_PER_GROUP = 64
SHOWN = ("checkpoint_restart", "drop_step", "recover", "recover_spares")
SHORT = {"checkpoint_restart": "ckpt", "drop_step": "drop", "recover": "recover"}
CALIBRATED = ("checkpoint_save_s", "detect_s", "spare_promotion_s", "group_restart_s", "transfer_s")
"""Costs read from the calibration file, carried over as multiples of its measured step."""


def mttf_kokolis(devices: int) -> float:
    """Kokolis et al.'s MTTF where they publish one for the size, else scaled linearly from their 16 384-GPU one."""
    if devices in published.MTTF_H:
        return published.MTTF_H[devices].value
    return published.scaled_mttf_h(devices, 16384, published.MTTF_H[16384].value)


def mttf_llama3(devices: int) -> float:
    return published.scaled_mttf_h(devices, 16384, published.LLAMA3_MTTF_H.value)


def mttf_from_1k(devices: int) -> float:
    return published.scaled_mttf_h(devices, 1024, published.MTTF_H[1024].value)


def base_costs(calibration: pathlib.Path) -> Costs:
    """The projection's costs: the calibration's mechanism costs in units of its step, FT-HSDP's synchronous
    stall as the whole-job restart, torchft's fitted seconds per failure; nothing before the first step."""
    measured = json.loads(calibration.read_text())
    missing = [k for k in ("step_s", *CALIBRATED) if k not in measured]
    if missing:
        raise ValueError(f"{calibration}: no {', '.join(missing)} (expected the format of "
                         "scripts/validate_simulator.py's --calibration-out)")
    step_s = Costs().step_s
    carried = {name: measured[name] / measured["step_s"] * step_s for name in CALIBRATED}
    return Costs(startup_s=0.0, step_s=step_s, job_restart_s=published.SYNC_RESTART_S.value,
                 drop_lost_steps=published.fit_drop_lost_s() / step_s, **carried)


def project(devices: int, mttf_h: float, costs: Costs, days: float, seeds: int) -> tuple[dict[str, float], float]:
    """Mean ETTR per policy over ``seeds`` traces, and the mean number of failures per trace. Every failure is one
    job interruption hitting one replica group (the published MTTFs count interruptions, not devices)."""
    cluster = Cluster(devices=devices, devices_per_group=DEVICES_PER_GROUP, mtbf_device_h=mttf_h * devices,
                      node_failure_share=0.0)
    costs = dataclasses.replace(costs, checkpoint_interval_s=young_daly_interval(cluster, costs))
    spares = max(1, cluster.groups // 64)
    totals, failures = dict.fromkeys(SHOWN, 0.0), 0
    for seed in range(seeds):
        trace = draw_trace(cluster, days * DAY_S, seed=seed)
        failures += trace.failures
        for policy in SHOWN:
            totals[policy] += simulate(policy, cluster, costs, trace, spares=spares).goodput
    return {p: v / seeds for p, v in totals.items()}, failures / seeds


Variant = tuple[str, Callable[[int], float], Callable[[Costs], Costs]]


def variants(costs: Costs) -> list[Variant]:
    """The sensitivity rows: one assumption or source changed at a time."""
    same: Callable[[Costs], Costs] = lambda c: c  # noqa: E731
    step = costs.step_s
    return [
        ("as above", mttf_kokolis, same),
        ("MTTF: Llama 3 (3.09 h at 16 384), linear", mttf_llama3, same),
        ("MTTF: Kokolis 1 024 figure, linear", mttf_from_1k, same),
        ("restart 5 min (ckpt)", mttf_kokolis, lambda c: dataclasses.replace(c, job_restart_s=300.0)),
        ("restart 20 min (ckpt)", mttf_kokolis, lambda c: dataclasses.replace(c, job_restart_s=1200.0)),
        ("save 60 s blocking (ckpt)", mttf_kokolis, lambda c: dataclasses.replace(c, checkpoint_save_s=60.0)),
        ("drop: 13 steps per failure", mttf_kokolis, lambda c: dataclasses.replace(c, drop_lost_steps=13.0)),
        ("recover: FT-HSDP's 3 min stall", mttf_kokolis,
         lambda c: dataclasses.replace(c, detect_s=published.FT_HSDP_STALL_S.value)),
        ("recover: group back in 30 min", mttf_kokolis, lambda c: dataclasses.replace(c, group_restart_s=1800.0)),
        (f"step {2 * step:g} s (calibrated costs x2)", mttf_kokolis,
         lambda c: dataclasses.replace(c, step_s=2 * step, **{k: 2 * getattr(c, k) for k in CALIBRATED},
                                       drop_lost_steps=c.drop_lost_steps / 2)),
    ]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=str(ROOT / "docs" / "results" / "calibration.json"),
                        help="recovery costs measured on CPU (JSON written by scripts/validate_simulator.py)")
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "cluster_projection.txt"))
    args = parser.parse_args(argv)
    if args.days <= 0 or args.seeds < 1:
        parser.error("--days must be > 0 and --seeds >= 1")
    calibration = pathlib.Path(args.calibration)
    if not calibration.is_file():
        parser.error(f"--calibration {calibration}: no such file")
    costs = base_costs(calibration)
    lines: list[str] = []
    emit = lines.append

    drop_s = published.fit_drop_lost_s()
    emit("inputs (value: source)")
    for size, figure in published.MTTF_H.items():
        emit(f"  MTTF at {size} GPUs: {figure.value:.2f} h: {figure.source}")
    emit(f"  MTTF at 16384 GPUs, alternative: {published.LLAMA3_MTTF_H.value:.2f} h: {published.LLAMA3_MTTF_H.source}")
    emit(f"  MTTF at {SIZES['100k']} GPUs: {mttf_kokolis(SIZES['100k']) * 60:.1f} min: the 16384-GPU MTTF scaled "
         "linearly (constant per-GPU rate); Kokolis' 131072-GPU figure scaled the same way gives "
         f"{published.scaled_mttf_h(SIZES['100k'], 131072, published.MTTF_H[131072].value) * 60:.1f} min")
    emit(f"  whole-job restart (ckpt): {costs.job_restart_s:g} s at every size: {published.SYNC_RESTART_S.source}")
    emit(f"  drop_step: {drop_s:.1f} s of steps per failure, least-squares fit of kept = 1 - lost / interval to "
         + ", ".join(f"{k:.0%} kept at a failure every {t:g} s" for t, k in published.TORCHFT_KEPT)
         + f" (fit gives {', '.join(f'{published.kept_fraction(drop_s, t):.1%}' for t, _ in published.TORCHFT_KEPT)}"
         f"; in-sample): {published.TORCHFT}; = {costs.drop_lost_steps:.2f} steps at the cluster step")
    emit(f"  from {calibration.name} (measured on CPU, x {costs.step_s:g} s / measured step): "
         + ", ".join(f"{k} {getattr(costs, k):.1f} s" for k in CALIBRATED))
    emit(f"  assumed: cluster step {costs.step_s:g} s, {DEVICES_PER_GROUP} GPUs per replica group, one spare group "
         "per 64 (recover_spares), every failure one replica group, no stragglers, checkpoints at Young/Daly, "
         f"no start-up, {args.days:g} days x {args.seeds} seeds")

    emit("")
    emit("ETTR (useful training time / wall time)")
    emit(f"{'':>16s}{'MTTF':>10s}{'failures':>10s}{'ckpt interval':>15s}" + "".join(f"{p:>20s}" for p in SHOWN))
    headline: dict[str, float] = {}
    for label, devices in SIZES.items():
        mttf = mttf_kokolis(devices)
        row, failures = project(devices, mttf, costs, args.days, args.seeds)
        cluster = Cluster(devices=devices, devices_per_group=DEVICES_PER_GROUP, mtbf_device_h=mttf * devices,
                          node_failure_share=0.0)
        interval = young_daly_interval(cluster, costs)
        emit(f"{devices:>8d} GPUs  {mttf * 60:>8.1f}m{failures:>10.0f}{interval:>14.0f}s"
             + "".join(f"{row[p]:>20.4f}" for p in SHOWN))
        for policy, short in SHORT.items():
            headline[f"ettr_{short}_{label}"] = row[policy]

    emit("")
    emit("sensitivity: ETTR with one input changed (ckpt / drop / recover)")
    emit(f"{'':>44s}" + "".join(f"{label:>24s}" for label in SIZES))
    for name, mttf_of, change in variants(costs):
        cells = []
        for devices in SIZES.values():
            row, _ = project(devices, mttf_of(devices), change(costs), args.days, args.seeds)
            cells.append(f"{row['checkpoint_restart']:.3f} / {row['drop_step']:.3f} / {row['recover']:.3f}")
        emit(f"{name:>44s}" + "".join(f"{c:>24s}" for c in cells))

    lo, hi = published.FT_HSDP_ETTR
    emit("")
    emit(f"anchor (FT-HSDP at O(100K) GPUs): synchronous {lo:.2f}, FT-HSDP {hi:.2f}; here at {SIZES['100k']} GPUs: "
         f"checkpoint_restart {headline['ettr_ckpt_100k']:.2f}, recover {headline['ettr_recover_100k']:.2f} "
         "(with FT-HSDP's 3 min stall: the sensitivity row)")
    emit(" ".join(f"ettr_{short}_{label}={headline[f'ettr_{short}_{label}']:.4f}"
                  for label in SIZES for short in ("recover", "ckpt", "drop")))

    text = "\n".join(lines)
    print(text)
    command = "python scripts/project_cluster.py " + " ".join(argv if argv is not None else sys.argv[1:])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {command.strip()} | {stamp} | commit {git_commit()}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
