"""End to end as a user runs it: ./run_train.sh, determinism, wandb offline, compare_runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import launch, read_metrics, ROOT

pytestmark = pytest.mark.multiprocess


def test_run_train_sh_trains_default_config_with_wandb_offline(default_data, tmp_path):
    env = dict(os.environ)
    env.pop("WANDB_MODE", None)  # the config's default (offline) must apply by itself
    proc = subprocess.run(
        ["./run_train.sh", "--training.steps", "3", "--model.flavor", "tiny", "--dump_folder", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    offline_runs = list(tmp_path.glob("tb/*/wandb/offline-run-*"))
    assert offline_runs, "wandb did not write an offline run"


def test_same_config_and_seed_give_identical_losses(default_data, tmp_path):
    runs = []
    for name in ("a", "b"):
        proc = launch("train_configs/debug_model.toml", "--model.flavor", "tiny", "--training.steps", "4",
                      "--metrics.no_enable_wandb", "--dump_folder", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append([(r["step"], r["loss_metrics/global_avg_loss"], r["grad_norm"]) for r in read_metrics(tmp_path / name)])
    assert len(runs[0]) == 4
    assert runs[0] == runs[1]  # bitwise: same floats at every step

    out = tmp_path / "cmp.png"
    cmp = subprocess.run(
        [sys.executable, "scripts/compare_runs.py", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert cmp.returncode == 0, cmp.stderr
    assert cmp.stdout.strip().splitlines()[-1] == "max_abs_diff=0.000000e+00 max_rel_diff=0.000000e+00 common_steps=4"
    assert out.stat().st_size > 10_000
