#!/usr/bin/env python3
"""How the replica-group protocol's coordination scales with the number of members (docs/benchmarks.md, "Replica
groups: protocol scale"), with members that speak the real protocol code and do not train.

Per size: the job's TCPStore hosted in this process and the real coordinator as its client (``python -m
titan_recover.recover.coordinator_process``), as the launcher starts them (:func:`start_control`), and ``members =
replica groups x ranks per replica`` simulated ranks, each the project's own ``ReplicaMember`` (registration, its
heartbeat thread, ``wait_for_epoch``) with a ``ReplicaSync`` for the commit barrier. Members are threads (one per
member and phase, as the rank's main thread, besides the member's own heartbeat thread), whole replica groups
spread round-robin over ``--workers`` spawned processes, so that one process's GIL is not the bottleneck; a
group's ranks share a store of their own (a ``HashStore`` in their process, where a job has its torchrun's),
through which the group's leader rank relays their beats. Measured:

- ``requests/s``: requests to the job's store the members' clients made over ``--window`` seconds at steady state
  (no step running: heartbeat threads only), counted by a proxy around each member's two store clients (the
  requests to the groups' own stores are counted apart, in the details). It counts client
  requests (a ``get`` is one, although c10d's client waits for the key before it reads it); the coordinator's own
  requests (every 20 ms the ``done_count`` counter and a ``multi_get`` of the groups' beats) are not in it.
  ``coord CPU``: the coordinator process's CPU % of one core over the same window (``/proc/<pid>/stat`` utime +
  stime), the store's server thread included (the JSON splits off its main thread: ``coordinator_loop_cpu``);
- ``barrier``: every member looks at the fault flag (``catch_up``, as a step does before its reduction, with
  ``LOOK_LEAD_S`` more lead for it), then enters ``commit_barrier(step)`` at an agreed wall time; a step's
  latency runs from the last member's entry to the last member holding the decision. Median and p90 over
  ``--repeats`` steps. ``step_requests``: the requests the members' main threads made to the job's store in a step
  (the look and the barrier; median over the steps);
- ``wake``: after each barrier step, the floor under it on the same host at the same time: the parent writes one
  key to the job's store at an agreed time; each group's leader waits for it there and passes it on in its group's
  store, where the other ranks wait for it, as a barrier's decision travels, without the counting in before it.
  From the write to the last member holding the key; median over the steps. A barrier wakes every member twice
  (the leaders when their groups are in, then everyone at the decision);
- ``epoch``: one replica group is killed (its heartbeat threads stopped and every store request of its members
  refused: what a SIGKILL leaves), then a survivor raises the fault flag as a failed collective does
  (``raise_fault_flag``) and every survivor calls ``wait_for_epoch``: the time from the flag to the last survivor
  having entered the new epoch. Median over ``--kills`` kills, each of another group. Each kill's line also says
  when the coordinator noticed the flag and published the epoch, and when the first survivor, the last group
  leader (which reads the epoch in the job's store) and the last survivor were in. The coordinator's own
  detection of a silent member (``heartbeat_timeout_s``) is not measured here. ``epoch_requests``: the members'
  requests to the job's store over the same phase (from the command to the last survivor in, the beats of those
  seconds included; median over the kills): what an epoch change costs the job's store.

What the protocol does instead is reported as the size's outcome, with what was measured before it: a live group
left out of a new epoch (its ranks did not join within ``join_window_s``; a left-out rank ends its process,
which here ends only that member: ``ReplicaMember.on_excluded``), a job stopped for too few replicas, a
step aborted because the coordinator declared a live member dead. A size whose epoch 0 does not form within
``--form-timeout`` seconds is reported as such and the larger sizes are not run. Every wait has a timeout.

Connecting is not measured, but it must not stall the store: when a client connects, c10d looks up the peer's
name (a reverse DNS query) on both sides, the store's in its server thread. On this project's sandboxed host the
resolver drops some of those queries, and with glibc's default retry (5 s, twice) every drop stalled the whole
store for 5 s, about once per 25 connections. The benchmark's processes therefore run with ``RES_OPTIONS =
"timeout:1 attempts:1"`` unless it is set: one lookup then fails after 1 s and no more were made (observed: 52
queries for 100 connections instead of about 4 per connection). ``--connect-rate`` paces the connections instead.

    python benchmarks/protocol_scale.py [--sizes 8,64,512,1024] [--ranks-per-replica 8] [--workers 4]
        [--repeats 7] [--no-look] [--kills 3] [--out FILE.json] [--plot FILE.png]
        [--recover-json '{"join_window_s": 1.0}']

Last line, for the largest size measured: ``members=... epoch_s=... epoch_requests=... barrier_ms=...
step_requests=... requests_per_s=... coordinator_cpu=... wake_ms=... enter_s=... published_s=...`` (``enter_s``:
from the coordinator's publication of the new epoch to the last survivor in; ``published_s``: from the flag to the
publication; medians over the kills) (``nan`` where not measured). The issue's targets at the largest size: epoch
formation after a kill < 1 s, commit barrier < 50 ms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_EPOCH_S = 1.0
TARGET_BARRIER_MS = 50.0
LEAD_S = 0.5
"""How far ahead of now a phase's agreed start time lies (the command reaches every worker and its threads)."""
LOOK_LEAD_S = 1.0
"""More lead before a barrier step: each member looks at the fault flag first (``catch_up``), and those looks
should be over before the agreed time, so that the barrier's latency is measured without them (at 1024 members on
2 cores, threads wake ~0.5 s late)."""


# ---- pure parts (tests/test_protocol_scale.py) ----------------------------------------------------------------


