#!/usr/bin/env python3
"""One benchmark run in two checkouts of the project, alternately, to tell a change's effect from noise.

Each round runs the benchmark script once in ``--before`` and once in ``--after`` (the order alternates between
rounds, so a machine that slows down over time favours neither), reads the ``key=value`` headline (its last line)
of each run, and prints every round, then the median and range of every key on both sides. A run that printed
``nan`` for a key (it did not measure it) is left out of that key's median and range, and the cell says how many
runs measured it.

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before --after . --rounds 3 -- \\
        benchmarks/failure_free_overhead.py --rounds 1
    python benchmarks/before_after.py --summarise docs/results/before_after_X.txt --out FILE

``--summarise`` runs nothing: it prints an earlier output's header and rounds again, then their summary as this
script makes it now (for files written before it summarised runs that did not measure a key). ``--keep DIR``
writes every run's whole output to ``DIR/round<r>_<side>.txt``.

Both checkouts run with this interpreter. Last line: ``<key>_before=<median> <key>_after=<median> ...`` and
``rounds=N``, with ``<key>_<side>_measured=<runs>`` after a key some run of that side did not measure. Output also
written to ``docs/results/before_after_<benchmark>.txt`` (``--out`` to change; benchmarks/report.py); the runs it
makes write their own results files into a temporary folder, not into either checkout's docs/results/.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import statistics
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


def summary(values: list[float]) -> tuple[float, float, float, int]:
    """(median, min, max, runs that measured it) of one key on one side, over the runs that measured it (``nan``:
    not measured); all ``nan`` when none did."""
    measured = [v for v in values if not math.isnan(v)]
    if not measured:
        return math.nan, math.nan, math.nan, 0
    return statistics.median(measured), min(measured), max(measured), len(measured)


def cell(values: list[float]) -> str:
    """``median [min, max]``, with ``(k of n runs)`` where only k of the n runs measured the key."""
    median, low, high, measured = summary(values)
    text = f"{median:.4g} [{low:.4g}, {high:.4g}]" if measured else "nan"
    return text + (f" ({measured} of {len(values)} runs)" if measured < len(values) else "")


def run(tree: pathlib.Path, script: list[str], timeout: float, keep: pathlib.Path | None = None) -> dict[str, float]:
    """One run of the benchmark in ``tree``: its headline. ``keep``: also write its whole stdout there (what a
    headline leaves out, e.g. why a key was not measured)."""
    with tempfile.TemporaryDirectory() as results:  # the run's own results file lands here, not in the checkout
        proc = subprocess.run([sys.executable, *script], cwd=tree, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **{RESULTS_ENV: results}))
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{script[0]} failed in {tree} (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    return headline(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=pathlib.Path, help="checkout without the change")
    parser.add_argument("--after", type=pathlib.Path, help="checkout with the change")
    parser.add_argument("--summarise", type=pathlib.Path, help="an earlier output: summarise its rounds again")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one benchmark run may take")
    parser.add_argument("--keep", type=pathlib.Path,
                        help="a folder for every run's whole output (round<r>_<side>.txt), not only its headline")
    add_out_argument(parser, "before_after_<benchmark>")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- benchmark script and its arguments")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if args.summarise:
        with recorded(__file__, argv, args.out or str(args.summarise)):
            return resummarise(args.summarise)
    if args.before is None or args.after is None:
        parser.error("give --before and --after (or --summarise an earlier output)")
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
            keep = args.keep / f"round{r}_{side}.txt" if args.keep else None
            values = run(getattr(args, side), script, args.timeout, keep)
            results[side].append(values)
            print(f"round {r} {side:6s} " + " ".join(f"{k}={v:g}" for k, v in values.items()), flush=True)
    print_summary(results, args.rounds)
    return 0


def resummarise(path: pathlib.Path) -> int:
    """Print an earlier output's header and round lines, then their summary."""
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    rounds = set()
    for line in path.read_text().splitlines():
        if line.startswith("$ "):
            print(f"# summarising: {line}")
        elif line.startswith("round "):
            print(line)
            _, r, side, *pairs = line.split()
            rounds.add(r)
            results[side].append({k: float(v) for k, v in (pair.split("=", 1) for pair in pairs)})
    if not results["before"] or not results["after"]:
        raise ValueError(f"{path} holds no round lines of both sides")
    print_summary(results, len(rounds))
    return 0


def print_summary(results: dict[str, list[dict[str, float]]], rounds: int) -> None:
    """Every key's median and range on both sides (over the runs that measured it), then the headline."""
    keys = [k for k in results["before"][0] if all(k in v for side in results.values() for v in side)]
    print(f"\n{'key':28s} {'before median [min, max]':40s} {'after median [min, max]':40s}")
    pairs = []
    for key in keys:
        sides = {side: [v[key] for v in results[side]] for side in ("before", "after")}
        print(f"{key:28s} {cell(sides['before']):40s} {cell(sides['after']):40s}".rstrip())
        for side, values in sides.items():
            median, _, _, measured = summary(values)
            pairs.append(f"{key}_{side}={median:.4g}")
            if measured < len(values):
                pairs.append(f"{key}_{side}_measured={measured}")
    print(" ".join(pairs) + f" rounds={rounds}")


if __name__ == "__main__":
    sys.exit(main())
