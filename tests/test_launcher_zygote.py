"""The tests' launcher server (tests/launcher_zygote.py) stands for ``python -m titan_recover.launch``: the same
output and exit code for a config that resolves and for one that is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import launcher_command, ROOT

pytestmark = pytest.mark.multiprocess  # a fresh interpreter importing TorchTitan: seconds


@pytest.mark.parametrize("args", [
    ("train_configs/rejoin.toml", "--print-config", "--model.flavor", "tiny"),
    ("train_configs/replicas.toml", "--recover.heartbeat_interval_s", "50"),  # refused: exit 2 and the reason
])
def test_a_forked_launcher_says_and_exits_what_a_fresh_one_does(args):
    if os.environ.get("TITAN_RECOVER_TEST_ZYGOTE", "1") == "0":
        pytest.skip("TITAN_RECOVER_TEST_ZYGOTE=0: every launch is a fresh interpreter")
    real = subprocess.run([sys.executable, "-m", "titan_recover.launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    forked = subprocess.run(launcher_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert launcher_command(*args)[1].endswith("launcher_zygote.py")
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert real.returncode == (0 if "--print-config" in args else 2)
    assert real.stdout.strip() if real.returncode == 0 else "config error" in real.stderr