def parse_sizes(text: str, ranks_per_replica: int) -> list[int]:
    """``"8,64,512"`` -> [8, 64, 512]: member counts, each a positive multiple of the ranks per replica."""
    sizes = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) <= 0:
            raise ValueError(f"--sizes takes positive member counts separated by commas, got {text!r}")
        if int(part) % ranks_per_replica:
            raise ValueError(f"size {int(part)} is not a multiple of --ranks-per-replica {ranks_per_replica}")
        sizes.append(int(part))
    return sizes


def cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks) from the text of ``/proc/<pid>/stat`` (or ``/proc/<pid>/task/<tid>/stat``).
    The command name in parentheses may hold spaces and parentheses: fields are counted after the last ``)``."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from field 3 (state)


def cpu_percent(before: tuple[float, int], after: tuple[float, int], ticks_per_s: float) -> float:
    """CPU % of one core between two samples ``(wall seconds, utime + stime ticks)``; 200 = two cores busy."""
    wall = after[0] - before[0]
    if wall <= 0:
        raise ValueError(f"samples must be taken in order, got {before[0]} then {after[0]}")
    return 100.0 * (after[1] - before[1]) / ticks_per_s / wall


def host_busy_percent(before: list[int], after: list[int]) -> float:
    """Busy % of all cores between two samples of ``/proc/stat``'s ``cpu`` line (user nice system idle iowait
    ...): 100 = every core busy."""
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta)
    idle = delta[3] + (delta[4] if len(delta) > 4 else 0)
    return 100.0 * (total - idle) / total if total else 0.0


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between the closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def hosting(members: int, workers: int) -> str:
    """How members were hosted, e.g. ``4 proc x 256 thr``."""
    used = min(workers, members)
    return f"{used} proc x {math.ceil(members / used)} thr"


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


TABLE_HEADER = (f"{'size':>5} {'members':>7} {'groups':>6}  {'hosting':<17} {'requests/s':>10} {'coord CPU %':>11} "
                f"{'barrier med ms':>14} {'p90 ms':>8} {'wake ms':>8} {'epoch_s':>8}  note")


def table_row(result: dict) -> str:
    return (f"{result['size']:>5} {result['members']:>7} {result['groups']:>6}  {result['hosting']:<17} "
            f"{_fmt(result.get('requests_per_s'), '.0f'):>10} {_fmt(result.get('coordinator_cpu'), '.1f'):>11} "
            f"{_fmt(result.get('barrier_median_ms'), '.1f'):>14} {_fmt(result.get('barrier_p90_ms'), '.1f'):>8} "
            f"{_fmt(result.get('wake_median_ms'), '.1f'):>8} {_fmt(result.get('epoch_s'), '.3f'):>8}  "
            f"{result.get('note', '')}").rstrip()


def headline(result: dict) -> str:
    """The last line: the largest size measured."""
    values = {"epoch_s": ("epoch_s", ".3f"), "epoch_requests": ("epoch_requests", ".0f"),
              "barrier_ms": ("barrier_median_ms", ".1f"), "step_requests": ("step_requests", ".0f"),
              "requests_per_s": ("requests_per_s", ".0f"), "coordinator_cpu": ("coordinator_cpu", ".1f"),
              "wake_ms": ("wake_median_ms", ".1f"), "enter_s": ("enter_s", ".3f"),
              "published_s": ("published_s", ".3f")}
    return " ".join([f"members={result['members']}"] + [f"{name}={_fmt(result.get(key), spec, 'nan')}"
                                                         for name, (key, spec) in values.items()])


# ---- the store and the coordinator ---------------------------------------------------------------------------


@dataclass
class Control:
    address: str
    """HOST:PORT of the job's store, which the members connect to."""
    coordinator: subprocess.Popen
    """The process whose CPU is measured (the coordinator; the store's server thread runs in this process, as in
    the launcher)."""
    processes: list[subprocess.Popen]
    """Everything to stop at the end, in order."""
    store: TCPStore | None = None
    """The job's store, hosted here (kept alive as long as the size runs)."""


def start_control(run_dir: str, groups: int, ranks_per_replica: int, fields: dict, timeout_s: float) -> Control:
    """Host the job's store and start the coordinator as the launcher does (``ReplicaJob.host_store``,
    ``start_coordinator``): the store lives in this process, the coordinator is its client."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    address = f"127.0.0.1:{store.port}"
    with open(os.path.join(run_dir, "coordinator.log"), "w") as log:
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "titan_recover.recover.coordinator_process", "--replicas", str(groups),
             "--ranks-per-replica", str(ranks_per_replica), "--run-dir", run_dir, "--store", address,
             "--recover-json", json.dumps(fields)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return Control(address, coordinator, [coordinator], store)


def stop_control(control: Control) -> None:
    for proc in control.processes:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def coordinator_log(run_dir: str, chars: int = 3000) -> str:
    path = os.path.join(run_dir, "coordinator.log")
    if not os.path.exists(path):
        return ""
    with open(path) as fh:
        return fh.read()[-chars:]


# ---- members, in worker processes ----------------------------------------------------------------------------


class RequestCounter:
    """Store requests of one worker's members (``next`` on an ``itertools.count`` is atomic under the GIL)."""

    def __init__(self):
        self._count = itertools.count()
        self._reads = 0

    def add(self) -> None:
        next(self._count)

    def value(self) -> int:
        self._reads += 1  # read from one thread only (the worker's command loop)
        return next(self._count) - (self._reads - 1)


class CountingStore:
    """A member's store client, counting every request; ``dead`` refuses them all (a killed process makes none)."""

    def __init__(self, store, *counters: RequestCounter):
        self._store, self._counters = store, counters
        self.dead = False

    def __getattr__(self, name: str):
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            if self.dead:
                raise ConnectionError("simulated kill: this member makes no more store requests")
            for counter in self._counters:
                counter.add()
            return method(*args, **kwargs)

        self.__dict__[name] = call  # found directly from now on
        return call


