#!/usr/bin/env python3
"""Effective throughput under successive failures: checkpoint-restart against titan_recover, with and without a
warm spare (docs/evidence.md).

One job (``train_configs/replicas.toml``, ``--replicas`` replica groups of one process, the ``--flavor`` model,
``--steps`` steps of the same global batch) is run four ways under one failure schedule: replica ``victim[i]``
(rank 0) is SIGKILLed at the first forward ``--failures[i]`` seconds after the job was launched (``[chaos]``
``at_s``, once per job):

    failure_free       the replica-group job, no faults
    ckpt_restart       ``[recover] mode = "checkpoint_restart"``: the same job as one torchrun (the replica groups
                       are TorchTitan's replicated data-parallel dimension), TorchTitan's async DCP checkpoint every
                       ``--checkpoint-interval`` steps, torchrun restarting every process on a failure, resuming
                       from the newest checkpoint
    recover            the replica-group job: survivors recompute a lost group's microbatches in the same step,
                       the group is restarted and rejoins with state from a peer's memory (``max_restarts``)
    recover_spares     the same with one warm spare group (``spares = 1``), which takes a lost group's share at the
                       next step; the restarted group becomes a spare

Effective throughput = tokens of the job's ``--steps`` committed steps / wall time from the launch to the last
step's commit (start-up included: every mode pays it once, checkpoint-restart once per failure). ``--rounds``
rounds run every mode once each, interleaved (round ``i`` starts with the ``i``-th mode), so that a slow spell of
the machine falls on every mode alike; the table gives each mode's median and [min, max] over the rounds, against
checkpoint-restart's run and the failure-free run of the same round. Every run's timeline (steps committed, faults,
restarts, rejoins) is written to ``--out/NAME.json`` (the simulator's validation reads it:
scripts/validate_simulator.py), the first round's committed tokens over wall time to ``--out/NAME.png`` and what
is printed to ``--out/NAME.txt`` (``--name``, default ``effective_throughput``).

    python benchmarks/effective_throughput.py [--rounds 3] [--steps 60] [--failures 40 60 80] [--victims 0 2 1]
    python benchmarks/effective_throughput.py --every 40     # a failure every 40 s while each job runs

A list of failures (``--failures``, ``--victims``) must fit in every run; with ``--every`` the failures form a
constant rate instead, and each run meets those due while it runs (a longer run meets more).

On one CPU machine the replica groups share its cores: while a group is down the survivors run faster, so the
fraction of failure-free throughput a replica-group mode keeps is overstated here (on a cluster a dead group's
accelerators are simply gone; the simulator carries the costs there: docs/evidence.md).

Last line: ``ratio_vs_ckpt_restart=... ratio_spares_vs_ckpt_restart=... failure_free_vs_ckpt_restart=...
kept_ckpt_restart=... kept_recover=... kept_recover_spares=...``: medians over the rounds of each mode's effective
throughput over checkpoint-restart's, and over the failure-free run's. Target: ratio_vs_ckpt_restart >= 2.23 with
>= 3 successive failures.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import recorded  # noqa: E402
from titan_recover.recover.chaos.config import JOB_START_ENV  # noqa: E402
from titan_recover.recover.events import read_events  # noqa: E402
from titan_recover.sim.calibration import periodic_failures  # noqa: E402

CONFIG = "train_configs/replicas.toml"
FIRST_FAILURE_S, PERIODIC_UNTIL_S = 40.0, 3600.0
"""``--every``: the first failure, and the end of the schedule (no run takes an hour)."""
RESTART_ALLOWANCE_S = 30.0
"""A fault due this long before a run's end must have fired (one due while its target restarts waits for it)."""
MODES = ("failure_free", "ckpt_restart", "recover", "recover_spares")
TIMELINE_EVENTS = ("fault_injected", "training_started", "checkpoint_complete", "failure_detected", "epoch_formed",
                   "spare_promoted", "join_requested", "replica_admitted", "state_transferred", "full_strength")
"""Events kept in the timeline (the simulator's calibration reads them)."""


def job_overrides(args) -> list[str]:
    return ["--model.flavor", args.flavor, "--training.steps", str(args.steps), "--recover.replicas",
            str(args.replicas), "--parallelism.data_parallel_shard_degree", "1", "--metrics.log_freq", "1",
            "--metrics.no_enable_wandb"]


def mode_overrides(mode: str, args) -> list[str]:
    restarts = str(len(args.failures))
    if mode == "ckpt_restart":
        return ["--recover.mode", "checkpoint_restart", "--recover.max_restarts", restarts, "--checkpoint.enable",
                "--checkpoint.interval", str(args.checkpoint_interval), "--checkpoint.async_mode", "async"]
    if mode == "recover":
        return ["--recover.max_restarts", restarts]
    if mode == "recover_spares":
        return ["--recover.max_restarts", restarts, "--recover.spares", "1"]
    return []


