"""benchmarks/protocol_scale.py: its pure parts (sizes, CPU % from /proc samples, percentiles, the table and the
headline), the counting store proxy, and one tiny end-to-end run (multiprocess)."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("protocol_scale", ROOT / "benchmarks" / "protocol_scale.py")
scale = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("protocol_scale", scale)  # its dataclass looks its module up
_spec.loader.exec_module(scale)

HEADLINE = re.compile(r"^members=(\d+) epoch_s=(\S+) epoch_requests=(\S+) barrier_ms=(\S+) step_requests=(\S+) "
                      r"requests_per_s=(\S+) coordinator_cpu=(\S+) wake_ms=(\S+) enter_s=(\S+) published_s=(\S+)$")


def test_sizes_are_positive_multiples_of_the_ranks_per_replica():
    assert scale.parse_sizes("8,64,512,1024", 8) == [8, 64, 512, 1024]
    assert scale.parse_sizes("4", 2) == [4]
    with pytest.raises(ValueError, match="not a multiple of --ranks-per-replica 8"):
        scale.parse_sizes("8,12", 8)
    with pytest.raises(ValueError, match="positive member counts"):
        scale.parse_sizes("8,,16", 8)
    with pytest.raises(ValueError, match="positive member counts"):
        scale.parse_sizes("0", 1)


def test_cpu_ticks_are_utime_plus_stime_even_with_a_command_name_holding_spaces_and_parentheses():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    stat = "4242 (python (worker) 1) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 75 3 1 20 0 9 0 100 0 0"
    assert scale.cpu_ticks(stat) == 325


def test_cpu_percent_is_of_one_core_over_the_wall_time_between_samples():
    assert scale.cpu_percent((10.0, 1000), (12.0, 1100), ticks_per_s=100) == pytest.approx(50.0)
    assert scale.cpu_percent((0.0, 0), (1.0, 200), ticks_per_s=100) == pytest.approx(200.0)  # two cores busy
    with pytest.raises(ValueError, match="in order"):
        scale.cpu_percent((2.0, 0), (2.0, 10), ticks_per_s=100)


def test_host_busy_counts_idle_and_iowait_as_not_busy():
    before = [100, 0, 50, 800, 50, 0, 0, 0]
    after = [200, 0, 100, 1000, 100, 0, 0, 0]  # +150 busy, +250 idle or waiting
    assert scale.host_busy_percent(before, after) == pytest.approx(37.5)


def test_percentile_interpolates_between_closest_ranks():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert scale.percentile(values, 0.5) == 3.0
    assert scale.percentile(values, 0.9) == pytest.approx(4.6)
    assert scale.percentile([7.0], 0.9) == 7.0
    assert math.isnan(scale.percentile([], 0.9))


def test_hosting_says_processes_and_threads():
    assert scale.hosting(1024, 4) == "4 proc x 256 thr"
    assert scale.hosting(8, 4) == "4 proc x 2 thr"
    assert scale.hosting(2, 4) == "2 proc x 1 thr"


def test_headline_and_table_row_of_a_measured_size_and_of_a_size_without_a_kill():
    measured = {"size": 64, "members": 64, "groups": 8, "hosting": "4 proc x 16 thr", "requests_per_s": 3139.4,
                "coordinator_cpu": 13.42, "barrier_median_ms": 11.23, "barrier_p90_ms": 17.8, "epoch_s": 0.5234,
                "epoch_requests": 412.0, "step_requests": 24.0, "wake_median_ms": 4.56,
                "enter_s": 0.0123, "published_s": 0.5111}
    assert scale.headline(measured) == ("members=64 epoch_s=0.523 epoch_requests=412 barrier_ms=11.2 "
                                        "step_requests=24 requests_per_s=3139 coordinator_cpu=13.4 wake_ms=4.6 "
                                        "enter_s=0.012 published_s=0.511")
    row = scale.table_row(measured)
    assert row.split() == ["64", "64", "8", "4", "proc", "x", "16", "thr", "3139", "13.4", "11.2", "17.8", "4.6",
                           "0.523"]
    single = {key: value for key, value in measured.items() if key not in ("epoch_requests", "enter_s", "published_s")}
    single.update(epoch_s=None, note="one replica group: no survivor to form an epoch after a kill")
    assert HEADLINE.match(scale.headline(single)).group(2, 3, 9, 10) == ("nan",) * 4
    assert " - " in scale.table_row(single) and scale.table_row(single).endswith("after a kill")


def test_the_counting_store_counts_every_request_and_a_killed_one_makes_none():
    class Store:
        port = 1234

        def check(self, keys):
            return True

        def get(self, key):
            return b"v"

    counter = scale.RequestCounter()
    store = scale.CountingStore(Store(), counter)
    assert store.check(["a"]) and store.get("a") == b"v" and store.check(["b"])
    assert store.port == 1234  # attributes pass through uncounted
    assert counter.value() == 3
    assert counter.value() == 3  # reading does not count
    store.dead = True
    with pytest.raises(ConnectionError, match="simulated kill"):
        store.get("a")
    assert counter.value() == 3


def test_workers_host_whole_replica_groups_round_robin():
    assigned = scale.assign_groups(groups=3, ranks_per_replica=2, workers=2)
    assert assigned == [[(0, 0), (0, 1), (2, 0), (2, 1)], [(1, 0), (1, 1)]]
    assert scale.assign_groups(1, 8, 4)[1:] == [[], [], []]


@pytest.mark.multiprocess
def test_a_tiny_run_prints_a_finite_headline(tmp_path):
    """The benchmark runs end to end and prints its headline. What is asserted is the output, not the time: the
    run's timeout only ends a hang (starting its processes, each importing torch, takes tens of seconds on a busy
    machine), inside pytest's own per-test timeout."""
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/protocol_scale.py", "--sizes", "4", "--ranks-per-replica", "2", "--workers", "2",
         "--window", "1", "--settle", "0.2", "--repeats", "2", "--kills", "1", "--form-timeout", "30",
         "--wait-timeout", "10", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    match = HEADLINE.match(proc.stdout.strip().splitlines()[-1])
    assert match, proc.stdout[-2000:]
    assert int(match.group(1)) == 4
    assert all(math.isfinite(float(x)) for x in match.groups()[1:])
    # a step's look and barrier: per group, the leader's look (1), its count-in (1) and the decision (a wait and a
    # read, or the last group's compare-and-set); the commit's writer deletes the step before's 2 keys. Ranks that
    # looked in the job's store each would make 3 requests more per rank.
    assert float(match.group(5)) <= 4 * 2 + 2
    measured = json.loads(out.read_text())["sizes"][0]
    assert len(measured["barrier_ms"]) == len(measured["wake_ms"]) == 2  # a wake after each barrier step
