#!/usr/bin/env python3
"""Localisation by consensus (docs/scout.md): false attributions, injected corruptions attributed, overhead.

    clean          3 replicas (the ``--flavor`` model, 1 process each), ``--clean-steps`` failure-free steps with
                   the parameter vote at every reduction and a replay every 10 steps: every
                   ``corruption_attributed`` or ``vote_inconclusive`` event is a false alarm
    corruptions    4 replicas, exact mode, ``--corruptions`` single bit flips drawn from ``--seed`` (replica,
                   bit, element; alternately a parameter of a random replica and, at a replay step, the gradient
                   of the replayed microbatch on its holder), one every ``--spacing`` steps. Each is attributed
                   when the first ``corruption_attributed`` event at or after its step names exactly its replica;
                   the evicted replica is restarted and rejoins before the next one
    overhead       3 replicas of the llama3 debugmodel, ``--microbatches`` per step, failure-free, mean step time
                   (a mean, not a median: one step in 10 carries the replay) with the vote every step and a replay
                   every 10 steps against neither, alternated ``--rounds`` times; both must log the same losses

    python benchmarks/localisation.py [--clean-steps 200] [--corruptions 20] [--rounds 2]

Last line: ``false_attributions=... attributed=... injected=... overhead_ratio=...``. Targets: 0 false
attributions, all injected attributed, overhead_ratio <= 1.03.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.recover.scout.consensus import replay_plan  # noqa: E402
from titan_recover.recover.events import read_events, read_jsonl  # noqa: E402

REPLAY = 10


def launch(folder: str, *, replicas: int, steps: int, extra: list[str], timeout: float, flavor: str) -> list[dict]:
    cmd = [sys.executable, "-m", "titan_recover.launch", "train_configs/replicas.toml", "--model.flavor", flavor,
           "--recover.replicas", str(replicas), "--parallelism.data_parallel_shard_degree", "1",
           "--training.steps", str(steps), "--metrics.no_enable_wandb", "--dump_folder", folder, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_events(pathlib.Path(folder) / "events.jsonl")


def metrics(folder: str, replica: int = 0) -> dict[int, dict]:
    out = {}
    for record in read_jsonl(pathlib.Path(folder) / "metrics.jsonl"):
        if record["replica"] == replica:
            out[record["step"]] = record
    return out


def clean(args, tmp: str) -> tuple[int, int]:
    folder = f"{tmp}/clean"
    events = launch(folder, replicas=3, steps=args.clean_steps, timeout=args.timeout, flavor=args.flavor,
                    extra=["--recover.localize.replay_interval", str(REPLAY)])
    alarms = [e for e in events if e["event"] in ("corruption_attributed", "vote_inconclusive")]
    logged = metrics(folder)
    votes = logged[max(logged)]["recover/votes_total"]
    print(f"clean: {args.clean_steps} steps, {votes} votes judged by replica 0's rank, {len(alarms)} alarms "
          f"{alarms[:3]}", flush=True)
    return len(alarms), votes


def schedule(args) -> list[dict]:
    """Seeded flips, one every ``spacing`` steps from step 3; gradient flips on the replayed microbatch's holder."""
    rng = random.Random(args.seed)
    replicas, starts = 4, collections.Counter()
    faults = []
    for i in range(args.corruptions):
        step = 3 + i * args.spacing
        if i % 2:
            step += (-step) % args.replay_every  # a replay step
            ids = [(step - 1) * replicas + r for r in range(replicas)]  # the even quota, all replicas members
            replica = replay_plan(step, 0, ids, {g: g % replicas for g in ids}, range(replicas)).holder
            target = "gradient"
        else:
            replica, target = rng.randrange(replicas), "parameter"
        faults.append({"kind": "bitflip", "target": target, "replica": replica, "rank": 0, "step": step,
                       "phase": "forward", "bit": rng.randrange(31), "element": rng.randrange(10_000),
                       "incarnation": starts[replica]})
        starts[replica] += 1  # it is evicted and comes back as its next start
    return faults


