"""Per-rank progress beacons for the hang observer (docs/scout.md "Hang observer").

A beacon is a small fixed-size record in a memory-mapped file, ``<run>/beacons/replica{i}/rank{r}``, that the rank's
main thread overwrites as it goes: step, phase, collective sequence number, a fingerprint and short description of
the collective (op / group / shape), the time, the pid. Writing one is a ``struct.pack_into`` into shared memory:
no system call, no message; the observer process on the same node reads the files. A version counter is bumped
before and after every write (odd while writing), so a reader never takes a half-written record.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

_FORMAT = "<QqiqIdq48s"
SIZE = struct.calcsize(_FORMAT)
PHASES = ("startup", "forward", "backward", "reduction", "commit", "rebuild", "optimizer", "transfer",
          "rejoin_wait", "collective", "done")


def beacon_path(run_dir: str, replica: int, rank: int, incarnation: int = 0) -> str:
    """One folder per start of a replica group: a restart never reads its predecessor's beacons."""
    return os.path.join(run_dir, "beacons", f"replica{replica}", f"start{incarnation}", f"rank{rank}")


@dataclass(frozen=True)
class BeaconRecord:
    step: int
    phase: str
    seq: int
    """Collectives this rank has entered (the one it is in, while ``phase == "collective"``)."""
    op_fingerprint: int
    op: str
    time: float
    pid: int


def collective_fingerprint(op: str, group: str, shape) -> tuple[int, str]:
    text = f"{op}|{group}|{tuple(shape)}"
    return zlib.crc32(text.encode()), text[:48]


class Beacon:
    """The writing side (one per rank, main thread only)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._version = 0
        self.step, self.phase, self.seq, self.fingerprint, self.op = 0, "startup", 0, 0, ""
        self._write()

    def _write(self) -> None:
        self._version += 1  # odd while the fields are written, even once they are all there
        struct.pack_into(_FORMAT, self._map, 0, self._version, self.step, PHASES.index(self.phase), self.seq,
                         self.fingerprint, time.time(), os.getpid(), self.op.encode()[:48])
        self._version += 1
        struct.pack_into("<Q", self._map, 0, self._version)

    def update(self, step: int | None = None, phase: str | None = None) -> None:
        if step is not None:
            self.step = step
        if phase is not None and phase in PHASES:
            self.phase = phase
        self._write()

    @contextmanager
    def collective(self, op: str, group: str, shape):
        """Mark the rank inside its next collective (entered before it is issued, left when it completed)."""
        before = self.phase
        self.seq += 1
        self.fingerprint, self.op = collective_fingerprint(op, group, shape)
        self.phase = "collective"
        self._write()
        try:
            yield
        finally:
            self.phase = before
            self._write()

    def close(self, done: bool = True) -> None:
        if done:
            self.phase = "done"
            self._write()
        self._map.close()


def read_beacon(path: str, attempts: int = 5) -> BeaconRecord | None:
    """The newest complete record, or None if the file is not there (yet)."""
    try:
        with open(path, "rb") as fh:
            for _ in range(attempts):
                raw = fh.read(SIZE)
                fh.seek(0)
                if len(raw) < SIZE:
                    return None
                version, step, phase, seq, fingerprint, when, pid, op = struct.unpack(_FORMAT, raw)
                again = struct.unpack("<Q", fh.read(8))[0]
                fh.seek(0)
                if version % 2 == 0 and version > 0 and again == version:
                    return BeaconRecord(step, PHASES[phase], seq, fingerprint, op.rstrip(b"\0").decode(errors="replace"),
                                        when, pid)
                time.sleep(0.001)
    except FileNotFoundError:
        return None
    return None
