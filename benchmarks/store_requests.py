#!/usr/bin/env python3
"""Requests a real job makes to its store on etcd: the requests etcd served while one job ran alone on it, by gRPC
method, read from etcd's own counters (``/metrics``: ``grpc_server_handled_total`` and
``process_cpu_seconds_total``) before the launcher starts and after it exits. The job's every process is counted
(launchers, coordinators, members, DiLoCo syncer and learners), start-up and end included; anything else the
same etcd serves meanwhile (another client, another job) would be counted too, so give the job an etcd of its
own.

    etcd --data-dir /tmp/etcd-requests --listen-client-urls http://127.0.0.1:2379 \\
         --advertise-client-urls http://127.0.0.1:2379 &
    python benchmarks/store_requests.py --etcd 127.0.0.1:2379 [--rounds 3] [-- LAUNCHER ARGUMENTS ...]

The default job is ``train_configs/replicas.toml`` with the tiny model, 3 replica groups of 1 process, 40 steps;
arguments after ``--`` replace it (a config and its overrides, as ``./run_train.sh`` takes them; the store and
the dump folder are set here). Each round is one job; the table has one row per round and the requests of each
method in the last round.

Last line, medians over the rounds: ``requests=... requests_per_s=... requests_per_step=... etcd_cpu_s=...
wall_s=...`` (``requests_per_s`` over the launcher's whole wall time).
Output also written to docs/results/store_requests.txt (``--out`` to change; benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402

DEFAULT_JOB = ("train_configs/replicas.toml", "--model.flavor", "tiny", "--metrics.no_enable_wandb",
               "--recover.replicas", "3", "--parallelism.data_parallel_shard_degree", "1", "--training.steps", "40")
_SAMPLE = re.compile(r'^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> tuple[dict[str, float], float]:
    """Requests etcd handled so far by gRPC method (``grpc_server_handled_total``, every code and service summed
    per method) and its CPU seconds (``process_cpu_seconds_total``), from its Prometheus text."""
    handled: dict[str, float] = collections.defaultdict(float)
    cpu = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        if match["name"] == "grpc_server_handled_total":
            labels = dict(_LABEL.findall(match["labels"] or ""))
            handled[labels.get("grpc_method", "?")] += float(match["value"])
        elif match["name"] == "process_cpu_seconds_total":
            cpu = float(match["value"])
    return dict(handled), cpu


def difference(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Requests per method between two readings (methods never called in between left out)."""
    return {m: int(after[m] - before.get(m, 0.0)) for m in after if after[m] - before.get(m, 0.0) > 0}


def read_metrics(endpoint: str) -> tuple[dict[str, float], float]:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
        return parse_metrics(response.read().decode())


def one_job(endpoint: str, job: list[str], steps: int, timeout_s: float) -> dict:
    """One job on the etcd at ``endpoint`` under a key prefix of its own; what etcd served meanwhile."""
    with tempfile.TemporaryDirectory(prefix="store_requests_") as folder:
        before, cpu_before = read_metrics(endpoint)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "titan_recover.launch", *job,
                               "--recover.store", f"etcd://{endpoint}/bench-{uuid.uuid4().hex[:12]}",
                               "--dump_folder", folder], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        wall = time.monotonic() - start
        after, cpu_after = read_metrics(endpoint)
    if proc.returncode != 0:
        raise SystemExit(f"the job failed (exit {proc.returncode}); its output:\n{proc.stdout[-3000:]}"
                         f"{proc.stderr[-3000:]}")
    methods = difference(before, after)
    total = sum(methods.values())
    return {"methods": methods, "requests": total, "wall_s": wall, "etcd_cpu_s": cpu_after - cpu_before,
            "requests_per_s": total / wall, "requests_per_step": total / steps}


def steps_of(job: list[str]) -> int:
    if "--training.steps" in job:
        return int(job[job.index("--training.steps") + 1])
    raise SystemExit("give the job's --training.steps among its arguments (requests per step need it)")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    job = list(DEFAULT_JOB)
    if "--" in argv:
        job, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", required=True, help="HOST:PORT of an etcd (>= 3.4) member's client URL, "
                                                      "serving nothing but this job")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="a job's bound (default 900 s)")
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv + (["--", *job] if job != list(DEFAULT_JOB) else []), args.out):
        measure(args, job)


def measure(args, job: list[str]) -> None:
    steps = steps_of(job)
    print(f"job: {' '.join(job)}")
    print(f"{'round':>5} {'requests':>9} {'wall s':>7} {'req/s':>7} {'req/step':>9} {'etcd CPU s':>10}")
    runs = []
    for round_ in range(args.rounds):
        run = one_job(args.etcd, job, steps, args.timeout_s)
        runs.append(run)
        print(f"{round_:>5} {run['requests']:>9} {run['wall_s']:>7.1f} {run['requests_per_s']:>7.1f} "
              f"{run['requests_per_step']:>9.1f} {run['etcd_cpu_s']:>10.2f}", flush=True)
    print(f"requests by method, round {args.rounds - 1}: " + ", ".join(
        f"{method} {count}" for method, count in sorted(runs[-1]["methods"].items(), key=lambda kv: -kv[1])))
    keys = ("requests", "requests_per_s", "requests_per_step", "etcd_cpu_s", "wall_s")
    median = {k: statistics.median(r[k] for r in runs) for k in keys}
    spread = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in keys}
    print("spread (min-max): " + ", ".join(f"{k} {lo:.1f}-{hi:.1f}" for k, (lo, hi) in spread.items()))
    print(f"requests={median['requests']:.0f} requests_per_s={median['requests_per_s']:.1f} "
          f"requests_per_step={median['requests_per_step']:.1f} etcd_cpu_s={median['etcd_cpu_s']:.2f} "
          f"wall_s={median['wall_s']:.1f}")


if __name__ == "__main__":
    main()
