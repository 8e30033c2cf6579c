"""End to end as a user runs it: ./run_train.sh, determinism, checkpoint resume, equality with stock TorchTitan."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import check_layout, launch, read_metrics, ROOT
from titan_recover.compare import parse_console_steps

pytestmark = pytest.mark.multiprocess

CONFIG = "train_configs/debug_model.toml"
TINY = ("--model.flavor", "tiny", "--metrics.no_enable_wandb")
STEPS = 4


def curve(folder: pathlib.Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss_metrics/global_avg_loss"], r["grad_norm"]) for r in read_metrics(folder)]


@pytest.fixture(scope="module")
def reference(default_data, tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("reference")
    proc = launch(CONFIG, *TINY, "--training.steps", str(STEPS), "--dump_folder", str(folder))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _, _ in curve(folder)] == list(range(1, STEPS + 1))
    return folder


def test_run_train_sh_trains_default_config_with_wandb_offline(default_data, tmp_path):
    env = dict(os.environ)
    env.pop("WANDB_MODE", None)  # the config's default (offline) must apply by itself
    proc = subprocess.run(
        ["./run_train.sh", "--training.steps", "3", "--model.flavor", "tiny", "--dump_folder", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_layout(proc.stdout + proc.stderr, tmp_path, (2, 1, 2, 1, 1), steps=3)  # FSDP2 over 2 processes
    assert list(tmp_path.glob("tb/*/wandb/offline-run-*")), "wandb did not write an offline run"


def test_same_config_and_seed_give_identical_losses(reference, tmp_path):
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


def test_resume_from_checkpoint_continues_the_same_trajectory(reference, tmp_path):
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "2", "--dump_folder", str(tmp_path))
    first = launch(CONFIG, *TINY, *ckpt, "--training.steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "checkpoint" / "step-2").is_dir()
    second = launch(CONFIG, *TINY, *ckpt, "--training.steps", str(STEPS))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Training starts at step 3" in second.stdout + second.stderr  # it really resumed
    # the data position follows the restored step: steps 3-4 equal the uninterrupted run, bitwise
    assert curve(tmp_path) == curve(reference)


def test_project_trains_exactly_like_stock_torchtitan(reference, tmp_path):
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
