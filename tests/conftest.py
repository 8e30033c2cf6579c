"""Shared fixtures. Tests run on CPU with gloo; multi-process tests start real torchrun process trees."""

from __future__ import annotations

import json
import os
import pathlib
import signal
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
    """Run the launcher (config checks, then torchrun) as a user would, with a hard timeout.

    On timeout the launcher gets SIGTERM (it ends its children), then SIGKILL; processes of the run that are
    still alive after that are killed too, so a failing test leaves nothing behind.
    """
    cmd = [sys.executable, "-m", "titan_recover.launch", config, *overrides]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        if "--dump_folder" in overrides:
            from titan_recover.recover.launcher import processes_of_run

            run_dir = os.path.abspath(overrides[list(overrides).index("--dump_folder") + 1])
            for pid in processes_of_run(run_dir):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"launch timed out after {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


EXACT_REFERENCE = {"replicas": 3, "steps": 8}


@pytest.fixture(scope="session")
def exact_reference(tmp_path_factory, default_data) -> pathlib.Path:
    """The failure-free run that several modules compare with, run once: the tiny model, 3 replicas of 1 process,
    8 steps, exact mode, every rank's final parameters saved."""
    from replica_runs import run_replicas

    folder = tmp_path_factory.mktemp("exact_reference")
    proc, _ = run_replicas(folder, replicas=EXACT_REFERENCE["replicas"], ranks=1, steps=EXACT_REFERENCE["steps"],
                           faults=[], extra=("--recover.quota.exact",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder
