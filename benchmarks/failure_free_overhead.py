#!/usr/bin/env python3
"""Failure-free cost of fault-tolerant replica groups against TorchTitan's native HSDP, same degrees.

Runs, alternately and ``--rounds`` times each: ``train_configs/replicas.toml`` (R replica groups x FSDP2 inside,
the gradient reduction across replicas over the fault-tolerant group, a coordinator) and
``train_configs/hsdp.toml`` (TorchTitan's HSDP with ``data_parallel_replicate_degree = R``, same shard degree,
same global batch). Step time is TorchTitan's per-step ``time_metrics/end_to_end(s)`` from ``metrics.jsonl``
(replica 0's lines for the replica run); the first ``--warmup`` steps of each run are dropped. Both runs train on
the same data from the same initialisation, so their losses are also compared.

    python benchmarks/failure_free_overhead.py [--rounds 2] [--steps 20] [--flavor debugmodel] [--seq-len 256]
        [--local-batch 2] [--abort-recovery recompute[,backup]] [--overlap off[,on]]

The defaults are the CPU platform's (docs/platform.md): ``recompute``, not overlapped.

``--abort-recovery``: the replica run's ``[recover.step] abort_recovery`` values, each a run of its own in every
round (docs/invariant.md, "After an aborted reduction"); ``--overlap``: each of them runs with ``[recover.step]
overlap_reduction = true`` (``on``: the reduction issued during the last microbatch's backward, the default on GPUs)
and / or ``false`` (``off``: after it, the default on CPU; docs/invariant.md, "Overlapping"). The rounds rotate the
order of the runs.

``reduction_share`` is the median share of a step the replica run spends in the committed reduction and its
commit barrier after its last microbatch (``recover/wait_s`` over the step time, replica 0): small batches make it
large. With overlap this is only the part the backward did not hide; the ``off`` runs give the whole of it.

Last line: ``ratio=<FTPG / native median step time> ...`` for the first ``--abort-recovery`` value (with the
first ``--overlap`` value), with ``ratio_round_median``, ``_min`` and ``_max`` of its ratios paired by round (each
round's median step over native's of the same round), then ``ratio_<value>=`` for the others (``<value>_after``
without overlap). Target: ratio <= 1.05 on CPU.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.compare import load_curve, LOSS  # noqa: E402

STEP_TIME = "time_metrics/end_to_end(s)"
REDUCTION = "recover/wait_s"
SHARES: dict[str, list[float]] = {}


def run(kind: str, args, folder: str) -> tuple[list[float], dict[int, float]]:
    """One run: ``native``, or ``ftpg-<abort_recovery>[-after]``."""
    common = ["--model.flavor", args.flavor, "--training.steps", str(args.steps), "--metrics.no_enable_wandb",
              "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.local_batch),
              "--parallelism.data_parallel_shard_degree", str(args.shards), "--dump_folder", folder]
    if kind != "native":
        value, _, after = kind.removeprefix("ftpg-").partition("-")
        cmd = ["train_configs/replicas.toml", "--recover.replicas", str(args.replicas),
               "--recover.step.abort_recovery", value, *common]
        cmd.append("--recover.step.no_overlap_reduction" if after else "--recover.step.overlap_reduction")
    else:
        cmd = ["train_configs/hsdp.toml", "--parallelism.data_parallel_replicate_degree", str(args.replicas), *common]
    proc = subprocess.run([sys.executable, "-m", "titan_recover.launch", *cmd], cwd=ROOT, capture_output=True,
                          text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    replica = None if kind == "native" else 0
    times = load_curve(folder, STEP_TIME, replica=replica)
    losses = load_curve(folder, LOSS, replica=replica)
    if sorted(times) != list(range(1, args.steps + 1)):
        raise RuntimeError(f"{kind} run logged steps {sorted(times)}")
    if kind != "native":  # the share of the step spent in the cross-replica reduction (and its commit)
        waits = load_curve(folder, REDUCTION, replica=0)
        shares = [waits[s] / times[s] for s in sorted(times)][args.warmup:]
        print(f"  reduction share of the step: median {statistics.median(shares):.3f}", flush=True)
        SHARES.setdefault(kind, []).extend(shares)
    return [times[s] for s in sorted(times)][args.warmup:], losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--local-batch", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--abort-recovery", default="recompute",
                        help="comma-separated [recover.step] abort_recovery values, one replica run each a round")
    parser.add_argument("--overlap", default="off",
                        help="comma-separated on/off: [recover.step] overlap_reduction of the replica runs")
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    suffix = {"on": "", "off": "-after"}
    overlaps = args.overlap.split(",")
    if not overlaps or any(o not in suffix for o in overlaps):
        raise SystemExit(f"--overlap takes a comma-separated list of on and off, got {args.overlap!r}")
    kinds = [f"ftpg-{value}{suffix[o]}" for o in overlaps for value in args.abort_recovery.split(",")] + ["native"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    per_round: dict[str, list[float]] = {kind: [] for kind in kinds}
    losses: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
                step_times, curve = run(kind, args, f"{tmp}/{kind}{r}")
                times[kind] += step_times
                per_round[kind].append(statistics.median(step_times))
                losses.setdefault(kind, curve)
                print(f"round {r} {kind:15s}: median step {statistics.median(step_times):.3f} s", flush=True)
    median = {kind: statistics.median(times[kind]) for kind in kinds}
    native = median["native"]
    headline = []
    for n, kind in enumerate(kinds[:-1]):
        diff = max(abs(losses[kind][s] - losses["native"][s]) / abs(losses["native"][s]) for s in losses["native"])
        share = statistics.median(SHARES[kind])
        print(f"{args.replicas} replicas x {args.shards} shards, {args.flavor}, {kind}: fault-tolerant groups "
              f"{median[kind]:.4f} s, native HSDP {native:.4f} s per step (ratio {median[kind] / native:.4f}); "
              f"reduction share {share:.3f}; largest relative loss difference {diff:.1e}")
        paired = [a / b for a, b in zip(per_round[kind], per_round["native"])]
        print(f"  paired by round (its median step over native's of the same round): "
              f"{' '.join(f'{p:.3f}' for p in paired)}; median {statistics.median(paired):.3f}")
        if n == 0:
            headline.append(f"ratio={median[kind] / native:.4f} ftpg_step_s={median[kind]:.4f} "
                            f"native_step_s={native:.4f} loss_max_rel_diff={diff:.1e} reduction_share={share:.3f} "
                            f"ratio_round_median={statistics.median(paired):.4f} ratio_round_min={min(paired):.4f} "
                            f"ratio_round_max={max(paired):.4f}")
        else:
            value = kind.removeprefix("ftpg-").replace("-", "_")
            headline.append(f"ratio_{value}={median[kind] / native:.4f} reduction_share_{value}={share:.3f}")
    print(" ".join(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
