#!/usr/bin/env python3
"""How long the reverse DNS lookups that c10d makes of a store's peers take on this host (docs/deploy.md "Network
interfaces"): ``--lookups`` reverse lookups (``getnameinfo``, as c10d's ``formatSockAddr`` calls it: the name wanted,
the number given back when there is none) of ``::ffff:127.0.0.1``, the address a TCPStore on loopback sees, one after
the other in one process, under each resolver setting given (``RES_OPTIONS``; glibc reads it once per process, so
each setting runs in a child process of its own): the lookups slower than ``--slow-s`` (which ones, how long), the
failed ones, and the median.

    python benchmarks/reverse_lookups.py [--lookups 300] [--slow-s 0.1] [--options "" "timeout:1" "use-vc ..."]

The defaults: glibc's own settings, the 1 s timeout, and what the test suite sets (tests/conftest.py). Last line:
``slow_default=... slow_s_default=... failed_default=... slow_<n>=...`` for the settings in order (``<n>`` their
index from 1 after the default). Output also written to docs/results/reverse_lookups.txt (benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402

ADDRESS = "::ffff:127.0.0.1"
TEST_SUITE_OPTIONS = "use-vc timeout:1 attempts:1"


def lookups(count: int) -> list[tuple[float, bool]]:
    """(seconds, failed) of each of ``count`` reverse lookups of :data:`ADDRESS`, in turn, in this process."""
    out = []
    for i in range(count):
        started = time.perf_counter()
        try:
            socket.getnameinfo((ADDRESS, 40000 + i % 20000, 0, 0), 0)
            failed = False
        except OSError:
            failed = True
        out.append((time.perf_counter() - started, failed))
    return out


def measure_in_child(options: str, count: int) -> list[tuple[float, bool]]:
    env = {k: v for k, v in os.environ.items() if k != "RES_OPTIONS"}
    if options:
        env["RES_OPTIONS"] = options
    done = subprocess.run([sys.executable, __file__, "--child", str(count)], env=env, capture_output=True, text=True,
                          check=True, timeout=count * 12 + 60)
    return [tuple(row) for row in json.loads(done.stdout)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookups", type=int, default=300)
    parser.add_argument("--slow-s", type=float, default=0.1)
    parser.add_argument("--options", nargs="*", default=["", "timeout:1", TEST_SUITE_OPTIONS],
                        help="RES_OPTIONS values, one child process each; the empty one: glibc's defaults")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(lookups(args.child)))
        return 0
    with recorded(__file__, argv, args.out):
        measure(args)
    return 0


def measure(args) -> None:
    print(f"{args.lookups} reverse lookups of {ADDRESS} in one process for each resolver setting "
          f"(nameserver(s): {_nameservers()}); slow: over {args.slow_s} s")
    headline = []
    for index, options in enumerate(args.options):
        rows = measure_in_child(options, args.lookups)
        slow = [(i + 1, s) for i, (s, _) in enumerate(rows) if s > args.slow_s]
        failed = sum(f for _, f in rows)
        median = statistics.median(s for s, _ in rows)
        which = ", ".join(f"#{i} {s:.2f} s" for i, s in slow) or "none"
        setting = options or "(unset)"
        print(f"RES_OPTIONS={setting!r:32s} slow {len(slow):3d} of {len(rows)} ({which}); failed {failed}; median "
              f"{median * 1e3:.2f} ms")
        name = "default" if not options else str(index)
        headline += [f"slow_{name}={len(slow)}", f"slow_s_{name}={sum(s for _, s in slow):.2f}",
                     f"failed_{name}={failed}"]
    print(" ".join(headline))


def _nameservers() -> str:
    try:
        with open("/etc/resolv.conf") as conf:
            found = [line.split()[1] for line in conf if line.startswith("nameserver") and len(line.split()) > 1]
    except OSError:
        found = []
    return ", ".join(found) or "none listed"


if __name__ == "__main__":
    sys.exit(main())
