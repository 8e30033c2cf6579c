#!/usr/bin/env python3
"""CPU time of named threads of a run's processes, sampled from Linux /proc while the run goes on.

Which thread of which rank burns the CPU: every ``--every`` seconds, for each process whose command line contains
``--match`` (default: a rank, ``titan_recover.train``), the user and kernel time of each of its threads whose name
is ``--thread`` (default gloo's event loop, ``gloo_tcp_loop``) and of the whole process, and how many such threads
and open file descriptors the process has (what a run leaks per epoch shows as a count that grows). At the end
(Ctrl-C, SIGTERM, or ``--seconds``) it prints one line per run folder (the process's ``TITAN_RECOVER_RUN_DIR``) and
writes them, with the busiest thread's samples, to ``--out`` as JSON.

    python scripts/thread_cpu.py --out /tmp/loops.json &      # then run jobs; kill %1 when they are done

Last line: ``runs=N thread_cpu_s=...`` (the named threads' CPU seconds over every run, summed).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from titan_recover.recover.groups.member import RUN_DIR_ENV  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(stat_path: str) -> tuple[float, float]:
    """(user, kernel) CPU seconds of a process or thread, from its ``stat`` file."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def matching(match: str) -> dict[str, str]:
    """pid -> run folder of every process whose command line contains ``match``."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if match.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        found[pid] = env.get(RUN_DIR_ENV.encode(), b"?").decode()
    return found


def threads_named(pid: str, name: str) -> dict[str, tuple[float, float]]:
    """tid -> (user, kernel) CPU seconds of ``pid``'s threads named ``name``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    out[tid] = cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
    return out


def open_fds(pid: str) -> int:
    """How many file descriptors ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class Tally:
    """Per run folder: the named threads' and the processes' CPU seconds, from the first sample of each to its
    last (a thread or process seen once adds nothing), and the most named threads and open descriptors one
    process of the run had at a sample."""

    def __init__(self):
        self.first: dict[tuple, tuple[float, float]] = {}
        self.last: dict[tuple, tuple[float, float]] = {}
        self.run_of: dict[tuple, str] = {}
        self.samples: dict[tuple, list] = defaultdict(list)
        self.most: dict[str, dict[str, int]] = {}

    def count(self, run: str, threads: int, fds: int) -> None:
        """One process of ``run`` had ``threads`` named threads and ``fds`` open descriptors at a sample."""
        most = self.most.setdefault(run, {"most_threads": 0, "most_fds": 0})
        most["most_threads"] = max(most["most_threads"], threads)
        most["most_fds"] = max(most["most_fds"], fds)

    def see(self, key: tuple, run: str, value: tuple[float, float], now: float) -> None:
        self.first.setdefault(key, value)
        self.last[key] = value
        self.run_of[key] = run
        self.samples[key].append((round(now, 1), round(sum(value), 2)))

    def by_run(self) -> dict[str, dict]:
        runs: dict[str, dict] = defaultdict(lambda: {"thread_user_s": 0.0, "thread_kernel_s": 0.0, "process_s": 0.0,
                                                     "busiest_thread_s": 0.0, "busiest": None, "most_threads": 0,
                                                     "most_fds": 0})
        for run, most in self.most.items():
            runs[run].update(most)
        for key, last in self.last.items():
            first, run = self.first[key], runs[self.run_of[key]]
            user, kernel = last[0] - first[0], last[1] - first[1]
            if key[0] == "process":
                run["process_s"] += user + kernel
                continue
            run["thread_user_s"] += user
            run["thread_kernel_s"] += kernel
            if user + kernel > run["busiest_thread_s"]:
                run["busiest_thread_s"], run["busiest"] = user + kernel, {"pid": key[1], "tid": key[2],
                                                                           "samples": self.samples[key]}
        return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", default="titan_recover.train", help="a process's command line contains this")
    parser.add_argument("--thread", default="gloo_tcp_loop", help="the threads' name (/proc/PID/task/TID/comm)")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: at SIGTERM or Ctrl-C)")
    parser.add_argument("--out", help="write the tally per run folder here, as JSON")
    args = parser.parse_args(argv)

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    tally, start = Tally(), time.monotonic()
    try:
        while not stop and not (args.seconds and time.monotonic() - start >= args.seconds):
            now = time.monotonic() - start
            for pid, run in matching(args.match).items():
                try:
                    tally.see(("process", pid), run, cpu_s(f"/proc/{pid}/stat"), now)
                    named = threads_named(pid, args.thread)
                    for tid, value in named.items():
                        tally.see(("thread", pid, tid), run, value, now)
                    tally.count(run, len(named), open_fds(pid))
                except OSError:  # the process ended meanwhile
                    continue
            time.sleep(args.every)
    except KeyboardInterrupt:
        pass
    runs = tally.by_run()
    for run, row in sorted(runs.items()):
        print(f"{run}: {args.thread} {row['thread_user_s'] + row['thread_kernel_s']:.1f} s "
              f"({row['thread_kernel_s']:.1f} s in the kernel), busiest thread {row['busiest_thread_s']:.1f} s; "
              f"processes {row['process_s']:.1f} s; at most {row['most_threads']} such threads and "
              f"{row['most_fds']} open descriptors in one process")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)
    total = sum(r["thread_user_s"] + r["thread_kernel_s"] for r in runs.values())
    print(f"runs={len(runs)} thread_cpu_s={total:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
