#!/usr/bin/env python3
"""Recovery latency of replica groups: kill (and, separately, stop) one of 3 replicas in the middle of a step's
reduction and measure, from the run's event log, how long the survivors need to commit that step without it.

    detect_s   fault injected -> first fault flag raised (a survivor's gloo error, or the coordinator's verdict)
    agree_s    fault flag -> next epoch published by the coordinator (join window)
    rebuild_s  epoch published -> the step committed in the new epoch (new groups + redone reduction)
    *_to_commit_s  fault injected -> step committed, for a kill and for a hang (SIGSTOP)

Default timeouts ([recover] defaults: heartbeat_timeout_s 2.0, join_window_s 0.5) unless overridden.

    python benchmarks/recovery_latency.py [--flavor tiny] [--replicas 3] [--step 3]

Last line: ``detect_s=... agree_s=... rebuild_s=... kill_to_commit_s=... hang_to_commit_s=...``.
Targets: a killed replica costs the survivors < 1 s; a hung one < heartbeat_timeout_s + 1 s.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.recover.events import read_events  # noqa: E402


def run(kind: str, args, folder: str) -> dict[str, float]:
    victim = args.replicas - 1
    fault = f'[{{kind = "{kind}", replica = {victim}, rank = 0, step = {args.step}, phase = "reduction"}}]'
    cmd = [sys.executable, "-m", "titan_recover.launch", "train_configs/replicas.toml", "--model.flavor", args.flavor,
           "--recover.replicas", str(args.replicas), "--parallelism.data_parallel_shard_degree", "1",
           "--training.steps", str(args.step + 2), "--metrics.no_enable_wandb", "--dump_folder", folder,
           "--chaos.faults", fault, *args.extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    events = read_events(pathlib.Path(folder) / "events.jsonl")
    injected = next(e["time"] for e in events if e["event"] == "fault_injected")
    flag = next(e for e in events if e["event"] == "fault_flag" and e["epoch"] == 0)
    formed = next(e for e in events if e["event"] == "epoch_formed" and e["epoch"] == 1)
    commits = [e["time"] for e in events
               if e["event"] == "step_committed" and e["step"] == args.step and e["epoch"] == 1]
    if len(commits) != args.replicas - 1:
        raise RuntimeError(f"{kind}: expected {args.replicas - 1} survivors to commit step {args.step}: {commits}")
    steps = sorted(e["time"] for e in events if e["event"] == "step_committed" and e["source"] == "0/0")
    normal = min(b - a for a, b in zip(steps[: args.step - 1], steps[1 : args.step]))
    committed = max(commits)
    return {
        "detect_s": flag["raised_at"] - injected,
        "agree_s": formed["time"] - flag["raised_at"],
        "rebuild_s": committed - formed["time"],
        "to_commit_s": committed - injected,
        "normal_step_s": normal,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    add_out_argument(parser, __file__)
    args, args.extra = parser.parse_known_args(argv)  # the rest: config overrides, e.g. --recover.join_window_s 0.3
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    with tempfile.TemporaryDirectory() as tmp:
        kill = run("kill", args, f"{tmp}/kill")
        hang = run("hang", args, f"{tmp}/hang")
    for name, r in (("kill", kill), ("hang", hang)):
        print(f"{name}: detect {r['detect_s']:.3f} s, agree {r['agree_s']:.3f} s, rebuild {r['rebuild_s']:.3f} s, "
              f"fault to commit {r['to_commit_s']:.3f} s (a failure-free step: {r['normal_step_s']:.3f} s)")
    print(f"detect_s={kill['detect_s']:.3f} agree_s={kill['agree_s']:.3f} rebuild_s={kill['rebuild_s']:.3f} "
          f"kill_to_commit_s={kill['to_commit_s']:.3f} hang_to_commit_s={hang['to_commit_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
