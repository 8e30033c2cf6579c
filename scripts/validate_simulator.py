#!/usr/bin/env python3
"""Validate the goodput simulator against the CPU runs of benchmarks/effective_throughput.py (docs/evidence.md).

Each run with failures is predicted by the simulator from the run's failure schedule (the times its faults fired
and the groups they hit) and a set of measured costs (``titan_recover.sim.calibration.calibrate``: step time,
start-up, checkpoint save, whole-job restart, the stall of a failure, a group's repair; the machine's cores as
the compute the one-thread replicas share): the wall time at which the simulated policy has trained the run's
steps gives the predicted effective throughput (committed tokens / wall time), compared with the measured one.
The costs come from the same mode's run under each given schedule: from the run itself (how the model composes
the costs) and, with two or more schedules, from the run under another schedule (whether costs measured once
predict a different failure pattern). The first file's costs are written to ``--calibration-out`` for
``scripts/simulate_goodput.py --calibration``.

    python scripts/validate_simulator.py [docs/results/effective_throughput.json ...]

Last line: ``prediction_error=... cross_schedule_error=...``: the largest relative error over the runs with
failures predicted from their own schedule's costs (the issue's measure; target <= 0.15), and over those predicted
from another schedule's costs (only with two or more files).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_recover.sim.calibration import calibrate, combined, periodic_run, predict  # noqa: E402

SHOWN = {"failure_free": ("startup_s", "step_s"),
         "ckpt_restart": ("startup_s", "step_s", "checkpoint_save_s", "job_restart_s"),
         "recover": ("startup_s", "step_s", "detect_s", "group_restart_s", "restart_load"),
         "recover_spares": ("startup_s", "step_s", "detect_s", "group_restart_s", "restart_load")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", default=[str(ROOT / "docs" / "results" / "effective_throughput.json")],
                        help="benchmark outputs (one per failure schedule)")
    parser.add_argument("--calibration-out", default=str(ROOT / "docs" / "results" / "calibration.json"))
    args = parser.parse_args(argv)
    schedules = [json.loads(pathlib.Path(p).read_text()) for p in args.results]
    names = [pathlib.Path(p).stem for p in args.results]
    costs = [{mode: calibrate(run, s["setup"]["checkpoint_interval"], s["setup"]["cpu_count"])
              for mode, run in s["runs"].items()} for s in schedules]
    for name, measured in zip(names, costs):
        print(f"costs measured in {name} (s):")
        for mode, c in measured.items():
            print(f"  {mode:15s} " + ", ".join(f"{k} {getattr(c, k):.2f}" for k in SHOWN[mode]))
    errors, cross = [], []
    print(f"\n{'schedule':28s} {'run':15s} {'measured tok/s':>14s}  " + "".join(
        f"{'costs of ' + n:>36s}" for n in names))
    for own, (name, data) in enumerate(zip(names, schedules)):
        setup = data["setup"]
        for mode, run in data["runs"].items():
            cells = []
            for index, source in enumerate(costs):
                predicted = predict(run, source[mode], steps=setup["steps"], replicas=setup["replicas"],
                                    tokens_per_step=setup["tokens_per_step"], compute_units=setup["cpu_count"])
                error = (predicted - run["tokens_per_s"]) / run["tokens_per_s"]
                if mode != "failure_free":
                    (errors if index == own else cross).append(abs(error))
                cells.append(f"{predicted:10.1f} tok/s ({error:+6.1%})")
            print(f"{name:28s} {mode:15s} {run['tokens_per_s']:14.1f}  " + "".join(f"{c:>36s}" for c in cells))
    # what the ratio would be if a whole-job restart cost more (the first schedule's runs and costs)
    first, setup = schedules[0]["runs"], schedules[0]["setup"]
    shape = dict(steps=setup["steps"], replicas=setup["replicas"], tokens_per_step=setup["tokens_per_step"],
                 compute_units=setup["cpu_count"])
    recover = predict(first["recover"], costs[0]["recover"], **shape)
    restart = costs[0]["ckpt_restart"]
    print(f"\npredicted ratio recover / checkpoint-restart under {names[0]}'s failures, by whole-job restart cost:")
    for steps in (restart.job_restart_s / restart.step_s, 30, 45, 60, 70, 85):
        slower = dataclasses.replace(restart, job_restart_s=steps * restart.step_s)
        print(f"  restart {steps:5.1f} steps ({steps * restart.step_s:6.1f} s): "
              f"{recover / predict(first['ckpt_restart'], slower, **shape):.2f}")
    # and under a constant failure rate: a failure every `every` seconds for as long as each job runs
    print(f"\npredicted ratio recover / checkpoint-restart with a failure every N s for as long as each job runs "
          f"({names[0]}'s costs):")
    for every in (120, 80, 60, 45, 40, 36, 32, 28):
        rates = {m: predict(periodic_run(m, every, setup["replicas"] - 1), costs[0][m], **shape)
                 for m in ("ckpt_restart", "recover")}
        ratio = rates["recover"] / rates["ckpt_restart"] if rates["ckpt_restart"] else float("inf")
        print(f"  every {every:4d} s: recover {rates['recover']:7.1f} tok/s, checkpoint-restart "
              f"{rates['ckpt_restart']:7.1f} tok/s, ratio {ratio:.2f}")
    calibration = {k: round(v, 3) for k, v in combined(costs[0]).items()}
    pathlib.Path(args.calibration_out).write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"\ncalibration for the simulator at scale (costs of {names[0]}, s): {json.dumps(calibration)}")
    print(f"prediction_error={max(errors):.3f}" + (f" cross_schedule_error={max(cross):.3f}" if cross else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
