#!/usr/bin/env python3
"""Validate the goodput simulator against the CPU runs of benchmarks/effective_throughput.py (docs/evidence.md).

Two steps, on different runs:

1. **Freeze** (``--freeze RUNS.json``): the costs of each mode are read from one benchmark output, the calibration
   runs (``titan_recover.sim.calibration.calibrate``: step time, start-up, checkpoint save, whole-job restart, the
   stall of a failure, a group's repair, the compute a restarting group takes from the others on the shared
   cores; the median over the file's rounds) and written, with where they came from, to ``--frozen``. Nothing
   refits them afterwards.
2. **Predict** (the default): every run of the given benchmark outputs (schedules the calibration did not see:
   other failure times and rates, other victims, replica 0 among them) is predicted by the simulator from the run's
   failures alone (the times they fired and the groups they hit) and the frozen costs of its mode: the wall time at
   which the simulated policy has trained the run's steps gives the predicted effective throughput, compared with
   the measured one. The same runs are also fitted from their own costs, which says how well the model composes
   costs when it is told them (in-sample: ``fit_error``, not a prediction).

    python scripts/validate_simulator.py --freeze docs/results/effective_throughput_calibration_second.json
    python scripts/validate_simulator.py [docs/results/effective_throughput.json ...]

The prediction also writes the frozen costs, combined into one set, to ``--calibration-out`` for
``scripts/simulate_goodput.py --calibration`` and what it prints to ``--report``.

The frozen prediction is also read as the share of the failure-free run's throughput a run keeps (the quantity the
cluster projection gives: ETTR): predicted run / predicted failure-free run of its round, against measured run /
measured failure-free run of the same round. The machine's speed in that round then cancels; the tokens/s
prediction carries it.

The frozen prediction is also compared with each mode's typical run: the median over the rounds of its signed
errors (``calibration.round_median_errors``). The simulator does not model the host's noise; a run that a slow
spell of the host stretched moves this figure by one rank, where it sets the largest error alone.

Last line: ``prediction_error=... prediction_error_median=... typical_run_error=... fit_error=... kept_error=...
kept_error_median=...``: the largest and the median relative error of the frozen prediction over the runs with
failures (target: prediction_error <= 0.15), the largest over the modes of the error against the mode's typical
run (the same target), the largest in-sample error, and the largest and the median error of the predicted share
kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))

from report import recorded  # noqa: E402
from titan_recover.sim.calibration import (calibrate, combined, medians, periodic_run, predict,  # noqa: E402
                                           round_median_errors)
from titan_recover.sim.model import Costs  # noqa: E402

RESULTS = ROOT / "docs" / "results"
SHOWN = {"failure_free": ("startup_s", "step_s"),
         "ckpt_restart": ("startup_s", "step_s", "checkpoint_save_s", "first_save_extra_s", "checkpoint_write_s",
                          "job_restart_s"),
         "recover": ("startup_s", "step_s", "detect_s", "group_restart_s", "restart_load"),
         "recover_spares": ("startup_s", "step_s", "detect_s", "group_restart_s", "restart_load")}


def rounds_of(data: dict) -> list[dict]:
    """The rounds of a benchmark output (``{mode: run}`` each); outputs before rounds held one, as ``runs``."""
    return data["rounds"] if "rounds" in data else [data["runs"]]


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return head.stdout.strip() or "unknown"


def measured_costs(data: dict) -> dict[str, Costs]:
    """Each mode's costs in a benchmark output: the median of each cost over its rounds (the step and the start-up
    of the same job over its failure-free and titan_recover runs together: ``calibration.medians``)."""
    setup = data["setup"]
    return medians([{mode: calibrate(run, setup["checkpoint_interval"], setup["cpu_count"]) for mode, run in r.items()}
                    for r in rounds_of(data)])


def freeze(source: pathlib.Path, frozen: pathlib.Path) -> int:
    data = json.loads(source.read_text())
    costs = measured_costs(data)
    setup = data["setup"]
    record = {"source": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source),
              "frozen": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(),
              "schedule": {k: setup.get(k) for k in ("steps", "failures", "victims", "every", "rounds", "replicas")},
              "costs": {mode: dataclasses.asdict(c) for mode, c in costs.items()}}
    frozen.write_text(json.dumps(record, indent=1) + "\n")
    print(f"costs measured in {source.name} (s), frozen in {frozen}:")
    for mode, c in costs.items():
        print(f"  {mode:15s} " + ", ".join(f"{k} {getattr(c, k):.2f}" for k in SHOWN[mode]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", default=[str(RESULTS / "effective_throughput.json")],
                        help="benchmark outputs to predict (schedules the calibration did not see)")
    parser.add_argument("--freeze", metavar="RUNS", help="read the costs from this benchmark output and freeze them")
    parser.add_argument("--frozen", default=str(RESULTS / "calibration_frozen.json"), help="the frozen costs")
    parser.add_argument("--calibration-out", default=str(RESULTS / "calibration.json"))
    parser.add_argument("--report", default=str(RESULTS / "simulator_validation.txt"))
    args = parser.parse_args(argv)
    if args.freeze:
        return freeze(pathlib.Path(args.freeze).resolve(), pathlib.Path(args.frozen))
    frozen_path = pathlib.Path(args.frozen)
    if not frozen_path.exists():
        parser.error(f"no frozen costs at {frozen_path}: run with --freeze RUNS.json first (docs/evidence.md)")
    record = json.loads(frozen_path.read_text())
    frozen = {mode: Costs(**c) for mode, c in record["costs"].items()}
    with recorded(__file__, argv, args.report):
        return predict_runs(args, record, frozen)


def predict_runs(args, record: dict, frozen: dict[str, Costs]) -> int:
    """The frozen prediction and the in-sample fit of every run in ``args.results``, printed."""
    print(f"frozen costs (s) from {record['source']} (schedule {record['schedule']}), frozen {record['frozen']} "
        f"at {record['commit']}:")
    for mode, c in frozen.items():
        print(f"  {mode:15s} " + ", ".join(f"{k} {getattr(c, k):.2f}" for k in SHOWN[mode]))
    errors, fits, kept_errors = [], [], []
    signed: dict[str, list[float]] = {}
    """Each (output, mode)'s signed errors of the frozen prediction, one per round with failures."""
    print(f"\n{'output':28s} {'round':>5s} {'run':15s} {'faults':>6s} {'measured tok/s':>14s} "
        f"{'frozen prediction':>28s} {'fit (own costs)':>28s} {'kept of failure-free':>23s}")
    for path in args.results:
        data = json.loads(pathlib.Path(path).read_text())
        setup = data["setup"]
        shape = dict(steps=setup["steps"], replicas=setup["replicas"], tokens_per_step=setup["tokens_per_step"],
                     compute_units=setup["cpu_count"])
        for index, runs in enumerate(rounds_of(data)):
            baseline = runs.get("failure_free")
            baseline_predicted = predict(baseline, frozen["failure_free"], **shape) if baseline is not None else None
            for mode, run in runs.items():
                own = calibrate(run, setup["checkpoint_interval"], setup["cpu_count"])
                faults = sum(e["event"] == "fault_injected" for e in run["events"])
                cells, predictions = [], []
                for costs, sink in ((frozen[mode], errors), (own, fits)):
                    predicted = predict(run, costs, **shape)
                    predictions.append(predicted)
                    error = (predicted - run["tokens_per_s"]) / run["tokens_per_s"]
                    if faults:
                        sink.append(abs(error))
                        if sink is errors:
                            signed.setdefault(f"{pathlib.Path(path).stem} {mode}", []).append(error)
                    cells.append(f"{predicted:10.1f} tok/s ({error:+6.1%})")
                if faults and baseline is not None:
                    measured = run["tokens_per_s"] / baseline["tokens_per_s"]
                    kept = predictions[0] / baseline_predicted  # the frozen prediction's share
                    kept_errors.append(abs(kept / measured - 1))
                    cells.append(f"{kept:.3f} / {measured:.3f} ({kept / measured - 1:+6.1%})")
                print(f"{pathlib.Path(path).stem:28s} {index:5d} {mode:15s} {faults:6d} {run['tokens_per_s']:14.1f} "
                    + "".join(f"{c:>28s}" for c in cells[:2]) + "".join(f"{c:>24s}" for c in cells[2:]))
    print(f"\npredicted ratio recover / checkpoint-restart with a failure every N s for as long as each job runs "
        f"({setup['steps']} steps, frozen costs):")
    for every in (120, 80, 60, 45, 40, 30, 20):
        rates = {m: predict(periodic_run(m, every, setup["replicas"] - 1), frozen[m], **shape)
                 for m in ("ckpt_restart", "recover")}
        ratio = rates["recover"] / rates["ckpt_restart"] if rates["ckpt_restart"] else float("inf")
        print(f"  every {every:4d} s: recover {rates['recover']:7.1f} tok/s, checkpoint-restart "
            f"{rates['ckpt_restart']:7.1f} tok/s, ratio {ratio:.2f}")
    typical = round_median_errors(signed)
    print("\nthe frozen prediction against each mode's typical run (the median over its rounds of the signed error):")
    for key, error in typical.items():
        print(f"  {key:44s} {error:+6.1%}  (rounds: {', '.join(f'{e:+.1%}' for e in signed[key])})")
    calibration = {k: round(v, 3) for k, v in combined(frozen).items()}
    pathlib.Path(args.calibration_out).write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"\ncalibration for the simulator at scale (the frozen costs, s): {json.dumps(calibration)}")
    kept = (f" kept_error={max(kept_errors):.3f} kept_error_median={statistics.median(kept_errors):.3f}"
            if kept_errors else "")
    print(f"prediction_error={max(errors):.3f} prediction_error_median={statistics.median(errors):.3f} "
        f"typical_run_error={max(abs(e) for e in typical.values()):.3f} fit_error={max(fits):.3f}{kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