def _silence(member) -> None:
    """A killed (or left-out) member's store clients refuse every request from now on."""
    for store in (member.store, member._hb_store, member.group_store, member._hb_group_store):
        if store is not None:
            store.dead = True


def assign_groups(groups: int, ranks_per_replica: int, workers: int) -> list[list[tuple[int, int]]]:
    """(replica, rank) of the members each worker hosts: whole replica groups, round-robin, so that a group's
    ranks share its own store as ranks of one torchrun do."""
    return [[(i, r) for i in range(w, groups, workers) for r in range(ranks_per_replica)] for w in range(workers)]


class _Warnings:
    """A logging handler counting the members' warnings (late heartbeats, failed ones) instead of printing them."""

    def __init__(self):
        import logging

        class Handler(logging.Handler):
            def emit(handler, record):
                text = str(record.msg)
                kind = ("late_beats" if "after the previous one" in text else "failed_beats"
                        if "heartbeat failed" in text else "left_out" if "left out of epoch" in text else "other")
                args = record.args if isinstance(record.args, tuple) else ()
                self.seen.append((kind, args[0] if args else None))
                if kind == "late_beats" and len(args) >= 5:  # (replica, rank, gap, woke late by, store calls took)
                    self.late.append((args[2], args[3], args[4]))

        self.seen: list[tuple[str, int | None]] = []
        self.late: list[tuple[float, float, float]] = []
        """Late beats: (seconds since the previous beat, how late the thread woke, how long its store calls took)."""
        root = logging.getLogger("titan_recover")
        root.addHandler(Handler(logging.WARNING))
        root.propagate = False

    def counts(self, leaving_out: set[int]) -> dict[str, int]:
        """Warnings of members other than the killed replicas (their heartbeat's last calls fail by design)."""
        counts: dict[str, int] = {}
        for kind, replica in self.seen:
            if replica not in leaving_out:
                counts[kind] = counts.get(kind, 0) + 1
        return counts


def _in_threads(members: list, work, timeout_s: float) -> list:
    """Run ``work(member)`` in a thread per member (as each rank's main thread); results in order, or the
    exception's text, or ``"timeout"``."""
    results: list = [None] * len(members)

    def run(i, member):
        try:
            results[i] = work(member)
        except Exception as error:  # reported to the parent, which fails the size
            results[i] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=run, args=(i, m), daemon=True) for i, m in enumerate(members)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for i, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            results[i] = "timeout"
    return results


def _sleep_until(wall: float) -> None:
    time.sleep(max(0.0, wall - time.time()))


