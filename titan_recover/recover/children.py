"""A launcher's child processes: starting one with its output pumped to the console or a file, signalling its
process group, finding every process of a run by the marker in its environment (Linux /proc), and watching a
process's beat in the job's store (recover/launcher.py supervises them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from titan_recover.process_exit import die_with_parent
from titan_recover.recover.diloco.rules import warming
from titan_recover.recover.events import NODE_ENV
from titan_recover.recover.groups.member import INCARNATION_ENV, REPLICA_ENV, RUN_DIR_ENV


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.write(prefix + line.decode(errors="replace"))
        sink.flush()
    if sink is not sys.stdout:
        sink.close()


def spawn(cmd: list[str], env: dict, prefix: str, death_signal: int = signal.SIGKILL,
           log: str | None = None) -> subprocess.Popen:
    """Start a child; its output goes to the console with ``prefix``, or appended to the file ``log``."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent(death_signal))
    sink = sys.stdout
    if log is not None:
        sink = open(log, "a", encoding="utf-8")
        sink.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {proc.pid}: {' '.join(cmd[:6])} ...\n")
        prefix = ""
    threading.Thread(target=_pump, args=(proc.stdout, prefix, sink), daemon=True).start()
    return proc


LAUNCHER_ENV = "TITAN_RECOVER_LAUNCHER"
"""The process id of the launcher that started a process (inherited by everything it starts): a launcher ends only
its own processes, never those of a launcher that replaced it on the same host."""


def processes_of_run(run_dir: str, replica: int | None = None, incarnation: int | None = None,
                     node: int | None = None, launcher: int | None = None) -> list[int]:
    """PIDs whose environment carries this run's marker (and the replica's, incarnation's, node's and launcher's,
    if given); Linux /proc."""
    markers = {f"{RUN_DIR_ENV}={run_dir}".encode()}
    if node is not None:
        markers.add(f"{NODE_ENV}={node}".encode())
    if launcher is not None:
        markers.add(f"{LAUNCHER_ENV}={launcher}".encode())
    if replica is not None:
        markers.add(f"{REPLICA_ENV}={replica}".encode())
    if incarnation is not None:
        markers.add(f"{INCARNATION_ENV}={incarnation}".encode())
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if markers <= set(fh.read().split(b"\0")):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class ReplicaSlot:
    """One process the launcher starts and restarts (a replica group, the syncer, the coordinator) and its current
    start (incarnation)."""

    index: int
    restarts_left: int
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    ended_incarnation: int = -1  # the incarnation this launcher already ended after it was dropped
    observer: subprocess.Popen | None = None  # its hang observer ([recover.localize] hang_threshold_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def count_restart(self, incarnation: int | None = None) -> None:
        """The next start: one restart fewer left, and ``incarnation`` (default: one more than the last); the caller
        starts it."""
        self.restarts_left -= 1
        self.incarnation = self.incarnation + 1 if incarnation is None else incarnation


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal ``proc``'s process group, unless ``proc`` was reaped: its pid, and so its group id, may belong to
    another process by now."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def cpu_threads_per_process(processes: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, processes))


class BeatWatch:
    """How long a process's beat in the store (a value it rewrites while it makes progress) has stayed unchanged,
    on this process's clock, and the bound it is held to: ``timeout_s`` once the process beat, ``start_s`` before
    its first beat (a process start, with its imports, can take much longer than a beat on a loaded node), and
    ``warming_s`` (default ``start_s``) while its beat ends in :data:`~titan_recover.recover.diloco.rules.WARMING`
    (a first compile follows it)."""

    def __init__(self, before_start: bytes, timeout_s: float, start_s: float, warming_s: float | None = None):
        self._first = before_start
        """The beat's value when the process was started (a previous start's): no evidence of this one."""
        self._value: bytes | None = None
        self._since = 0.0
        self.timeout_s, self.start_s = timeout_s, start_s
        self.warming_s = start_s if warming_s is None else warming_s

    def quiet_s(self, value: bytes, now: float) -> tuple[float, float]:
        """(seconds ``value`` has stayed unchanged, the bound that applies now)."""
        if value != self._value:
            self._value, self._since = value, now
        if value == self._first:
            return now - self._since, self.start_s
        return now - self._since, self.warming_s if warming(value) else self.timeout_s
