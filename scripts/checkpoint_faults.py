#!/usr/bin/env python3
"""Where checkpoint-restart's faults fell against its saves, in runs of benchmarks/effective_throughput.py
(docs/evidence.md "What the model left out"): for every fault, the newest save before it, how long after that
save's step committed it came, and the step the restarted job resumed from (earlier than the save: the save's
asynchronous write had not finished); per run its own costs (``calibration.calibrate``: step, whole-job restart,
``checkpoint_write_s`` where the run logged ``checkpoint_complete``); with ``--frozen``, when those costs put the
commit of the first fault's save step (the model's clock, against the run's, up to the first fault).

    python scripts/checkpoint_faults.py docs/results/effective_throughput_*.json [--frozen FROZEN.json]

Last line: ``faults=... lost_saves=... lost_since_max_s=... kept_since_min_s=...``: the faults after at least one
save, those whose save was not loaded, the longest time after a save's commit at which a fault still lost it, and
the shortest at which one found it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import recorded  # noqa: E402
from titan_recover.sim.calibration import calibrate, saves_at_faults, start_figures  # noqa: E402
from titan_recover.sim.model import Costs  # noqa: E402
from titan_recover.sim.policies import checkpoints_at_failures  # noqa: E402
from validate_simulator import rounds_of  # noqa: E402


def model_commit_s(costs: Costs, step: int, interval: int) -> float:
    """When the frozen costs put the commit of ``step`` in a run without an earlier fault: start-up, the steps,
    the blocking part of every save before it (the first one's longer)."""
    saves = (step - 1) // interval
    return (costs.startup_s + step * costs.step_s + saves * costs.checkpoint_save_s
            + (costs.first_save_extra_s if saves else 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="benchmarks/effective_throughput.py JSON outputs")
    parser.add_argument("--frozen", help="frozen costs (scripts/validate_simulator.py --freeze) for the model's clock")
    parser.add_argument("--out", default="-", help="also write what is printed to this file (default: print only)")
    args = parser.parse_args(argv)
    frozen = None
    if args.frozen:
        frozen = Costs(**json.loads(pathlib.Path(args.frozen).read_text())["costs"]["ckpt_restart"])
    with recorded(__file__, argv, args.out):
        tally: dict[str, list] = {"lost": [], "kept": [], "differ": [], **{k: [] for k in FIGURES}}
        for path in args.results:
            data = json.loads(pathlib.Path(path).read_text())
            for index, runs in enumerate(rounds_of(data)):
                print(f"{pathlib.Path(path).stem} round {index}: ", end="")
                report_run(runs["ckpt_restart"], data["setup"], frozen, tally)
        print(headline(tally, frozen is not None))
    return 0


FIGURES = ("second_step", "first_saves", "later_saves", "restart_first_commit")
"""``calibration.start_figures`` of every run, summed up in the last line."""


def report_run(run: dict, setup: dict, frozen: Costs | None, tally: dict[str, list]) -> None:
    """One checkpoint-restart run: its own costs and starts, then every fault against the saves before it (and,
    with ``frozen``, the step the model resumes from with the run's failure times)."""
    interval = setup["checkpoint_interval"]
    own = calibrate(run, interval, setup["cpu_count"])
    starts = start_figures(run, interval)
    later = statistics.median(starts["later_saves"]) if starts["later_saves"] else float("nan")
    to_started = statistics.mean(starts["to_started"]) if starts["to_started"] else float("nan")
    print(f"step {own.step_s:.2f} s, restart {own.job_restart_s:.2f} s ({to_started:.2f} s to training_started), "
          f"write {own.checkpoint_write_s:.2f} s; "
          f"second step {', '.join(f'{d:.2f}' for d in starts['second_step'])} s, steps after a start's first save "
          f"{', '.join(f'{d:.2f}' for d in starts['first_saves'])} s, after later saves {later:.2f} s (median), "
          f"restarts' first commits {', '.join(f'{d:.2f}' for d in starts['restart_first_commit'])} s after "
          "their training_started")
    for key in FIGURES:
        tally[key] += [later] if key == "later_saves" and starts[key] else starts[key]
    faults = sorted(saves_at_faults(run, interval), key=lambda f: f["t"])
    modelled = checkpoints_at_failures(frozen, [f["t"] for f in faults])[0] if frozen is not None else []
    previous = 0
    for number, fault in enumerate(faults):
        model = ""
        if frozen is not None:  # the checkpoints of the start the fault hit, the model's and the run's
            own, previous = (fault["resumed_from"] - previous) // interval, fault["resumed_from"]
            tally["differ"].append(modelled[number] != own)
            model = f"; checkpoints of this start: the model's {modelled[number]}, the run's {own}"
            if number == 0 and fault["save"]:  # its clock, up to the first fault
                model += f", commits step {fault['save']} at {model_commit_s(frozen, fault['save'], interval):.1f} s"
        if fault["since_s"] is None:
            print(f"  fault at {fault['t']:6.1f} s: no save before it; resumed from {fault['resumed_from']:2d}{model}")
            continue
        commit = {s: t for t, s in run["commits"] if t < fault["t"]}[fault["save"]]
        gone = fault["resumed_from"] < fault["save"]
        tally["lost" if gone else "kept"].append(fault["since_s"])
        print(f"  fault at {fault['t']:6.1f} s: step {fault['save']:2d}'s save committed at {commit:6.1f} s, "
              f"{fault['since_s']:5.2f} s before; resumed from {fault['resumed_from']:2d}"
              f"{' (save lost)' if gone else ''}{model}")


def headline(tally: dict[str, list], with_model: bool) -> str:
    def span(key: str) -> str:
        values = tally[key]
        return f"{min(values):.2f}-{max(values):.2f}" if values else "nan"

    lost, kept = tally["lost"], tally["kept"]
    line = (f"faults={len(lost) + len(kept)} lost_saves={len(lost)} "
            f"lost_since_max_s={max(lost, default=float('nan')):.2f} "
            f"kept_since_min_s={min(kept, default=float('nan')):.2f} second_step_s={span('second_step')} "
            f"first_save_step_s={span('first_saves')} later_save_step_median_s={span('later_saves')} "
            f"restart_first_commit_s={span('restart_first_commit')}")
    if with_model:
        line += f" model_checkpoints_differ={sum(tally['differ'])}/{len(tally['differ'])}"
    return line


if __name__ == "__main__":
    sys.exit(main())
