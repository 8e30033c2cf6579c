#!/usr/bin/env python3
"""Trajectory fidelity under failures: how far do in-step recovery, exact mode and torchft-style dropping move the
loss curve away from the failure-free run?

One seeded failure schedule (``--replicas`` replica groups, ``--lost`` of them SIGKILLed at distinct steps and
phases) is run four ways: failure-free reference; ``recover`` (quota policy ``even``: survivors take over the lost
microbatches in the same step); ``drop`` (the batch shrinks and the failed steps are discarded); and exact mode
(float64 accumulation) with and without the failures. Deviation = the largest relative difference of the logged
loss from its failure-free counterpart over all steps (exact mode against the exact failure-free run; 0 means
every step's loss is bitwise equal). Exact mode's step-time overhead is the median step time of an exact
failure-free run over a plain one's (first ``--warmup`` steps dropped), in ``--rounds`` interleaved pairs (the
fidelity runs' two failure-free runs are the first pair; later pairs alternate which mode runs first): the median
ratio and its spread. The overlay of the four
loss curves is written to ``--plot``; every run's per-step losses, the exact failure-free reference among them
(``"exact (failure-free)"``, the curve exact mode's failure runs must equal bitwise), to the ``.json`` beside it.

    python benchmarks/trajectory_fidelity.py [--flavor debugmodel] [--steps 20] [--seed 0]

Last line: ``recover_dev=... exact_dev=... drop_dev=... exact_overhead_ratio=... exact_overhead_spread=...``.
Targets: recover_dev <= 1e-5 and >= 100x smaller than drop_dev; exact_dev = 0.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.compare import difference, load_curve, LOSS, plot  # noqa: E402

STEP_TIME = "time_metrics/end_to_end(s)"
PHASES = ("forward", "backward", "reduction", "commit", "optimizer")


def schedule(args) -> list[dict]:
    """``--lost`` distinct replicas (never replica 0, whose curve is read), distinct steps, seeded phases."""
    rng = random.Random(args.seed)
    victims = rng.sample(range(1, args.replicas), args.lost)
    steps = sorted(rng.sample(range(2, args.steps - 1), args.lost))
    return [{"kind": "kill", "replica": v, "rank": 0, "step": s, "phase": rng.choice(PHASES)}
            for v, s in zip(victims, steps)]


def run(name: str, args, folder: str, faults: list[dict], extra: list[str]) -> tuple[dict[int, float], list[float]]:
    fault_toml = "[" + ", ".join("{" + ", ".join(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}"
                                                 for k, v in f.items()) + "}" for f in faults) + "]"
    cmd = [sys.executable, "-m", "titan_recover.launch", "train_configs/replicas.toml",
           "--model.flavor", args.flavor, "--training.steps", str(args.steps), "--metrics.no_enable_wandb",
           "--recover.replicas", str(args.replicas), "--parallelism.data_parallel_shard_degree", "1",
           "--recover.heartbeat_timeout_s", "2.0", "--recover.join_window_s", "0.3",
           "--dump_folder", folder, "--chaos.faults", fault_toml, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    losses = load_curve(folder, LOSS, replica=0)
    times = load_curve(folder, STEP_TIME, replica=0)
    if sorted(losses) != list(range(1, args.steps + 1)):
        raise RuntimeError(f"{name} run logged steps {sorted(losses)}")
    median_s = statistics.median(list(times.values())[args.warmup:])
    print(f"{name:13s} final loss {losses[args.steps]:.6f}, median step {median_s:.3f} s", flush=True)
    return losses, [times[s] for s in sorted(times)][args.warmup:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--lost", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved pairs of failure-free plain and exact runs")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "results" / "trajectory_fidelity.png"))
    parser.add_argument("--timeout", type=float, default=900)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    if not 1 <= args.lost < args.replicas or args.steps < args.lost + 3 or args.rounds < 1:
        parser.error("need 1 <= --lost < --replicas, --steps >= --lost + 3 and --rounds >= 1")
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    faults = schedule(args)
    print("failure schedule: " + ", ".join(f"replica {f['replica']} at step {f['step']} ({f['phase']})"
                                           for f in faults))
    exact = ["--recover.quota.exact"]
    with tempfile.TemporaryDirectory() as tmp:
        reference, ref_times = run("reference", args, f"{tmp}/reference", [], [])
        recover, _ = run("recover", args, f"{tmp}/recover", faults, [])
        drop, _ = run("drop", args, f"{tmp}/drop", faults, ["--recover.quota.policy", "drop"])
        exact_reference, exact_times = run("exact (no fault)", args, f"{tmp}/exact_reference", [], exact)
        exact_failures, _ = run("exact", args, f"{tmp}/exact", faults, exact)

    recover_dev = difference(reference, recover).max_rel
    drop_dev = difference(reference, drop).max_rel
    exact_dev = difference(exact_reference, exact_failures).max_rel
    ratios = [statistics.median(exact_times) / statistics.median(ref_times)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(1, args.rounds):
            pair = {}
            for mode in (("plain", "exact") if r % 2 == 0 else ("exact", "plain")):
                extra = exact if mode == "exact" else []
                pair[mode] = run(f"{mode} round {r + 1}", args, f"{tmp}/{mode}{r}", [], extra)[1]
            ratios.append(statistics.median(pair["exact"]) / statistics.median(pair["plain"]))
    print("exact / plain median step time per round: " + ", ".join(f"{x:.3f}" for x in ratios))
    overhead, spread = statistics.median(ratios), max(ratios) - min(ratios)
    pathlib.Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    curves = {"failure-free": reference, "recover (in-step recovery)": recover, "exact": exact_failures,
              "drop (torchft semantics)": drop}
    plot(curves, args.plot)
    data = pathlib.Path(args.plot).with_suffix(".json")
    data.write_text(json.dumps({"schedule": faults, "curves": {**curves, "exact (failure-free)": exact_reference}},
                               indent=1) + "\n")
    print(f"plot: {args.plot} (curves: {data})")
    print(f"{args.replicas} replicas, {args.lost} lost, {args.flavor}, {args.steps} steps: largest relative loss "
          f"deviation from the failure-free run: recover {recover_dev:.2e}, exact {exact_dev:.2e}, drop {drop_dev:.2e}"
          f" ({drop_dev / max(recover_dev, 1e-30):.0f}x recover's)")
    print(f"recover_dev={recover_dev:.3e} exact_dev={exact_dev:.3e} drop_dev={drop_dev:.3e} "
          f"exact_overhead_ratio={overhead:.4f} exact_overhead_spread={spread:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