class _Host:
    """What one worker process does for one size: its members (each a ``ReplicaSync`` whose ``.member`` is the
    ``ReplicaMember``) and the phases the parent asks for."""

    def __init__(self):
        from titan_recover.recover.groups import member, replica_sync  # noqa: F401 (imported before any size)

        self.warnings = _Warnings()
        self.syncs: list = []
        self.killed: set[int] = set()
        self.dropped: set[int] = set()
        """Replicas the coordinator left out of an epoch although they were alive (their members ended)."""
        self.counter = RequestCounter()
        self.group_counter = RequestCounter()
        """Requests to the replica groups' own stores (torchrun's in a job; a HashStore per group here)."""
        self.main_counter = RequestCounter()
        """Requests of the members' main threads to the job's store (a step's look at the flag and its barrier)."""

    def left_out(self) -> None:
        """A member's replica was left out of an epoch (``ReplicaMember.on_excluded``, called on its heartbeat
        thread): only that member ends: its store clients refuse every request, as after a kill."""
        thread = threading.current_thread()
        for sync in self.syncs:
            if sync.member._thread is thread:
                self.dropped.add(sync.member.replica)  # first: its main thread's next request fails
                _silence(sync.member)
        raise SystemExit(0)  # ends the heartbeat thread (its loop catches Exception only)

    def start(self, address: str, assigned: list, ranks_per_replica: int, fields: dict,
              member_interval_s: float) -> int:
        from titan_recover.recover.config import RecoverConfig
        from titan_recover.recover.events import EventLog
        from titan_recover.recover.groups.member import ReplicaMember
        from titan_recover.recover.groups.replica_sync import ReplicaSync
        from torch.distributed import HashStore

        config = RecoverConfig.from_dict(fields)
        self.syncs, self.killed, self.dropped, self.counter = [], set(), set(), RequestCounter()
        self.group_counter, self.main_counter = RequestCounter(), RequestCounter()
        group_stores = {}  # a group's ranks are all in this process (assign_groups): a store in memory
        self.warnings.seen.clear()
        self.warnings.late.clear()
        began = time.time()
        for k, (replica, rank) in enumerate(assigned):
            _sleep_until(began + k * member_interval_s)  # paced: see --connect-rate
            group = (CountingStore(group_stores.setdefault(replica, HashStore()), self.group_counter)
                     if ranks_per_replica > 1 else None)
            member = ReplicaMember(config, replica=replica, rank=rank, ranks_per_replica=ranks_per_replica,
                                   address=address, on_excluded=self.left_out,
                                   group_store=(lambda g=group: g) if group is not None else None)
            member.store = CountingStore(member.store, self.counter, self.main_counter)
            member._hb_store = CountingStore(member._hb_store, self.counter)  # before register() starts the thread
            self.syncs.append(ReplicaSync(config, member, EventLog(None, f"{replica}/{rank}")))
        for sync in self.syncs:
            sync.member.register()
        return len(self.syncs)

    def join(self, timeout_s: float) -> list:
        def work(sync):
            epoch, members, _ = sync.member.wait_for_epoch(-1, timeout_s)
            return time.time(), epoch, list(members)
        return _in_threads(self.syncs, work, timeout_s + 5)

    def barrier(self, step: int, at: float, timeout_s: float, look: bool = True) -> list:
        """Every member looks at its epoch's fault flag (``catch_up``, as a step does before its reduction), then
        enters ``commit_barrier(step)`` at ``at``: (entered, decided, decision) each, or ``("left out", replica)``
        for a member whose replica the coordinator left out meanwhile. ``look`` False: the barrier alone."""
        def work(sync):
            try:
                # the group's look (older code: each rank's catch_up, which moves on by itself); a flag moves a
                # step to the next epoch, which these members (no process groups) do not take: an outcome
                if look and (sync.look() if hasattr(sync, "look") else sync.catch_up(step)):
                    return "flagged", sync.member.replica
            except Exception:
                if sync.member.replica in self.dropped:
                    return "left out", sync.member.replica
                raise
            _sleep_until(at)
            entered = time.time()
            try:
                decision = sync.commit_barrier(step)
            except Exception:
                if sync.member.replica in self.dropped:
                    return "left out", sync.member.replica
                raise
            return entered, time.time(), decision
        return _in_threads(self.syncs, work, timeout_s)

    def wake(self, key: str, timeout_s: float) -> list:
        """The path of a barrier's decision without the barrier (the floor under its latency on this host): each
        group's leader waits for ``key`` in the job's store, where the parent writes it once, and passes it on in
        its group's store, where the group's other ranks wait for it. Each returns (when it began waiting, when it
        held the key)."""
        from titan_recover.recover.groups.member import wait_for_key

        def work(sync):
            member = sync.member
            follows = member.group_store is not None and not member.leader
            began = time.time()
            if not wait_for_key(member.group_store if follows else member.store, key, timeout_s):
                raise TimeoutError(f"{key} not seen within {timeout_s} s")
            if member.group_store is not None and not follows:
                member.group_store.set(key, "1")
            return began, time.time()
        live = [s for s in self.syncs if s.member.replica not in self.killed | self.dropped]
        return _in_threads(live, work, timeout_s + 5)

    def kill(self, replica: int) -> int:
        """What a SIGKILL of the replica's processes leaves: no more heartbeats, no store request of theirs."""
        victims = [s for s in self.syncs if s.member.replica == replica]
        for sync in victims:
            sync.member._stop.set()
            _silence(sync.member)
        self.killed.add(replica)
        for sync in victims:
            sync.member.close()
            if sync.member._thread.is_alive():
                raise RuntimeError(f"replica {replica} rank {sync.member.rank}: heartbeat thread did not stop")
        return len(victims)

    def epoch(self, after: int, at: float, raiser: tuple[int, int], reason: str, timeout_s: float) -> list:
        """Every live member waits for the epoch after ``after``; ``raiser`` raises the fault flag first. Each
        returns (time it entered, epoch, members, its rank), or ``("left out", replica)``,
        or ``("stopped", replica)`` (the new epoch had too few replicas: the job stops)."""
        from titan_recover.recover.groups.keys import raise_fault_flag
        from titan_recover.recover.groups.member import Excluded, TooFewReplicas

        def work(sync):
            _sleep_until(at)
            if (sync.member.replica, sync.member.rank) == tuple(raiser):  # as a failed collective does
                raise_fault_flag(sync.member.store, after, reason)
            try:
                entered_epoch, members, _ = sync.member.wait_for_epoch(after, timeout_s)
            except TooFewReplicas:
                return "stopped", sync.member.replica
            except Exception as error:
                if isinstance(error, Excluded) or sync.member.replica in self.dropped:
                    return "left out", sync.member.replica
                raise
            return time.time(), entered_epoch, list(members), sync.member.rank
        live = [s for s in self.syncs if s.member.replica not in self.killed | self.dropped]
        return _in_threads(live, work, timeout_s + 5)

    def ready(self) -> int:
        return os.getpid()

    def count(self) -> int:
        return self.counter.value()

    def count_group(self) -> int:
        return self.group_counter.value()

    def count_main(self) -> int:
        return self.main_counter.value()

    def member_warnings(self) -> dict:
        return {"counts": self.warnings.counts(leaving_out=self.killed), "late": self.warnings.late}

    def close(self) -> None:
        for sync in self.syncs:
            sync.member._stop.set()
        for sync in self.syncs:
            sync.member.close()
        self.syncs = []  # their store clients are closed with them


def _worker(conn) -> None:
    """One worker process: runs the parent's commands (a method of :class:`_Host`) until ``exit``."""
    import traceback

    host = _Host()
    while True:
        name, kwargs = conn.recv()
        if name == "exit":
            return
        try:
            conn.send(("ok", getattr(host, name)(**kwargs)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Workers:
    """The worker processes (started once, used by every size) and their command channel: every answer is
    awaited with a timeout, and a worker that died is reported."""

    def __init__(self, count: int):
        context = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for w in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child,), daemon=True, name=f"protocol-scale-worker-{w}")
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.ask("ready", wait_s=180)  # imported what members need

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def ask(self, name: str, wait_s: float, per_worker: list[dict] | None = None, **kwargs) -> list:
        """Send one command to every worker (``per_worker``: arguments of each on top of ``kwargs``); their
        answers in order, each awaited until ``wait_s`` from now."""
        for w, conn in enumerate(self.conns):
            conn.send((name, {**kwargs, **(per_worker[w] if per_worker else {})}))
        deadline = time.monotonic() + wait_s
        answers = []
        for w, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"worker {w} did not finish {name!r} within {wait_s:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError:
                proc.join(5)
                raise RuntimeError(f"worker {w} exited (code {proc.exitcode}) during {name!r}; 75 is a member's "
                                   "heartbeat thread ending its process after its replica was left out of an epoch")
            if status == "error":
                raise RuntimeError(f"worker {w}, {name!r}:\n{value}")
            answers.append(value)
        return answers

    def close_members(self) -> None:
        try:
            self.ask("close", wait_s=30)
        except (TimeoutError, RuntimeError, OSError):
            pass

    def exit(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(("exit", {}))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# ---- the parent: one size ------------------------------------------------------------------------------------


def _proc_ticks(pid: int, tid: int | None = None) -> int:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as fh:
        return cpu_ticks(fh.read())


def _host_sample() -> list[int]:
    with open("/proc/stat") as fh:
        return [int(x) for x in fh.readline().split()[1:]]


def _failures(values: list, what: str) -> None:
    bad = [v for v in values if not isinstance(v, (tuple, list))]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(values)} members failed {what}; first: {bad[0]}")