def corruptions(args, tmp: str) -> tuple[int, int, list[tuple]]:
    faults = schedule(args)
    steps = faults[-1]["step"] + 2
    toml = "[" + ", ".join("{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in f.items()) + "}" for f in faults) + "]"
    events = launch(f"{tmp}/corrupt", replicas=4, steps=steps, timeout=args.timeout, flavor=args.flavor,
                    extra=["--recover.quota.exact", "--recover.max_restarts", str(args.corruptions),
                           "--recover.rejoin_wait_s", "150", "--recover.localize.replay_interval",
                           str(args.replay_every), "--chaos.faults", toml])
    fired = {(e["replica"], e["step"]) for e in events if e["event"] == "fault_injected"}
    blamed = collections.defaultdict(set)
    for e in events:
        if e["event"] == "corruption_attributed":
            blamed[e["step"]].add(e["replica"])
    attributed, rows = 0, []
    for f in faults:
        later = sorted(s for s in blamed if s >= f["step"])
        step = later[0] if later else None
        ok = (f["replica"], f["step"]) in fired and step is not None and blamed[step] == {f["replica"]}
        attributed += ok
        rows.append((f["step"], f["replica"], f["target"], f["bit"], step, sorted(blamed.get(step, ()))))
    injected_steps = {f["step"] for f in faults}
    false = sum(1 for s, who in blamed.items() if s not in injected_steps)
    for row in rows:
        print("injected step {:3d} replica {} {:9s} bit {:2d} -> attributed at step {} to {}".format(*row), flush=True)
    return attributed, false, rows


def overhead(args, tmp: str) -> float:
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            folder = f"{tmp}/overhead{int(on)}{r}"
            extra = ["--recover.quota.microbatches", str(args.microbatches), "--recover.quota.exact"]
            extra += ["--recover.localize.replay_interval", str(REPLAY)] if on else ["--recover.localize.no_vote"]
            launch(folder, replicas=3, steps=args.overhead_steps, extra=extra, timeout=args.timeout,
                   flavor="debugmodel")
            logged = metrics(folder)
            step_s = [logged[s]["time_metrics/end_to_end(s)"] for s in sorted(logged)][args.warmup:]
            times[on] += step_s
            losses.setdefault(on, [logged[s]["loss_metrics/global_avg_loss"] for s in sorted(logged)])
            print(f"round {r} localisation={'on ' if on else 'off'}: mean step {statistics.mean(step_s):.3f} s, "
                  f"median {statistics.median(step_s):.3f} s", flush=True)
    if losses[True] != losses[False]:
        raise RuntimeError("localisation changed the losses")
    print(f"median step ratio {statistics.median(times[True]) / statistics.median(times[False]):.4f} (without the "
          "replay steps' cost)", flush=True)
    return statistics.mean(times[True]) / statistics.mean(times[False])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--clean-steps", type=int, default=200)
    parser.add_argument("--corruptions", type=int, default=20)
    parser.add_argument("--spacing", type=int, default=4, help="steps between injected corruptions")
    parser.add_argument("--replay-every", type=int, default=2, help="replay interval of the corruption run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--overhead-steps", type=int, default=25)
    parser.add_argument("--microbatches", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    with tempfile.TemporaryDirectory() as tmp:
        false_clean, votes = clean(args, tmp)
        attributed, false_corrupt, _ = corruptions(args, tmp)
        ratio = overhead(args, tmp)
    false = false_clean + false_corrupt
    print(f"clean run: {votes} votes, {false_clean} false alarms; corruption run: {attributed} of "
          f"{args.corruptions} attributed to the right replica, {false_corrupt} attributions at steps without an "
          f"injection; overhead (vote every step + replay every {REPLAY}) {ratio:.4f}")
    print(f"false_attributions={false} attributed={attributed} injected={args.corruptions} overhead_ratio={ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
