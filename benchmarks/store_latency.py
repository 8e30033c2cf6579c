#!/usr/bin/env python3
"""Latency of the job's store: one client's set, get, add, compare_set and check, one after another, on a
TCPStore (its server in this process) and on etcd (an EtcdStore); the wake-up of a client blocked in ``wait``
when another sets the key; and on etcd the leading coordinator's *fenced* writes (a transaction that applies only
while the leader key is held at the writer's term: docs/deploy.md) against the same writes unfenced, the two
alternating call by call.

    etcd --data-dir /tmp/etcd-bench --listen-client-urls http://127.0.0.1:2379 \\
         --advertise-client-urls http://127.0.0.1:2379 &
    python benchmarks/store_latency.py --etcd 127.0.0.1:2379 [--ops 500]

Prints one line per store and operation: median and 99th percentile in ms. Last line: the medians,
``tcp_get_ms=... etcd_get_ms=... etcd_set_ms=... etcd_add_ms=... etcd_compare_set_ms=... etcd_wake_ms=...
fenced_set_ms=... fenced_vs_plain_set=... fenced_add_ms=... fenced_vs_plain_add=...`` (ratios of the medians of
the alternating calls).
Output also written to docs/results/store_latency.txt (``--out`` to change; benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import threading
import time
import uuid
from datetime import timedelta

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.recover.stores import open_store  # noqa: E402
from titan_recover.recover.stores.leader import LeaderElection  # noqa: E402


def timed(fn, ops: int) -> list[float]:
    samples = []
    for i in range(ops):
        start = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def wake_ms(url: str, prefix: str | None, rounds: int) -> list[float]:
    """Time from one client's set to the return of another's ``wait`` on that key."""
    waiter = open_store(url, timeout=timedelta(seconds=30), prefix=prefix)
    setter = open_store(url, timeout=timedelta(seconds=30), prefix=prefix)
    samples = []
    for i in range(rounds):
        stamp = {}
        thread = threading.Thread(target=lambda: (time.sleep(0.05), stamp.setdefault("set", time.perf_counter()),
                                                  setter.set(f"wake/{i}", "1")))
        thread.start()
        waiter.wait([f"wake/{i}"])
        samples.append((time.perf_counter() - stamp["set"]) * 1000)
        thread.join()
    return samples


def measure(name: str, url: str, prefix: str | None, ops: int) -> dict[str, float]:
    """Each operation's median in ms, after printing its median and 99th percentile."""
    store = open_store(url, timeout=timedelta(seconds=30), prefix=prefix)
    store.set("present", "x" * 64)
    results = {
        "set": timed(lambda i: store.set(f"k/{i}", "x" * 64), ops),
        "get": timed(lambda i: store.get(f"k/{i}"), ops),
        "add": timed(lambda i: store.add("counter", 1), ops),
        "compare_set": timed(lambda i: store.compare_set(f"flag/{i}", "", "raised"), ops),
        "check": timed(lambda i: store.check(["present"]), ops),
        "wait wake-up": wake_ms(url, prefix, max(10, ops // 20)),
    }
    for op, samples in results.items():
        p99 = sorted(samples)[min(len(samples) - 1, int(0.99 * len(samples)))]
        print(f"{name:5s} {op:13s} median {statistics.median(samples):6.2f} ms  p99 {p99:6.2f} ms  "
              f"({len(samples)} ops)")
    return {op: statistics.median(samples) for op, samples in results.items()}


def fenced_vs_plain(url: str, prefix: str, ops: int) -> dict[str, float]:
    """Fenced and unfenced ``set``, ``add`` and ``compare_set`` on the same keys, alternating call by call (so a
    change of the host's load moves both); the fence is a leader key this process holds. Each operation's
    medians in ms, after printing them."""
    store = open_store(url, timeout=timedelta(seconds=30), prefix=prefix)
    election = LeaderElection(store, "leader", "bench")
    election.campaign(timedelta(seconds=30))
    fenced = election.fenced()
    writes = {"set": lambda s, i: s.set(f"w/{i}", "x" * 64), "add": lambda s, i: s.add("wcounter", 1),
              "compare_set": lambda s, i: s.compare_set(f"wflag/{i}", "", "raised")}
    medians = {}
    try:
        for op, write in writes.items():
            samples = {"plain": [], "fenced": []}
            for i in range(ops):
                for kind, client in (("plain", store), ("fenced", fenced)) if i % 2 else \
                        (("fenced", fenced), ("plain", store)):
                    start = time.perf_counter()
                    write(client, f"{kind}/{i}")
                    samples[kind].append((time.perf_counter() - start) * 1000)
            for kind, values in samples.items():
                p99 = sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]
                medians[kind, op] = statistics.median(values)
                print(f"etcd  {kind + ' ' + op:19s} median {medians[kind, op]:6.2f} ms  p99 {p99:6.2f} ms  "
                      f"({len(values)} ops, alternating)")
    finally:
        election.resign()
    return {f"{kind}_{op}": value for (kind, op), value in medians.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", required=True, help="HOST:PORT of an etcd (>= 3.4) member's client URL")
    parser.add_argument("--ops", type=int, default=500)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        compare(args)


def compare(args) -> None:
    """Time both stores; print one line per store and operation, then the headline."""
    server = open_store("127.0.0.1:0", timeout=timedelta(seconds=30), is_server=True)
    tcp = measure("tcp", f"127.0.0.1:{server.port}", None, args.ops)
    etcd = measure("etcd", f"etcd://{args.etcd}", f"bench-{uuid.uuid4().hex}", args.ops)
    writes = fenced_vs_plain(f"etcd://{args.etcd}", f"bench-{uuid.uuid4().hex}", args.ops)
    print(f"tcp_get_ms={tcp['get']:.3f} etcd_get_ms={etcd['get']:.2f} etcd_set_ms={etcd['set']:.2f} "
          f"etcd_add_ms={etcd['add']:.2f} etcd_compare_set_ms={etcd['compare_set']:.2f} "
          f"etcd_wake_ms={etcd['wait wake-up']:.2f} fenced_set_ms={writes['fenced_set']:.2f} "
          f"fenced_vs_plain_set={writes['fenced_set'] / writes['plain_set']:.3f} "
          f"fenced_add_ms={writes['fenced_add']:.2f} fenced_vs_plain_add={writes['fenced_add'] / writes['plain_add']:.3f} "
          f"fenced_vs_plain_compare_set={writes['fenced_compare_set'] / writes['plain_compare_set']:.3f}")


if __name__ == "__main__":
    main()
