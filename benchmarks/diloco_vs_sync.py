#!/usr/bin/env python3
"""Decoupled DiLoCo against the synchronous recover mode under the same failures (docs/diloco.md).

Both runs train the same token budget (``--steps`` synchronous steps of 3 replica groups of one process each, the
``--flavor`` model, train_configs/diloco.toml) under the same chaos schedule: replica / learner 1 is killed at its
step ``--kill-step`` and restarted, replica / learner 2 is ``--slow``x slower from step 2. The synchronous mode runs
twice, with the default ``even`` quota policy and with ``throughput`` (meant for stragglers: it lowers the slow
replica's share); it rejoins the restarted replica from a peer's memory. The diloco run uses ``--inner-steps``,
``--fragments``, ``--outer-lr`` and ``--outer-momentum`` (defaults for this short budget: plain averaging, lr 1 and
no momentum; torchft's 0.7 / 0.9 are meant for hundreds of inner steps, see docs/benchmarks.md).

Goodput = tokens in the trained model / seconds from the moment training could start (sync: epoch 0 formed, every
replica registered; diloco: the syncer published the initial model) to the end (sync: the last replica's final
parameters; diloco: the syncer's last merge). Tokens: sync commits every step's full global batch; diloco counts
the tokens merged into the global model (progress lost with a dead learner is not counted). Validation loss: both
final models evaluated by the same code (titan_recover/evaluate.py) on the same slice, the ``--eval-microbatches``
replica microbatches after the budget.

    python benchmarks/diloco_vs_sync.py [--flavor debugmodel] [--steps 40] [--inner-steps 5]

Last line: ``goodput_ratio=... sync_val_loss=... diloco_val_loss=... goodput_ratio_even=...``: goodput_ratio and
sync_val_loss against the better synchronous run (the higher goodput). Targets: goodput_ratio >= 1.5, the diloco
validation loss within 5 % of the synchronous one.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.recover.events import read_events  # noqa: E402


def faults(args) -> str:
    specs = [f'{{kind = "kill", replica = 1, rank = 0, step = {args.kill_step}, phase = "forward"}}',
             f'{{kind = "slow", replica = 2, rank = 0, step = 2, factor = {args.slow}}}']
    return "[" + ", ".join(specs) + "]"


def common(args) -> list[str]:
    return ["--model.flavor", args.flavor, "--training.steps", str(args.steps), "--metrics.no_enable_wandb",
            "--chaos.faults", faults(args), "--recover.max_restarts", "1",
            "--recover.diloco.eval_microbatches", str(args.eval_microbatches)]


def run(name: str, folder: str, extra: list[str], args) -> list[dict]:
    cmd = [sys.executable, "-m", "titan_recover.launch", "train_configs/diloco.toml", *common(args),
           "--dump_folder", folder, *extra]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"{name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"{name}: job took {time.monotonic() - started:.1f} s", flush=True)
    return read_events(pathlib.Path(folder) / "events.jsonl")


def fired(events: list[dict]) -> int:
    return len([e for e in events if e["event"] == "fault_injected"])


def sync_result(folder: str, events: list[dict], args) -> tuple[float, float, int]:
    from titan_recover.job_config import build_config
    from titan_recover.evaluate import plain_name, Validator

    start = next(e["time"] for e in events if e["event"] == "epoch_formed" and e["epoch"] == 0)
    end = max(e["time"] for e in events if e["event"] == "final_parameters")
    config = build_config("train_configs/diloco.toml", common(args) + ["--recover.mode", "sync"])
    tokens = args.steps * 3 * config.training.local_batch_size * config.training.seq_len
    shards = __import__("torch").load(pathlib.Path(folder) / "final_parameters" / "replica0_rank0.pt")
    parameters = {plain_name(k): v for k, v in shards.items()}
    val_loss = Validator(config, args.eval_microbatches).loss(parameters)
    return tokens / (end - start), val_loss, tokens


def diloco_result(events: list[dict]) -> tuple[float, float, float]:
    start = next(e["time"] for e in events if e["event"] == "syncer_started" and not e["resumed"])
    finished = next(e for e in events if e["event"] == "syncer_finished")
    last_merge = max(e["time"] for e in events if e["event"] == "fragment_merged")
    return finished["merged_tokens"] / (last_merge - start), finished["val_loss"], finished["merged_tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0)
    parser.add_argument("--kill-step", type=int, default=5)
    parser.add_argument("--slow", type=float, default=3.0)
    parser.add_argument("--eval-microbatches", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1200)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    diloco_flags = ["--recover.diloco.inner_steps", str(args.inner_steps), "--recover.diloco.fragments",
                    str(args.fragments), "--recover.diloco.outer_lr", str(args.outer_lr),
                    "--recover.diloco.outer_momentum", str(args.outer_momentum), "--recover.diloco.eval_interval_s", "0"]
    sync = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("even", "throughput"):
            events = run(f"sync ({policy})", f"{tmp}/sync_{policy}", [
                "--recover.mode", "sync", "--recover.quota.policy", policy, "--recover.save_final_parameters"], args)
            if fired(events) != 2:
                raise RuntimeError(f"sync ({policy}): {fired(events)} of the 2 scheduled faults fired")
            sync[policy] = sync_result(f"{tmp}/sync_{policy}", events, args)
        diloco_events = run("diloco", f"{tmp}/diloco", diloco_flags, args)
        if fired(diloco_events) != 2:
            raise RuntimeError(f"diloco: {fired(diloco_events)} of the 2 scheduled faults fired")
        diloco_goodput, diloco_val, diloco_tokens = diloco_result(diloco_events)

    merges = [e for e in diloco_events if e["event"] == "fragment_merged"]
    for policy, (goodput, val, tokens) in sync.items():
        print(f"sync   (recover, {policy} policy): {tokens} tokens, goodput {goodput:.0f} tokens/s, validation loss "
              f"{val:.4f}")
    print(f"diloco (H={args.inner_steps}, F={args.fragments}, outer lr {args.outer_lr}, momentum "
          f"{args.outer_momentum}): {diloco_tokens:.0f} tokens merged in {len(merges)} merges (mean quorum "
          f"{sum(len(e['learners']) for e in merges) / len(merges):.2f}), goodput {diloco_goodput:.0f} tokens/s, "
          f"validation loss {diloco_val:.4f}")
    print(json.dumps({"flavor": args.flavor, "steps": args.steps, "kill_step": args.kill_step, "slow": args.slow}))
    best = max(sync, key=lambda p: sync[p][0])
    ratio = diloco_goodput / sync[best][0]
    print(f"goodput_ratio={ratio:.3f} sync_val_loss={sync[best][1]:.4f} diloco_val_loss={diloco_val:.4f} "
          f"goodput_ratio_even={diloco_goodput / sync['even'][0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