def measure_load(workers: Workers, coordinator_pid: int, window_s: float) -> dict:
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    pids = [p.pid for p in workers.procs]
    wall0, host0 = time.monotonic(), _host_sample()
    count0, group0 = sum(workers.ask("count", wait_s=30)), sum(workers.ask("count_group", wait_s=30))
    coord0, loop0 = _proc_ticks(coordinator_pid), _proc_ticks(coordinator_pid, coordinator_pid)
    members0 = sum(_proc_ticks(p) for p in pids)
    time.sleep(window_s)
    count1, group1 = sum(workers.ask("count", wait_s=30)), sum(workers.ask("count_group", wait_s=30))
    coord1, loop1 = _proc_ticks(coordinator_pid), _proc_ticks(coordinator_pid, coordinator_pid)
    members1 = sum(_proc_ticks(p) for p in pids)
    wall1, host1 = time.monotonic(), _host_sample()
    return {
        "window_s": wall1 - wall0,
        "requests_per_s": (count1 - count0) / (wall1 - wall0),
        "group_requests_per_s": (group1 - group0) / (wall1 - wall0),
        "coordinator_cpu": cpu_percent((wall0, coord0), (wall1, coord1), ticks_per_s),
        "coordinator_loop_cpu": cpu_percent((wall0, loop0), (wall1, loop1), ticks_per_s),
        "members_cpu": cpu_percent((wall0, members0), (wall1, members1), ticks_per_s),
        "host_busy": host_busy_percent(host0, host1),
    }


class Outcome(Exception):
    """The protocol did something other than what is measured (a step aborted, the job stopped): reported as the
    size's outcome, with what was measured before it."""


def measure_barrier(workers: Workers, step: int, members: int, timeout_s: float, look: bool = True) -> dict:
    counted = sum(workers.ask("count_main", wait_s=30))
    at = time.time() + LEAD_S + LOOK_LEAD_S
    results = [r for answer in workers.ask("barrier", timeout_s + 10, step=step, at=at, timeout_s=timeout_s,
                                           look=look) for r in answer]
    requests = sum(workers.ask("count_main", wait_s=30)) - counted
    left_out = sorted({r[1] for r in results if isinstance(r, tuple) and r[0] == "left out"})
    if left_out:
        raise Outcome(f"step {step}: live replica group(s) {left_out} left out of a new epoch during the barrier")
    if any(isinstance(r, tuple) and r[0] == "flagged" for r in results):
        raise Outcome(f"step {step}: the members' look found the epoch's fault flag raised before the barrier")
    _failures(results, f"the commit barrier of step {step}")
    decisions = {r[2] for r in results}
    if len(results) != members:
        raise RuntimeError(f"step {step}: decisions from {len(results)} of {members} members")
    if decisions != {"commit"}:
        raise Outcome(f"step {step}'s commit barrier decided {sorted(decisions)}: a fault flag was raised")
    last_entry = max(r[0] for r in results)
    return {"latency_ms": 1000 * (max(r[1] for r in results) - last_entry),
            "entry_spread_ms": 1000 * (last_entry - min(r[0] for r in results)), "requests": requests}


def measure_wake(workers: Workers, store: TCPStore, n: int, members: int, timeout_s: float) -> dict:
    """One write to the job's store at an agreed time, waited for by every member as a barrier's decision is
    (:meth:`_Host.wake`): from the write to the last member holding it. A member that began waiting after the
    write (a thread that started late) is counted apart and left out of the latency, as the barrier's latency
    runs from its last entry."""
    key, at, written = f"protocol_scale/wake/{n}", time.time() + LEAD_S + LOOK_LEAD_S, []

    def write():
        _sleep_until(at)
        written.append(time.time())
        store.set(key, "1")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    results = [r for answer in workers.ask("wake", timeout_s + 10, key=key, timeout_s=timeout_s) for r in answer]
    writer.join(timeout_s)
    _failures(results, f"the wake {n}")
    if len(results) != members or not written:
        raise RuntimeError(f"wake {n}: {len(results)} of {members} members held the key")
    on_time = [woke for began, woke in results if began <= written[0]]
    return {"wake_ms": 1000 * (max(on_time) - written[0]) if on_time else math.nan,
            "late_waiters": len(results) - len(on_time)}


