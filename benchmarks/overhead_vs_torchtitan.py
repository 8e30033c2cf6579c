#!/usr/bin/env python3
"""Step-time overhead of the project over stock TorchTitan, same config, measured side by side.

Runs the same TOML (default: train_configs/debug_model.toml, llama3 debugmodel, FSDP2 over 2 CPU processes)
alternately through ``./run_train.sh``'s launcher and through stock ``torchtitan.train`` (only the CPU fixes
applied: benchmarks/stock_torchtitan.py), ``--rounds`` times each. A step's time is the gap between consecutive
``step:`` log lines (same clock and method for both); the first ``--warmup`` steps of every run are dropped.
Both runs also must compute the same losses (same data, init and seed): the largest difference is printed.

    python benchmarks/overhead_vs_torchtitan.py [--rounds 3] [--steps 20] [--config train_configs/debug_model.toml]

Last line: ``ratio=<median project step / median stock step> ...``. Target: ratio <= 1.03.
"""

from __future__ import annotations

import argparse
import json
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


def run(kind: str, config: str, steps: int, folder: str, timeout: float) -> list:
    overrides = ["--training.steps", str(steps), "--metrics.no_enable_wandb", "--dump_folder", folder]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if kind == "project":
        cmd = [sys.executable, "-m", "titan_recover.launch", config, *overrides]
    else:
        from titan_recover.config.loader import read_toml

        nproc = _nproc(read_toml(config))
        env.update(STOCK_TOML=config, STOCK_OVERRIDES=json.dumps(overrides))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--local-ranks-filter=0", str(ROOT / "benchmarks" / "stock_torchtitan.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    logged = parse_console_steps(proc.stdout + proc.stderr)
    if [s.step for s in logged] != list(range(1, steps + 1)):
        raise RuntimeError(f"{kind} run logged steps {[s.step for s in logged]}")
    return logged


def _nproc(raw: dict) -> int:
    p = raw.get("parallelism", {})
    n = 1
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                "pipeline_parallel_degree", "context_parallel_degree"):
        n *= max(1, int(p.get(key, 1)))
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/debug_model.toml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup + 1")
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    times: dict[str, list[float]] = {"project": [], "stock": []}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in ("project", "stock") if r % 2 == 0 else ("stock", "project"):
                logged = run(kind, args.config, args.steps, f"{tmp}/{kind}{r}", args.timeout)
                gaps = [b.time - a.time for a, b in zip(logged, logged[1:])][args.warmup:]
                times[kind] += gaps
                losses.setdefault(kind, [s.loss for s in logged])
                print(f"round {r} {kind:7s}: median step {statistics.median(gaps):.3f} s over {len(gaps)} steps",
                      flush=True)
    project, stock = statistics.median(times["project"]), statistics.median(times["stock"])
    loss_diff = max(abs(a - b) for a, b in zip(losses["project"], losses["stock"]))
    print(f"project median step {project:.4f} s, stock TorchTitan {stock:.4f} s "
          f"({len(times['project'])} / {len(times['stock'])} steps); largest loss difference {loss_diff:.1e}")
    print(f"ratio={project / stock:.4f} project_step_s={project:.4f} stock_step_s={stock:.4f} "
          f"loss_max_abs_diff={loss_diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
