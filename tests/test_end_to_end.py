"""End to end as a user runs it: ./run_train.sh, determinism, equality with stock TorchTitan."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import check_layout, launch, rank_logs, read_metrics, ROOT
from titan_recover.compare import parse_console_steps
from wandb_offline import read_run

pytestmark = pytest.mark.multiprocess

CONFIG = "train_configs/debug_model.toml"
TINY = ("--model.flavor", "tiny", "--metrics.no_enable_wandb")
STEPS = 4


def curve(folder: pathlib.Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss_metrics/global_avg_loss"], r["grad_norm"]) for r in read_metrics(folder)]


@pytest.fixture(scope="module")
def reference(default_data, tmp_path_factory) -> tuple[pathlib.Path, str]:
    """The default config trained as a user does, through ./run_train.sh (wandb left at the config's default),
    with the tiny model: the reference the other tests compare with. Returns (folder, console output)."""
    folder = tmp_path_factory.mktemp("reference")
    env = dict(os.environ)
    env.pop("WANDB_MODE", None)  # the config's default (offline) must apply by itself
    proc = subprocess.run(
        ["./run_train.sh", "--training.steps", str(STEPS), "--model.flavor", "tiny", "--dump_folder", str(folder)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + rank_logs(folder)
    return folder, proc.stdout + proc.stderr


def test_run_train_sh_trains_default_config_with_wandb_offline(reference):
    folder, output = reference
    check_layout(output, folder, (2, 1, 2, 1, 1), steps=STEPS)  # FSDP2 over 2 processes
    # the console shows the metrics rank; rank 1's output went to a file, which the console names
    [rank1] = folder.glob("logs/ranks/*/attempt_0/1/stdout.log")
    assert "titan_recover: llama3/tiny, Layout(world_size=2" in rank1.read_text()
    assert f"every other rank's output: {folder}/logs/ranks/" in output
    runs = list(folder.glob("tb/*/wandb/offline-run-*"))
    assert len(runs) == 1, f"expected the metrics rank's one offline run, found {runs}"
    run = read_run(runs[0].parent)  # named after the TOML file and the start time, grouped by the TOML file
    assert run.name.startswith("debug_model-20") and run.group == "debug_model", (run.name, run.group)
    logged = sorted(s for s, row in run.history.items() if "loss_metrics/global_avg_loss" in row)
    assert logged == list(range(1, STEPS + 1))
    # no MFU against an assumed peak on CPU, and no warning about a value nobody set
    assert "fallback to A100" not in output and "Peak FLOPS used for computing MFU" not in output
    assert "no peak FLOPS is known for 'cpu': MFU is not computed" in output and "mfu: N/A" in output
    assert all("mfu(%)" not in r for r in read_metrics(folder))
    assert "initial_load_model_only" not in output


def test_same_config_and_seed_give_identical_losses(reference, tmp_path):
    reference, _ = reference
    proc = launch(CONFIG, *TINY, "--training.steps", str(STEPS), "--dump_folder", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert curve(tmp_path) == curve(reference)  # bitwise: same floats at every step

    out = tmp_path / "cmp.png"
    cmp = subprocess.run(
        [sys.executable, "scripts/compare_runs.py", str(reference), str(tmp_path), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert cmp.returncode == 0, cmp.stderr
    assert cmp.stdout.strip().splitlines()[-1] == (
        f"max_abs_diff=0.000000e+00 max_rel_diff=0.000000e+00 common_steps={STEPS}"
    )
    assert out.stat().st_size > 10_000


# Resuming from a checkpoint (TorchTitan's, after torchrun restarted the job) retrains the same trajectory:
# tests/test_checkpoint_restart.py


def test_project_trains_exactly_like_stock_torchtitan(reference, tmp_path):
    reference, _ = reference
    overrides = [*TINY, "--training.steps", str(STEPS), "--dump_folder", str(tmp_path)]
    env = dict(os.environ, STOCK_TOML=CONFIG, STOCK_OVERRIDES=json.dumps(overrides))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--local-ranks-filter=0", "benchmarks/stock_torchtitan.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = parse_console_steps(proc.stdout + proc.stderr)
    assert [s.step for s in stock] == list(range(1, STEPS + 1))
    # TorchTitan prints 5 decimals; the project's JSONL has the full float
    assert [round(loss, 5) for _, loss, _ in curve(reference)] == [s.loss for s in stock]
