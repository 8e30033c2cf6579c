#!/usr/bin/env python3
"""Quota balance with a straggler: one replica slowed ``--factor`` times by injected delay (chaos fault ``slow``),
step time under the ``even`` and ``throughput`` quota policies.

Both runs train the same global batch (M microbatches a step). Step time is TorchTitan's per-step
``time_metrics/end_to_end(s)`` of replica 0, median over the steps after ``--warmup``. The ideal is what a perfect
balance at the measured speeds would give: all replicas finish their share together, so the compute part of a step
is ``M / sum of speeds`` (speeds = microbatches per compute-second of each replica, measured in the throughput
run), plus the part of the step that is not compute and that no policy changes: the reduction latency of the
last replica to arrive (the smallest ``recover/wait_s`` of the step) and TorchTitan's own work around the
microbatches (step time minus replica 0's compute and wait).

    python benchmarks/quota_balance.py [--flavor debugmodel] [--replicas 3] [--factor 2] [--steps 16]

Last line: ``even_s=... throughput_s=... ideal_s=...``. Target: throughput_s within 15% of ideal_s.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import subprocess
import sys
import tempfile

from report import add_out_argument, recorded

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from titan_recover.recover.events import read_jsonl  # noqa: E402
STEP_TIME = "time_metrics/end_to_end(s)"


def run(policy: str, args, folder: str) -> dict[int, dict[int, dict]]:
    slow = args.replicas - 1
    fault = f'[{{kind = "slow", factor = {args.factor}, replica = {slow}, rank = 0, step = 1, phase = "forward"}}]'
    cmd = [sys.executable, "-m", "titan_recover.launch", "train_configs/replicas.toml",
           "--model.flavor", args.flavor, "--training.steps", str(args.steps), "--metrics.no_enable_wandb",
           "--recover.replicas", str(args.replicas), "--parallelism.data_parallel_shard_degree", "1",
           "--training.global_batch_size", str(args.local_batch * args.accumulation),
           "--training.local_batch_size", str(args.local_batch),
           "--recover.quota.policy", policy, "--dump_folder", folder, "--chaos.faults", fault]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{policy} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    by_replica: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    for record in read_jsonl(pathlib.Path(folder) / "metrics.jsonl"):
        by_replica[record["replica"]][record["step"]] = record
    return by_replica


def steady(args) -> range:
    return range(args.warmup + 1, args.steps + 1)


def step_time(metrics, args) -> float:
    return statistics.median(metrics[0][s][STEP_TIME] for s in steady(args))


def ideal_step_time(metrics, args) -> tuple[float, dict[int, float]]:
    replicas = sorted(metrics)
    ideals, speeds = [], collections.defaultdict(list)
    for s in steady(args):
        rows = {r: metrics[r][s] for r in replicas}
        per_step = rows[0]["recover/microbatches"]
        rate = {r: row["recover/computed_here"] / row["recover/compute_s"] for r, row in rows.items()
                if row["recover/computed_here"] and row["recover/compute_s"] > 0}
        for r, v in rate.items():
            speeds[r].append(v)
        latency = min(row["recover/wait_s"] for row in rows.values())
        around = rows[0][STEP_TIME] - rows[0]["recover/compute_s"] - rows[0]["recover/wait_s"]
        ideals.append(per_step / sum(rate.values()) + latency + around)
    return statistics.median(ideals), {r: statistics.median(v) for r, v in speeds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--local-batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=4, help="microbatches per replica per step (M / R)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    with tempfile.TemporaryDirectory() as tmp:
        even = run("even", args, f"{tmp}/even")
        throughput = run("throughput", args, f"{tmp}/throughput")
    even_s, throughput_s = step_time(even, args), step_time(throughput, args)
    ideal_s, speeds = ideal_step_time(throughput, args)
    last = args.steps
    quotas = {r: throughput[0][last][f"recover/quota/{r}"] for r in range(args.replicas)}
    print(f"{args.replicas} replicas, replica {args.replicas - 1} slowed {args.factor}x, "
          f"M = {args.replicas * args.accumulation}: measured speeds (microbatches/s) "
          + ", ".join(f"{r}: {v:.2f}" for r, v in sorted(speeds.items()))
          + f"; throughput quotas at step {last}: {quotas}")
    print(f"step time: even {even_s:.3f} s, throughput {throughput_s:.3f} s, ideal {ideal_s:.3f} s "
          f"(throughput / ideal = {throughput_s / ideal_s:.3f})")
    print(f"even_s={even_s:.4f} throughput_s={throughput_s:.4f} ideal_s={ideal_s:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