def fault_schedule(args) -> str:
    faults = [f'{{kind = "kill", replica = {v}, rank = 0, at_s = {t}, phase = "forward"}}'
              for t, v in zip(args.failures, args.victims)]
    return "[" + ", ".join(faults) + "]"


def tokens_per_step(args) -> int:
    from titan_recover.job_config import build_config

    training = build_config(str(ROOT / CONFIG), job_overrides(args)).training
    return training.seq_len * training.local_batch_size * args.replicas


def keep(folder: pathlib.Path, proc: subprocess.CompletedProcess, to: pathlib.Path) -> pathlib.Path:
    """Copy a run's folder (without checkpoints and wandb files) and its console output to ``to``."""
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(folder, to, ignore=shutil.ignore_patterns("checkpoint", "tb"))
    (to / "console.log").write_text(proc.stdout + proc.stderr)
    return to


def committed_steps(metrics: pathlib.Path, launched: float, *, rolls_back: bool) -> list[tuple[float, int]]:
    """``(seconds since launch, step)`` of every step committed. Checkpoint-restart is one TorchTitan job: its
    records in order, a restart's steps after the checkpoint again. A replica-group job commits each step once,
    and every live group's metrics rank logs it: the first record of each step counts (any group may have been
    down when a step committed, replica 0 included)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in records if "loss_metrics/global_avg_loss" in r]
    if rolls_back:
        return [(round(r["time"] - launched, 3), int(r["step"])) for r in records if r.get("replica", 0) == 0]
    first: dict[int, float] = {}
    for r in records:
        first[int(r["step"])] = min(first.get(int(r["step"]), float("inf")), r["time"])
    return [(round(t - launched, 3), step) for step, t in sorted(first.items())]


def run(mode: str, args, folder: pathlib.Path) -> dict:
    cmd = [sys.executable, "-m", "titan_recover.launch", CONFIG, *job_overrides(args), *mode_overrides(mode, args),
           "--dump_folder", str(folder)]
    if mode != "failure_free":
        cmd += ["--chaos.faults", fault_schedule(args)]
    launched = time.time()
    env = dict(os.environ, **{JOB_START_ENV: repr(launched)})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if args.keep:
        keep(folder, proc, pathlib.Path(args.keep) / f"{args.name}-{mode}")
    if proc.returncode != 0:
        kept = keep(folder, proc, pathlib.Path(args.out) / "failed" / f"{args.name}-{mode}")
        raise RuntimeError(f"{mode} run failed ({proc.returncode}); its events, metrics and console output are "
                           f"kept in {kept}:\n{proc.stderr[-3000:]}")
    commits = committed_steps(folder / "metrics.jsonl", launched, rolls_back=mode == "ckpt_restart")
    events = [{**{k: v for k, v in e.items() if k != "time"}, "t": round(e["time"] - launched, 3)}
              for e in read_events(folder / "events.jsonl") if e["event"] in TIMELINE_EVENTS]
    fired = [e for e in events if e["event"] == "fault_injected"]
    last = max(t for t, s in commits if s == args.steps)
    # every fault due while the job ran fires (one due while its target restarts fires after the restart: allow
    # a restart's time before the end); an explicit schedule must fit in every run
    due = [t for t in args.failures if t < last - RESTART_ALLOWANCE_S] if args.every else args.failures
    if mode != "failure_free" and len(fired) < len(due):
        raise RuntimeError(f"{mode}: {len(fired)} of {len(due)} faults fired" + ("" if args.every else " (raise --steps)"))
    return {"mode": mode, "command": cmd[1:], "commits": commits, "events": events, "end_s": last}


def plot(results: dict, path: pathlib.Path, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, result in results.items():
        times = [0.0] + [t for t, _ in result["commits"]]
        steps = [0] + [s for _, s in result["commits"]]
        ax.step(times, [s * tokens for s in steps], where="post", label=f"{mode} ({result['tokens_per_s']:.0f} tok/s)")
    failures = max((r["failures_s"] for r in results.values()), key=len)  # the longest run saw the most
    for i, t in enumerate(failures):
        ax.axvline(t, color="grey", linestyle=":", linewidth=1, label="failure" if i == 0 else None)
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("tokens of the newest trained step")
    ax.set_title("Committed progress under successive failures (a restart falls back to its checkpoint)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def spread(values: list[float]) -> str:
    """``median [min, max]``."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def summary(rounds: list[dict], modes: list[str]) -> tuple[list[str], dict[str, float]]:
    """The table over rounds (median [min, max]) and the headline: each mode's throughput over checkpoint-restart's
    and over the failure-free run's of the same round."""
    lines = [f"\n{'mode':15s} {'tokens/s, median [min, max] over ' + str(len(rounds)) + ' rounds':>44s}"
             f" {'/ ckpt_restart':>24s} {'kept of failure_free':>24s}"]
    headline, kept_of = {}, {}
    for mode in modes:
        rates = [r[mode]["tokens_per_s"] for r in rounds]
        vs_restart = [r[mode]["tokens_per_s"] / r["ckpt_restart"]["tokens_per_s"] for r in rounds]
        kept = ([r[mode]["tokens_per_s"] / r["failure_free"]["tokens_per_s"] for r in rounds]
                if "failure_free" in modes else [])
        lines.append(f"{mode:15s} {statistics.median(rates):20.1f} [{min(rates):7.1f}, {max(rates):7.1f}]"
                     f" {spread(vs_restart):>24s} {spread(kept) if kept else '-':>24s}")
        if mode != "ckpt_restart":
            name = {"recover": "ratio", "recover_spares": "ratio_spares", "failure_free": "failure_free"}[mode]
            headline[f"{name}_vs_ckpt_restart"] = statistics.median(vs_restart)
        if kept and mode != "failure_free":
            kept_of[f"kept_{mode}"] = statistics.median(kept)
    order = ("ratio_vs_ckpt_restart", "ratio_spares_vs_ckpt_restart", "failure_free_vs_ckpt_restart")
    return lines, {**{k: headline[k] for k in order if k in headline}, **kept_of}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--failures", type=float, nargs="+", default=[40.0, 60.0, 80.0],
                        help="seconds after the launch at which a replica is killed")
    parser.add_argument("--victims", type=int, nargs="+", default=[0, 2, 1],
                        help="replica killed at each failure (replica 0, the default donor of state, included)")
    parser.add_argument("--every", type=float,
                        help="instead of --failures / --victims: a failure every EVERY s from 40 s on for as long as "
                             "each job runs (a constant failure rate), replicas 1, 2, ... hit in turn")
    parser.add_argument("--checkpoint-interval", type=int, default=5, help="steps between checkpoint-restart's saves")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every mode, interleaved (each round starts one mode later)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    parser.add_argument("--name", default="effective_throughput",
                        help="file name of the JSON, PNG and TXT written")
    parser.add_argument("--keep", help="copy every run's events, metrics and console output under this folder")
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args(argv)
    if args.every:
        if args.every <= 0:
            parser.error("--every must be > 0 seconds")
        schedule = periodic_failures(args.every, args.replicas - 1, FIRST_FAILURE_S, PERIODIC_UNTIL_S)
        args.failures, args.victims = [t for t, _ in schedule], [v for _, v in schedule]
    if len(args.victims) != len(args.failures) or not all(0 <= v < args.replicas for v in args.victims):
        parser.error("--victims needs one replica in [0, replicas) per failure")
    if "ckpt_restart" not in args.modes:
        parser.error("the ratios are against ckpt_restart: keep it in --modes")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    tokens = tokens_per_step(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with recorded(__file__, argv, str(out / f"{args.name}.txt")):
        rounds = run_rounds(args, tokens)
        setup = {k: v for k, v in vars(args).items() if k not in ("out", "timeout", "modes", "name", "keep")}
        (out / f"{args.name}.json").write_text(json.dumps(
            {"setup": {**setup, "config": CONFIG, "tokens_per_step": tokens, "cpu_count": os.cpu_count()},
             "rounds": rounds}, indent=1) + "\n")
        plot(rounds[0], out / f"{args.name}.png", tokens)
        lines, headline = summary(rounds, args.modes)
        print("\n".join(lines))
        print(" ".join(f"{k}={v:.3f}" for k, v in headline.items()))
    return 0


def run_rounds(args, tokens: int) -> list[dict]:
    """``--rounds`` rounds of every mode, round ``i`` starting with the ``i``-th: ``[{mode: run}]``."""
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            order = args.modes[index % len(args.modes):] + args.modes[:index % len(args.modes)]
            results = {}
            for mode in order:
                result = run(mode, args, pathlib.Path(tmp) / f"{index}-{mode}")
                result["tokens_per_s"] = args.steps * tokens / result["end_s"]
                result["failures_s"] = [e["t"] for e in result["events"] if e["event"] == "fault_injected"]
                results[mode] = result
                print(f"round {index} {mode:15s} {args.steps} steps in {result['end_s']:7.1f} s  "
                      f"{result['tokens_per_s']:8.1f} tokens/s  faults at "
                      f"{', '.join(f'{t:.1f}' for t in result['failures_s']) or '-'} s", flush=True)
            rounds.append({mode: results[mode] for mode in args.modes})
    return rounds


if __name__ == "__main__":
    sys.exit(main())
