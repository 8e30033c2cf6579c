#!/usr/bin/env python3
"""What the deadline on every store request costs (titan_recover/recover/stores/bounded.py): ``check`` requests to
an in-process TCPStore server, straight from a client and through a ``BoundedStore`` of the same kind of client,
in ``--rounds`` interleaved rounds of ``--requests`` each; medians and spread in microseconds a request.

    python benchmarks/store_request_bound.py [--rounds 5] [--requests 5000] [--out FILE]

Last line: ``direct_us=... bounded_us=... added_us=...`` (medians over the rounds). Output also written to
docs/results/store_request_bound.txt (benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from datetime import timedelta

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402


def per_request_us(store, requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        store.check(["k"])
    return (time.perf_counter() - started) / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5000)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        measure(args)
    return 0


def measure(args) -> None:
    from torch.distributed import TCPStore

    from titan_recover.recover.stores.bounded import BoundedStore

    def client():
        return TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=60))

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    server.set("k", "v")
    direct, bounded = client(), BoundedStore(client(), "in-process server")
    times = {"direct": [], "bounded": []}
    for _ in range(args.rounds):
        for name, store in (("direct", direct), ("bounded", bounded)):
            times[name].append(per_request_us(store, args.requests))
    for name, values in times.items():
        print(f"{name:8s} median {statistics.median(values):6.1f} us [{min(values):.1f}, {max(values):.1f}] "
              f"rounds: {' '.join(f'{v:.1f}' for v in values)}")
    d, b = statistics.median(times["direct"]), statistics.median(times["bounded"])
    print(f"direct_us={d:.1f} bounded_us={b:.1f} added_us={b - d:.1f}")


if __name__ == "__main__":
    sys.exit(main())