def measure_epoch(workers: Workers, epoch: int, members: tuple[int, ...], events_path: str, timeout_s: float) -> dict:
    """Kill the highest member replica, raise the flag from the lowest one's rank 0, time the next epoch."""
    from titan_recover.recover.events import read_events

    victim = max(members)
    survivors = tuple(m for m in members if m != victim)
    killed = sum(workers.ask("kill", wait_s=30, replica=victim))
    counted, began = sum(workers.ask("count", wait_s=30)), time.monotonic()
    at = time.time() + LEAD_S
    results = [r for answer in workers.ask("epoch", timeout_s + 10, after=epoch, at=at, raiser=(survivors[0], 0),
                                           reason=f"protocol_scale: replica {victim} killed", timeout_s=timeout_s)
               for r in answer]
    requests, window_s = sum(workers.ask("count", wait_s=30)) - counted, time.monotonic() - began
    ended = [r for r in results if isinstance(r, tuple) and r[0] in ("left out", "stopped")]
    entered = [r for r in results if r not in ended]
    _failures(entered, f"waiting for the epoch after {epoch}")
    event = next((e for e in read_events(events_path) if e["event"] == "epoch_formed" and e["epoch"] == epoch + 1),
                 None)
    if event is None:
        raise RuntimeError(f"after killing replica {victim}: no epoch {epoch + 1} formed; members: {results[:3]}")
    flagged = event["fault_raised_at"]  # the raiser's own stamp, in the flag
    new_members = tuple(event["members"])
    record = {"victim": victim, "killed_members": killed, "members": new_members, "epoch_s": None, "first_in_s": None,
              "last_leader_in_s": None,
              "dropped_live": sorted(set(survivors) - set(new_members)),
              "stopped": any(r[0] == "stopped" for r in ended),
              "noticed_s": event["coordinator_noticed_at"] - flagged, "published_s": event["time"] - flagged,
              "reason": event["reason"], "requests": requests, "requests_window_s": window_s}
    if entered:
        formed = {(r[1], tuple(r[2])) for r in entered}
        if formed != {(epoch + 1, new_members)}:
            raise RuntimeError(f"after killing replica {victim}: survivors entered {sorted(formed)}, the coordinator "
                               f"formed epoch {epoch + 1} of {new_members}")
        record["epoch_s"] = max(r[0] for r in entered) - flagged
        record["first_in_s"] = min(r[0] for r in entered) - flagged
        record["last_leader_in_s"] = max(r[0] for r in entered if r[3] == 0) - flagged
    return record


def run_size(size: int, args, workers: Workers) -> dict:
    """Start the coordinator and this size's members on ``workers``, measure, stop the members and the
    coordinator."""
    from titan_recover.recover.events import read_events

    ranks = args.ranks_per_replica
    groups = size // ranks
    used = min(len(workers.procs), groups)
    result = {"size": size, "members": size, "groups": groups, "hosting": hosting(size, used),
              "host_load_before": os.getloadavg()[0]}
    connect_s = 2 * size / args.connect_rate if args.connect_rate > 0 else 0.0  # two store clients a member
    fields = {"replicas": groups, "startup_timeout_s": connect_s + args.form_timeout, **json.loads(args.recover_json)}
    assigned = [{"assigned": hosted} for hosted in assign_groups(groups, ranks, len(workers.procs))]
    with tempfile.TemporaryDirectory(prefix="protocol_scale_") as run_dir:
        started = time.monotonic()
        control = start_control(run_dir, groups, ranks, fields, timeout_s=60)
        events = os.path.join(run_dir, "events.jsonl")
        try:
            try:  # epoch 0: every member connected (paced), registered and saw it, within --form-timeout
                workers.ask("start", wait_s=connect_s + args.form_timeout, per_worker=assigned,
                            address=control.address, ranks_per_replica=ranks, fields=fields,
                            member_interval_s=connect_s * used / size)
                joined = [r for a in workers.ask("join", args.form_timeout + 10, timeout_s=args.form_timeout)
                          for r in a]
                _failures(joined, "epoch 0")
                if {(r[1], tuple(r[2])) for r in joined} != {(0, tuple(range(groups)))}:
                    raise RuntimeError(f"members saw {sorted({(r[1], tuple(r[2])) for r in joined})}")
            except (TimeoutError, RuntimeError) as error:
                epochs = [e["epoch"] for e in read_events(events) if e["event"] == "epoch_formed"]
                result.update(error=str(error)[-2000:], note=(
                    f"epoch 0 not formed within {args.form_timeout:.0f} s" if not epochs else
                    f"epoch 0 formed, then epoch(s) {epochs[1:]} left live groups out before every member saw it"
                    if len(epochs) > 1 else "epoch 0 formed without every member"))
                return result
            result["setup_s"] = time.monotonic() - started
            time.sleep(args.settle)
            result.update(measure_load(workers, control.coordinator.pid, args.window))
            steps, wakes, kills = [], [], []
            try:
                for step in range(1, args.repeats + 1):  # a barrier step, then its floor on the same host
                    steps.append(measure_barrier(workers, step, size, args.wait_timeout, look=not args.no_look))
                    wakes.append(measure_wake(workers, control.store, step, size, args.wait_timeout))
                current = tuple(range(groups))
                while len(kills) < args.kills and len(current) >= 2 and not (kills and kills[-1]["stopped"]):
                    kills.append(measure_epoch(workers, len(kills), current, events, args.wait_timeout))
                    current = kills[-1]["members"]
            except Outcome as outcome:
                result["note"] = str(outcome)
            finally:
                summarise(result, steps, kills, groups, wakes)
                result["member_warnings"], late = {}, []
                for answer in workers.ask("member_warnings", wait_s=30):
                    for kind, n in answer["counts"].items():
                        result["member_warnings"][kind] = result["member_warnings"].get(kind, 0) + n
                    late += answer["late"]
                if late:  # where a late beat's time went: its thread woke late (CPU, GIL), or the store was slow
                    result["late_beats"] = {"max_gap_s": max(g for g, _, _ in late),
                                            "median_woke_late_s": statistics.median(w for _, w, _ in late),
                                            "median_store_s": statistics.median(t for _, _, t in late)}
        except (TimeoutError, RuntimeError) as error:
            result.update(note=f"failed: {str(error).splitlines()[0][:120]}", error=str(error)[-2000:])
        finally:
            # the coordinator's verdicts while the members were measured (closing them silences their heartbeats)
            victims = {k["victim"] for k in result.get("kills", [])}
            spurious = [e for e in read_events(events)
                        if e["event"] == "failure_detected" and e["replica"] not in victims]
            workers.close_members()
            stop_control(control)
            if spurious:  # the coordinator declared members dead that were alive: their heartbeats starved
                result["spurious_failures"] = [e["reason"] for e in spurious]
                result["note"] = (result.get("note", "") + f"; the coordinator declared {len(spurious)} live replica "
                                  "group(s) dead (heartbeat timeout)").strip("; ")
            if "error" in result:
                result["coordinator_log"] = coordinator_log(run_dir)
        return result


