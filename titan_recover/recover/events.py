"""Structured resilience events: one JSON object per line in ``<run>/events.jsonl``.

Every process of a run (coordinator, every rank) appends to the same file; each event is written with a single
``write`` on a file opened with ``O_APPEND``, so on a local file system lines from different processes never
interleave. A network file system does not promise that for writers on several hosts (NFS may corrupt appends made
at once by several clients), and a process killed mid-write may leave a partial line: readers skip a line that is
not one JSON object and say how many they skipped. Fields common to
all events: ``time`` (wall clock), ``event`` (kind), ``source`` (``coordinator`` or ``replica/rank``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)


class EventLog:
    def __init__(self, path: str | None, source: str, **context: Any):
        self.path = path
        self.source = source
        self.context = context
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def emit(self, event: str, *, console: bool = True, **fields: Any) -> dict[str, Any]:
        """Append the event to the log (and print it unless ``console`` is false: events of every step)."""
        record = {"time": time.time(), "event": event, "source": self.source, **self.context, **fields}
        if console:
            logger.info("[%s] %s %s", self.source, event, {k: v for k, v in fields.items()})
        if self.path:
            line = (json.dumps(record, default=str) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return record


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every event of ``path`` in file order; a line that is not one JSON object is skipped, with a warning."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as fh:
        return json_records(fh.read().splitlines(), path, "event")


def json_records(lines: list[bytes], path: str | os.PathLike, what: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file's ``lines``; the others (a writer killed mid-line, or lines of several hosts
    interleaved by a network file system) are skipped, and their count said in one warning naming ``what``."""
    records, broken = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            broken += 1
    if broken:
        logger.warning("%s: %d line(s) that are not one %s skipped (a writer killed mid-line, or lines of several "
                       "hosts interleaved by a network file system)", path, broken, what)
    return records
