#!/usr/bin/env python3
"""Rejoin from peers' memory (docs/phoenix.md): state-transfer throughput, and how long after a replica is killed
the job trains at full strength again, with a warm spare and with a restart.

    transfer_ratio           raw gloo broadcast time / state-transfer time of the same bytes, two processes over
                             loopback (benchmarks/state_transfer.py, run here as a subprocess: 2.3 GiB of state,
                             ``--rounds`` interleaved rounds, the median of the rounds' ratios;
                             ``transfer_ratio_min`` / ``_max`` their spread)
    unverified_ratio         the same against the transfer without its digests (what the xxHash3 of every chunk
                             costs on this host)
    spare_full_strength_s    3 replicas + 1 spare, replica 1 killed in step ``--kill-step``: fault injected ->
                             first commit of a step in which 3 replicas held quota again (event ``full_strength``)
    restart_full_strength_s  3 replicas, ``max_restarts = 1``, the same kill, no rejoin wait (the others train on):
                             fault injected -> the restarted replica started, was admitted at a commit, received
                             the state, and the first step with 3 replicas holding quota committed

Both jobs use the ``--flavor`` model (tiny) with 1 process per replica; the restart time includes starting Python,
importing torch and TorchTitan and building the model on this machine while the other replicas train.

    python benchmarks/rejoin.py [--flavor tiny] [--steps 150] [--rounds 11] [--out FILE]

Last line: ``transfer_ratio=... transfer_ratio_min=... transfer_ratio_max=... unverified_ratio=...
spare_full_strength_s=... restart_full_strength_s=...``. Target: transfer_ratio >= 0.8. Output also written to docs/results/rejoin.txt
(benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import NO_FILE, add_out_argument, recorded  # noqa: E402
from titan_recover.recover.events import read_events  # noqa: E402


def headline(output: str) -> dict[str, float]:
    last = output.strip().splitlines()[-1]
    return {k: float(v) for k, v in (pair.split("=") for pair in last.split())}


def time_to_full_strength(args, folder: str, extra: list[str]) -> tuple[float, list[dict]]:
    fault = f'[{{kind = "kill", replica = 1, rank = 0, step = {args.kill_step}, phase = "forward"}}]'
    cmd = [sys.executable, "-m", "titan_recover.launch", "train_configs/replicas.toml", "--model.flavor", args.flavor,
           "--recover.replicas", "3", "--parallelism.data_parallel_shard_degree", "1",
           "--training.steps", str(args.steps), "--metrics.no_enable_wandb", "--dump_folder", folder,
           "--chaos.faults", fault, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    events = read_events(pathlib.Path(folder) / "events.jsonl")
    injected = next(e["time"] for e in events if e["event"] == "fault_injected")
    full = [e for e in events if e["event"] == "full_strength" and e["source"] == "0/0"]
    if not full:
        raise RuntimeError(f"never back to full strength within {args.steps} steps (raise --steps)")
    return full[0]["time"] - injected, events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-step", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=11, help="rounds of the state-transfer measurement")
    parser.add_argument("--timeout", type=float, default=900)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    if args.rounds < 5:
        raise ValueError(f"--rounds must be at least 5 (a ratio needs a spread to be read), got {args.rounds}")
    with recorded(__file__, argv, args.out):
        measure(args)
    return 0


def measure(args) -> None:
    """The state-transfer benchmark, then the two jobs; prints their lines and the headline."""
    transfer = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "state_transfer.py"), "--rounds",
                               str(args.rounds), "--out", NO_FILE], cwd=ROOT, capture_output=True, text=True,
                              timeout=args.timeout)
    if transfer.returncode != 0:
        raise RuntimeError(f"state-transfer benchmark failed:\n{transfer.stderr[-3000:]}")
    print(transfer.stdout.strip(), flush=True)
    moved = headline(transfer.stdout)

    with tempfile.TemporaryDirectory() as tmp:
        spare_s, _ = time_to_full_strength(args, f"{tmp}/spare", ["--recover.spares", "1"])
        restart_s, events = time_to_full_strength(args, f"{tmp}/restart", ["--recover.max_restarts", "1"])
    injected = next(e["time"] for e in events if e["event"] == "fault_injected")
    milestones = [("restarted group asked to join", "join_requested"), ("admitted", "replica_admitted"),
                  ("state received", "state_transferred")]
    parts = []
    for label, name in milestones:
        found = [e["time"] for e in events if e["event"] == name]
        if found:
            parts.append(f"{label} +{min(found) - injected:.2f} s")
    transferred = [e for e in events if e["event"] == "state_transferred" and e["role"] == "joiner"]
    if transferred:
        t = transferred[0]
        parts.append(f"{t['bytes'] / 2**20:.1f} MB in {t['seconds']:.3f} s ({t['mb_per_s']:.0f} MB/s)")
    print(f"spare: full strength {spare_s:.3f} s after the kill; restart: {restart_s:.3f} s (" + ", ".join(parts) + ")")
    print(f"transfer_ratio={moved['transfer_ratio']:.3f} transfer_ratio_min={moved['transfer_ratio_min']:.3f} "
          f"transfer_ratio_max={moved['transfer_ratio_max']:.3f} unverified_ratio={moved['unverified_ratio']:.3f} "
          f"spare_full_strength_s={spare_s:.3f} "
          f"restart_full_strength_s={restart_s:.3f}")


if __name__ == "__main__":
    sys.exit(main())