def summarise(result: dict, steps: list[dict], kills: list[dict], groups: int, wakes: list[dict]) -> None:
    """The size's figures from the barrier steps, wakes and kills measured (all of them, or those before an
    outcome)."""
    if wakes:
        result.update(wake_ms=[w["wake_ms"] for w in wakes],
                      wake_median_ms=statistics.median(w["wake_ms"] for w in wakes),
                      wake_late_waiters=sum(w["late_waiters"] for w in wakes))
    if steps:
        latencies = [s["latency_ms"] for s in steps]
        result.update(barrier_ms=latencies, barrier_median_ms=statistics.median(latencies),
                      barrier_p90_ms=percentile(latencies, 0.9),
                      barrier_entry_spread_ms=statistics.median(s["entry_spread_ms"] for s in steps),
                      step_requests=statistics.median(s["requests"] for s in steps))
    if groups < 2:
        result["note"] = "one replica group: no survivor to form an epoch after a kill"
    if not kills:
        return
    result["kills"] = kills
    timed = [k for k in kills if k["epoch_s"] is not None]
    if timed:
        result["epoch_s"] = statistics.median(k["epoch_s"] for k in timed)
        result["published_s"] = statistics.median(k["published_s"] for k in timed)
        result["enter_s"] = statistics.median(k["epoch_s"] - k["published_s"] for k in timed)
    result["epoch_requests"] = statistics.median(k["requests"] for k in kills)
    dropped = sum(len(k["dropped_live"]) for k in kills)
    if dropped:
        stopped = " and the job stopped" if kills[-1]["stopped"] else ""
        result["note"] = (f"{len(kills)} kill(s) left out {dropped} live replica group(s) as well (not joined within "
                          f"join_window_s){stopped}")


def _group_requests(result: dict, interval: float) -> str:
    if "group_requests_per_s" not in result:
        return ""
    per_round = result["group_requests_per_s"] * interval / result["members"]
    return f" and {per_round:.2f} to its group's own store"


def describe(result: dict) -> str:
    """A line of details under the table for one size."""
    if "requests_per_s" not in result:
        return f"size {result['size']}: {result.get('error', '').strip().splitlines()[-1][:300]}"
    interval = result["heartbeat_interval_s"]
    per_round = result["requests_per_s"] * interval / result["members"]
    line = (f"size {result['size']}: started in {result['setup_s']:.1f} s (coordinator, connections, epoch 0); "
            f"steady state over {result['window_s']:.1f} s: "
            f"{per_round:.2f} requests per member per heartbeat interval ({interval} s) to the job's store"
            f"{_group_requests(result, interval)}, coordinator CPU "
            f"{result['coordinator_cpu']:.1f} % (main thread {result['coordinator_loop_cpu']:.1f} %, the rest is the "
            f"store's server thread), members {result['members_cpu']:.1f} %, host {result['host_busy']:.0f} % busy "
            f"(load {result['host_load_before']:.1f} before)")
    if "barrier_ms" in result:
        line += (f"; barrier ms {', '.join(f'{x:.1f}' for x in result['barrier_ms'])} (entries spread "
                 f"{result['barrier_entry_spread_ms']:.0f} ms; the members' main threads made "
                 f"{result['step_requests']:.0f} requests to the job's store per step, median)")
    if "wake_ms" in result:
        late = result["wake_late_waiters"]
        line += (f"; wake ms {', '.join(_fmt(x, '.1f') for x in result['wake_ms'])}"
                 + (f" ({late} member waits began after the write, left out)" if late else ""))
    for k in result.get("kills", []):
        line += (f"; kill of group {k['victim']}: coordinator noticed the flag +{k['noticed_s']:.3f} s, published "
                 f"+{k['published_s']:.3f} s, first survivor in +{_fmt(k.get('first_in_s'), '.3f')} s, last "
                 f"leader +{_fmt(k.get('last_leader_in_s'), '.3f')} s, last survivor +{_fmt(k['epoch_s'], '.3f')} s, "
                 f"{k['requests']} requests to the job's store from the phase's start to the last survivor in "
                 f"({k['requests_window_s']:.2f} s, beats included)")
        if k["dropped_live"]:
            line += f" ({len(k['dropped_live'])} live groups left out: {k['reason'][-160:]})"
        if k["stopped"]:
            line += " (too few replicas: the job stopped)"
    if result.get("member_warnings"):
        line += f"; member warnings {result['member_warnings']}"
    if result.get("late_beats"):
        late = result["late_beats"]
        line += (f" (late beats: longest gap {late['max_gap_s']:.2f} s; median thread woke "
                 f"{late['median_woke_late_s']:.2f} s late, its store calls took {late['median_store_s']:.2f} s)")
    return line


