#!/usr/bin/env python3
"""Lay two or more runs' loss curves over each other (PNG) and print each run's largest per-step difference
from the first (the reference). A run's resilience events (its ``events.jsonl``) are vertical marks at their steps.

    python scripts/compare_runs.py outputs/reference outputs/with_failures --out compare.png

The last line is a summary: ``max_abs_diff=... max_rel_diff=... common_steps=...`` (the worst run).
``--parameters`` also compares the runs' final parameters bitwise (runs made with
``--recover.save_final_parameters``) and adds ``parameters_different=... parameters_max_abs_diff=...`` to it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from titan_recover.compare import difference, event_marks, load_curve, LOSS, parameter_difference, plot  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (dump_folder) or metrics.jsonl files; first = reference")
    parser.add_argument("--labels", help="comma-separated names for the runs (default: folder names)")
    parser.add_argument("--metric", default=LOSS, help="metric to compare (default: %(default)s)")
    parser.add_argument("--out", default="compare_runs.png", help="PNG to write (default: %(default)s)")
    parser.add_argument("--parameters", action="store_true",
                        help="also compare the runs' final parameters bitwise (final_parameters/*.pt)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two runs")
    labels = args.labels.split(",") if args.labels else [pathlib.Path(r).name or r for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(labels)} labels for {len(args.runs)} runs")
    curves = {label: load_curve(run, args.metric) for label, run in zip(labels, args.runs)}
    reference = curves[labels[0]]
    diffs = [difference(reference, curves[label], label) for label in labels[1:]]
    for d in diffs:
        print(f"{d.run}: {d.common_steps} common steps, largest |diff| {d.max_abs:.3e} at step {d.worst_step} "
              f"(relative {d.max_rel:.3e})")
    marks = {label: event_marks(run) for label, run in zip(labels, args.runs)}
    for label, by_step in marks.items():
        if by_step:
            print(f"{label}: resilience events at step(s) {', '.join(map(str, by_step))} (vertical marks)")
    plot(curves, args.out, args.metric, marks)
    print(f"plot: {args.out}")
    worst = max(diffs, key=lambda d: d.max_abs)
    summary = f"max_abs_diff={worst.max_abs:.6e} max_rel_diff={worst.max_rel:.6e} common_steps={worst.common_steps}"
    if args.parameters:
        params = [parameter_difference(args.runs[0], run, label) for label, run in zip(labels[1:], args.runs[1:])]
        for p in params:
            print(f"{p.run}: final parameters of {p.files} rank(s), {p.tensors} tensors, {p.different} not bitwise "
                  f"equal (largest |diff| {p.max_abs:.3e})")
        summary += (f" parameters_different={sum(p.different for p in params)}"
                    f" parameters_max_abs_diff={max(p.max_abs for p in params):.6e}")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
