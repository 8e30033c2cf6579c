#!/usr/bin/env python3
"""One benchmark run in two checkouts of the project, alternately, to tell a change's effect from noise.

Each round runs the benchmark script once in ``--before`` and once in ``--after`` (the order alternates between
rounds, so a machine that slows down over time favours neither), reads the ``key=value`` headline (its last line)
of each run, and prints every round, then the median and range of every key on both sides.

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before --after . --rounds 3 -- \\
        benchmarks/failure_free_overhead.py --rounds 1

Both checkouts run with this interpreter. Last line: ``<key>_before=<median> <key>_after=<median> ...`` and
``rounds=N``. Output also written to ``docs/results/before_after_<benchmark>.txt`` (``--out`` to change;
benchmarks/report.py); the runs it makes write their own results files into a temporary folder, not into either
checkout's docs/results/.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import os
import subprocess
import sys
import tempfile

from report import RESULTS_ENV, add_out_argument, default_path, recorded


def headline(output: str) -> dict[str, float]:
    """The ``key=value`` pairs of the last line that has any (values that are not numbers are skipped)."""
    for line in reversed(output.strip().splitlines()):
        pairs = [part.split("=", 1) for part in line.split() if "=" in part]
        if pairs:
            values = {}
            for key, value in pairs:
                try:
                    values[key] = float(value)
                except ValueError:
                    continue
            return values
    raise ValueError("the benchmark printed no key=value headline")


def run(tree: pathlib.Path, script: list[str], timeout: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as results:  # the run's own results file lands here, not in the checkout
        proc = subprocess.run([sys.executable, *script], cwd=tree, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **{RESULTS_ENV: results}))
    if proc.returncode != 0:
        raise RuntimeError(f"{script[0]} failed in {tree} (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    return headline(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=pathlib.Path, help="checkout without the change")
    parser.add_argument("--after", required=True, type=pathlib.Path, help="checkout with the change")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one benchmark run may take")
    add_out_argument(parser, "before_after_<benchmark>")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- benchmark script and its arguments")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the benchmark after --, e.g. -- benchmarks/recovery_latency.py")
    out = args.out or str(default_path(f"before_after_{pathlib.Path(script[0]).stem}"))
    with recorded(__file__, argv, out):
        return compare(args, script)


def compare(args, script: list[str]) -> int:
    """Run the rounds; print each round's headline, then every key's median and range on both sides."""
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for side in order:
            values = run(getattr(args, side), script, args.timeout)
            results[side].append(values)
            print(f"round {r} {side:6s} " + " ".join(f"{k}={v:g}" for k, v in values.items()), flush=True)
    keys = [k for k in results["before"][0] if all(k in v for side in results.values() for v in side)]
    print(f"\n{'key':28s} {'before median [min, max]':32s} {'after median [min, max]':32s}")
    summary = []
    for key in keys:
        cells = []
        for side in ("before", "after"):
            values = [v[key] for v in results[side]]
            cells.append(f"{statistics.median(values):.4g} [{min(values):.4g}, {max(values):.4g}]")
            summary.append(f"{key}_{side}={statistics.median(values):.4g}")
        print(f"{key:28s} {cells[0]:32s} {cells[1]:32s}")
    print(" ".join(summary) + f" rounds={args.rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