def plot(results: list[dict], path: str, join_window_s: float, title: str) -> None:
    """Epoch formation and barrier latency against members (log x); sizes without the figure are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, ScalarFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    epoch = [r for r in results if r.get("epoch_s") is not None]
    left.plot([r["members"] for r in epoch], [r["epoch_s"] for r in epoch], "o-", label="flag -> last survivor in")
    left.plot([r["members"] for r in epoch], [r["published_s"] for r in epoch], "^:", color="black",
              label="flag -> coordinator published")
    dropped = [r for r in epoch if any(k["dropped_live"] for k in r["kills"])]
    if dropped:
        left.plot([r["members"] for r in dropped], [r["epoch_s"] for r in dropped], "x", color="red", markersize=12,
                  label="kills also left live groups out")
    left.axhline(TARGET_EPOCH_S, color="grey", linestyle="--", label=f"target {TARGET_EPOCH_S:g} s")
    left.axhline(join_window_s, color="grey", linestyle=":", label=f"join_window_s {join_window_s:g} (the floor)")
    left.set(yscale="log", ylabel="seconds", title="epoch formation after a kill (median)")
    barrier = [r for r in results if r.get("barrier_median_ms") is not None]
    xs = [r["members"] for r in barrier]
    right.plot(xs, [r["barrier_median_ms"] for r in barrier], "o-", label="median")
    right.plot(xs, [r["barrier_p90_ms"] for r in barrier], "s--", label="p90")
    floor = [r for r in barrier if r.get("wake_median_ms") is not None]
    right.plot([r["members"] for r in floor], [r["wake_median_ms"] for r in floor], "^:", color="black",
               label="one write to every member, same path (median)")
    right.axhline(TARGET_BARRIER_MS, color="grey", linestyle="--", label=f"target {TARGET_BARRIER_MS:g} ms")
    right.set(yscale="log", ylabel="ms", title="commit barrier latency")
    sizes = [r["members"] for r in results]
    for ax, shown, what in ((left, epoch, "no epoch measured"), (right, barrier, "no barrier measured")):
        for r in results:
            if r not in shown and not (ax is left and r["groups"] < 2):
                ax.axvline(r["members"], color="red", linestyle=":", alpha=0.6)
                ax.text(r["members"], 0.5, f" {r['members']}: {what}", color="red", rotation=90, fontsize=8,
                        va="center", transform=ax.get_xaxis_transform())
        ax.set_xscale("log")
        ax.set_xticks(sizes, labels=[str(x) for x in sizes])
        ax.minorticks_off()
        ax.set_xlim(min(sizes) / 1.5, max(sizes) * 1.5)
        ax.set_xlabel("members (replica groups x ranks)")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.legend(fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,64,512,1024", help="member counts, comma-separated")
    parser.add_argument("--ranks-per-replica", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4, help="processes the members are spread over")
    parser.add_argument("--repeats", type=int, default=7, help="commit barrier steps per size")
    parser.add_argument("--no-look", action="store_true",
                        help="barrier steps without the members' looks at the fault flag before them")
    parser.add_argument("--kills", type=int, default=3, help="replica groups killed one after another per size")
    parser.add_argument("--window", type=float, default=5.0, help="steady-state window (s) for requests and CPU")
    parser.add_argument("--settle", type=float, default=1.0, help="wait (s) after epoch 0 before the window")
    parser.add_argument("--form-timeout", type=float, default=60.0, help="bound (s) on a size's start and epoch 0")
    parser.add_argument("--wait-timeout", type=float, default=60.0,
                        help="bound (s) on each barrier and epoch wait (a rank waits agree_timeout_s, 60 s, for an epoch)")
    parser.add_argument("--connect-rate", type=float, default=0.0,
                        help="new store connections per second while members start (each opens two; 0: unpaced), "
                             "where a reverse DNS lookup per connection stalls the store (see the module's doc)")
    parser.add_argument("--recover-json", default="{}", help="[recover] fields over the defaults, as JSON")
    parser.add_argument("--out", help="write every size's measurements here (JSON)")
    parser.add_argument("--plot", help="epoch formation and barrier latency against members (PNG)")
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.sizes, args.ranks_per_replica)
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # for every process started from here on
    from titan_recover.recover.config import RecoverConfig

    config = RecoverConfig.from_dict(json.loads(args.recover_json))
    interval = config.heartbeat_interval_s
    results = []
    workers = Workers(min(args.workers, max(sizes)))
    try:
        for size in sizes:
            if not workers.alive():  # a member's heartbeat thread ended its process (see Workers.ask)
                workers.exit()
                workers = Workers(min(args.workers, max(sizes)))
            result = run_size(size, args, workers)
            result["heartbeat_interval_s"] = interval
            results.append(result)
            print(table_row(result), flush=True)
            if "requests_per_s" not in result:
                break  # a larger size would not form its epoch either
    finally:
        workers.exit()
    skipped = sizes[len(results):]
    print(f"\nmembers: threads in spawned processes (one thread per member per phase, and its heartbeat thread), "
          f"{args.ranks_per_replica} ranks per replica group, whole groups spread round-robin over at most "
          f"{args.workers} processes; requests/s counts the members' client requests to the job's store; epoch_s: fault flag raised by a survivor "
          f"-> last survivor entered the new epoch (not the heartbeat-timeout path)")
    print(TABLE_HEADER)
    for result in results:
        print(table_row(result))
    for size in skipped:
        print(f"{size:>5} {size:>7} {size // args.ranks_per_replica:>6}  not run: a smaller size failed")
    for result in results:
        print(describe(result))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "sizes": results}, fh, indent=1)
    if args.plot:
        plot(results, args.plot, config.join_window_s,
             f"replica-group protocol, the real coordinator, a client of the job's store; members: threads in "
             f"{len(workers.procs)} processes, {args.ranks_per_replica} ranks per group; [recover] {args.recover_json}")
    measured = [r for r in results if "requests_per_s" in r]
    if not measured:
        print(headline(results[0]))
        return 1
    print(headline(measured[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
