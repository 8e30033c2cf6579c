"""Shared fixtures. Tests run on CPU with gloo; multi-process tests start real torchrun process trees."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

os.environ.setdefault("TITAN_RECOVER_DEVICE", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def default_data() -> pathlib.Path:
    """The default prepared dataset (built once; ./run_train.sh builds the same folder on first use)."""
    from titan_recover.data.prepare import DEFAULT_DATA_DIR, prepare

    return prepare(str(ROOT / DEFAULT_DATA_DIR))


def read_metrics(folder: pathlib.Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    assert path.exists(), f"no metrics written to {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(config: str, *overrides: str, timeout: float = 240, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    """Run the launcher (config checks, then torchrun) as a user would, with a hard timeout."""
    cmd = [sys.executable, "-m", "titan_recover.launch", config, *overrides]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
