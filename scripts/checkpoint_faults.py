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
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import recorded  # noqa: E402
from titan_recover.sim.calibration import calibrate, saves_at_faults  # noqa: E402
from titan_recover.sim.model import Costs  # noqa: E402
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
        lost, kept = [], []
        for path in args.results:
            data = json.loads(pathlib.Path(path).read_text())
            interval = data["setup"]["checkpoint_interval"]
            for index, runs in enumerate(rounds_of(data)):
                run = runs["ckpt_restart"]
                own = calibrate(run, interval, data["setup"]["cpu_count"])
                print(f"{pathlib.Path(path).stem} round {index}: step {own.step_s:.2f} s, restart "
                      f"{own.job_restart_s:.2f} s, write {own.checkpoint_write_s:.2f} s")
                for number, fault in enumerate(saves_at_faults(run, interval)):
                    if fault["since_s"] is None:
                        continue
                    commit = {s: t for t, s in run["commits"] if t < fault["t"]}[fault["save"]]
                    gone = fault["resumed_from"] < fault["save"]
                    (lost if gone else kept).append(fault["since_s"])
                    model = (f"; the model's commit {model_commit_s(frozen, fault['save'], interval):.1f} s"
                             if frozen is not None and number == 0 else "")  # its clock, up to the first fault
                    print(f"  fault at {fault['t']:6.1f} s: step {fault['save']:2d}'s save committed at "
                          f"{commit:6.1f} s, "
                          f"{fault['since_s']:5.2f} s before; resumed from {fault['resumed_from']:2d}"
                          f"{' (save lost)' if gone else ''}{model}")
        print(f"faults={len(lost) + len(kept)} lost_saves={len(lost)} "
              f"lost_since_max_s={max(lost, default=float('nan')):.2f} "
              f"kept_since_min_s={min(kept, default=float('nan')):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
