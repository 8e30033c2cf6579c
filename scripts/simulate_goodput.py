#!/usr/bin/env python3
"""Goodput of the resilience policies on simulated clusters (titan_recover/sim, docs/simulator.md).

    python scripts/simulate_goodput.py [--days 30] [--seed 0] [--out docs/results]

Prints goodput per policy for clusters of 10^3 ... 10^6 accelerators and for a range of per-device MTBFs, times the
largest case (10^6 devices x ``--days`` days on one core), and plots both sweeps (``simulator_size.png``,
``simulator_mtbf.png``). The costs are ``titan_recover.sim.model.Costs``' defaults (stated assumptions for a GPU
cluster), or with ``--calibration docs/results/calibration.json`` the mechanism costs measured on the CPU runs
(scripts/validate_simulator.py writes the file), carried over in units of the measured step time: a restart that
took 20 CPU steps takes 20 of the cluster's steps (``step_s``, 10 s by default). ``--cost name=value`` overrides
either; docs/simulator.md says where each comes from. Checkpoint-restart checkpoints at the Young/Daly
interval of each cluster (its best case) unless ``--cost checkpoint_interval_s=...`` fixes one.

Last line: ``devices=... days=... seconds=... goodput_checkpoint_restart=... goodput_recover=...
goodput_recover_spares=... goodput_diloco=...`` (the 10^6-device case).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import recorded  # noqa: E402
from titan_recover.sim.model import Cluster, Costs, DAY_S, draw_trace, young_daly_interval  # noqa: E402
from titan_recover.sim.policies import POLICIES, simulate  # noqa: E402

SIZES = (1024, 8192, 65536, 1_000_000)
MTBFS_H = (10_000, 25_000, 50_000, 100_000)


CALIBRATED = ("checkpoint_save_s", "job_restart_s", "detect_s", "spare_promotion_s", "group_restart_s",
              "transfer_s")
"""Mechanism costs carried over from the CPU runs, as multiples of their step time."""


def calibrated_costs(path: pathlib.Path) -> dict[str, float]:
    measured = json.loads(path.read_text())
    step_s = Costs().step_s
    return {name: measured[name] / measured["step_s"] * step_s for name in CALIBRATED}


def spares_for(cluster: Cluster) -> int:
    """One spare group per 64 active ones, at least one."""
    return max(1, cluster.groups // 64)


def run(cluster: Cluster, costs: Costs, days: float, seed: int, fixed_interval: bool) -> tuple[dict[str, float], int]:
    """Goodput per policy on one trace, and the trace's number of events (failures + straggles)."""
    if not fixed_interval:
        costs = dataclasses.replace(costs, checkpoint_interval_s=young_daly_interval(cluster, costs))
    trace = draw_trace(cluster, days * DAY_S, seed=seed)
    goodputs = {p: simulate(p, cluster, costs, trace, spares=spares_for(cluster)).goodput for p in POLICIES.names()}
    return goodputs, trace.failures + len(trace.straggle_starts)


def plot(rows: list[tuple[float, dict[str, float]]], xlabel: str, out: pathlib.Path, log_x: bool = True) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for policy in POLICIES.names():
        ax.plot([x for x, _ in rows], [r[policy] for _, r in rows], marker="o", label=policy)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("goodput (share of failure-free throughput)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--straggler-rate", type=float, default=0.01, help="episodes per group per hour")
    parser.add_argument("--cost", action="append", default=[], help="override a Costs field: name=value")
    parser.add_argument("--calibration", help="costs measured on the CPU runs (JSON), in units of their step")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"), help="folder of the plots")
    parser.add_argument("--report", default="-",
                        help="also write what is printed to this file under a header line (benchmarks/report.py)")
    args = parser.parse_args(argv)
    overrides = calibrated_costs(pathlib.Path(args.calibration)) if args.calibration else {}
    for item in args.cost:
        name, _, value = item.partition("=")
        if name not in {f.name for f in dataclasses.fields(Costs)}:
            parser.error(f"--cost {name}: not a Costs field ({', '.join(f.name for f in dataclasses.fields(Costs))})")
        overrides[name] = type(getattr(Costs(), name))(value)
    costs = Costs(**overrides)
    fixed = "checkpoint_interval_s" in overrides
    suffix = "_calibrated" if args.calibration else ""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with recorded(__file__, argv, args.report):
        shown = {k: round(v, 3) for k, v in dataclasses.asdict(costs).items()
                 if fixed or k != "checkpoint_interval_s"}
        print(f"costs (s): {json.dumps(shown)}" + ("" if fixed else "; checkpoints at each cluster's Young/Daly interval"))
        header = f"{'':>22s}" + "".join(f"{p:>20s}" for p in POLICIES.names())

        by_size = []
        print(f"\ngoodput vs cluster size ({args.days:g} days, MTBF {Cluster().mtbf_device_h:g} h per device, "
              f"{args.straggler_rate} straggles per group-hour)\n{header}")
        seconds = None
        for devices in SIZES:
            cluster = Cluster(devices=devices - devices % 64, straggler_rate_per_group_h=args.straggler_rate)
            started = time.process_time()
            row, events = run(cluster, costs, args.days, args.seed, fixed)
            if devices == SIZES[-1]:
                seconds = time.process_time() - started
            by_size.append((cluster.devices, row))
            print(f"{cluster.devices:>14d} devices" + "".join(f"{row[p]:>20.4f}" for p in POLICIES.names())
                  + f"   ({events} events)")

        by_mtbf = []
        print(f"\ngoodput vs per-device MTBF (65536 devices, {args.days:g} days)\n{header}")
        for mtbf in MTBFS_H:
            cluster = Cluster(devices=65536, mtbf_device_h=mtbf, straggler_rate_per_group_h=args.straggler_rate)
            row, _ = run(cluster, costs, args.days, args.seed, fixed)
            by_mtbf.append((mtbf, row))
            print(f"{mtbf:>16d} h MTBF" + "".join(f"{row[p]:>20.4f}" for p in POLICIES.names()))

        plot(by_size, "accelerators", out / f"simulator_size{suffix}.png")
        plot(by_mtbf, "MTBF per device (h)", out / f"simulator_mtbf{suffix}.png")
        print(f"\nplots: {out / f'simulator_size{suffix}.png'}, {out / f'simulator_mtbf{suffix}.png'}")
        largest = by_size[-1][1]
        print(f"devices={by_size[-1][0]} days={args.days:g} seconds={seconds:.2f} "
              + " ".join(f"goodput_{p}={largest[p]:.4f}" for p in POLICIES.names()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
