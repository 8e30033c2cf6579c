"""scripts/device_check.py (run on a GPU when one is lent) keeps working: its CPU sections run here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.multiprocess
def test_the_device_check_runs_its_cpu_sections_and_writes_its_figures(tmp_path):
    out = tmp_path / "device_check.json"
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "--allow-cpu", "--mb", "8", "--members", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    gloo = report["ftpg_gloo"]
    assert gloo["correct"] and gloo["kill_survivors_released"] and not gloo["errors"], gloo
    # a SIGKILL mid-reduction is an error, not a hang: every survivor is released by the fault (gloo's error or the
    # flag), none by its deadline, which would take the group's whole timeout (no bound on the machine's speed)
    reasons = [v["reason"] for v in gloo["kill"].values() if v["outcome"] == "fault"]
    deadlines = [r for r in reasons if "no progress for" in r or "timed out" in r.lower()]
    assert len(reasons) == gloo["members"] - 1 and not deadlines, gloo
    assert gloo["kill_release_s"] < gloo["timeout_s"], gloo
    assert report["signature"]["device_equals_host"] and all(report["signature"]["flip_detected"].values())
    assert all(report[name] == {"skipped": "no CUDA device"}
               for name in ("staging", "ftpg_nccl", "nccl_phases", "snapshot_overlap", "overlap_events", "device_timing"))
    stop = report["stop_agreement"]  # asked at step 50, agreed 2 steps later, with 3 flags for 200 steps
    assert (stop["first_true_at"], stop["buffers"]) == (52, 3), stop
