#!/usr/bin/env python3
"""Failure-free cost of in-memory snapshots (docs/phoenix.md "Buddy snapshots"): the same job without replicas with
a snapshot of every rank's state to the keeper after every step (``--interval``), against none, measured side by side.

Runs ``--config`` (default: train_configs/debug_model.toml, llama3 debugmodel, FSDP2 over 2 CPU processes) through
the launcher alternately with ``--recover.snapshot.interval 1`` and without, ``--rounds`` times each. A step's time is
the gap between consecutive ``step:`` log lines; the first ``--warmup`` steps of every run are dropped. Both runs
must log the same losses (a snapshot must not change training).

    python benchmarks/snapshot_overhead.py [--rounds 3] [--steps 20] [--interval 1]

Last line: ``ratio=<median step with snapshots / median step without> ...``. Target: ratio <= 1.03.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.compare import parse_console_steps  # noqa: E402
from titan_recover.recover.events import read_events  # noqa: E402


def run(snapshots: bool, args, folder: str):
    cmd = [sys.executable, "-m", "titan_recover.launch", args.config, "--training.steps", str(args.steps),
           "--metrics.no_enable_wandb", "--dump_folder", folder]
    if snapshots:
        cmd += ["--recover.snapshot.interval", str(args.interval), "--recover.max_restarts", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    logged = parse_console_steps(proc.stdout + proc.stderr)
    if [s.step for s in logged] != list(range(1, args.steps + 1)):
        raise RuntimeError(f"the run logged steps {[s.step for s in logged]}")
    events = read_events(pathlib.Path(folder) / "events.jsonl") if snapshots else []
    return logged, events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/debug_model.toml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--interval", type=int, default=1, help="snapshot every this many steps")
    parser.add_argument("--timeout", type=float, default=600)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup + 1")
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {}
    stored, skipped, copy_s, blocked_s, state_bytes = 0, 0, [], 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for snapshots in (True, False) if r % 2 == 0 else (False, True):
                logged, events = run(snapshots, args, f"{tmp}/{int(snapshots)}{r}")
                gaps = [b.time - a.time for a, b in zip(logged, logged[1:])][args.warmup:]
                times[snapshots] += gaps
                losses.setdefault(snapshots, [s.loss for s in logged])
                for e in events:
                    if e["event"] == "snapshot_stored":
                        stored += 1
                        copy_s.append(e["copy_s"])
                        blocked_s = max(blocked_s, e["blocked_s"])
                        state_bytes = e["bytes"]
                    skipped += e["event"] == "snapshot_skipped"
                print(f"round {r} snapshots={f'every {args.interval}' if snapshots else 'none':10s}: median step "
                      f"{statistics.median(gaps):.3f} s over {len(gaps)} steps", flush=True)
    with_s, without_s = statistics.median(times[True]), statistics.median(times[False])
    if losses[True] != losses[False]:
        raise RuntimeError(f"snapshots changed the losses: {losses[True]} vs {losses[False]}")
    print(f"with snapshots {with_s:.4f} s per step, without {without_s:.4f} s; rank 0 stored {stored} snapshots of "
          f"{state_bytes / 2**20:.1f} MB (copied by the snapshot thread in a median {statistics.median(copy_s) * 1e3:.1f} "
          f"ms; optimizer steps waited for a copy {blocked_s:.3f} s in the longest run), {skipped} skipped (previous "
          "one still being sent); losses identical")
    print(f"ratio={with_s / without_s:.4f} with_snapshots_step_s={with_s:.4f} without_step_s={without_s:.4f} "
          f"skipped={skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
