"""Structured resilience events: one JSON object per line in ``<run>/events.jsonl``.

Every process of a node (coordinator, every rank) appends to its node's file; each event is written with a single
``write`` on a file opened with ``O_APPEND``, so on a local file system lines from different processes never
interleave. A network file system does not promise that for writers on several hosts (NFS may corrupt appends made
at once by several clients), so each node writes its own file (:func:`node_path`: ``events.jsonl`` on node 0,
``events.node1.jsonl`` on node 1, ...; the per-step metrics too) and readers merge them (:func:`read_jsonl`). A
process killed mid-write may leave a partial line: readers skip a line that is not one JSON object and say how many
they skipped. Fields common to all events: ``time`` (wall clock), ``event`` (kind), ``source`` (``coordinator`` or
``replica/rank``).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import time
from typing import Any

logger = logging.getLogger(__name__)

NODE_ENV = "TITAN_RECOVER_NODE"
"""Set by the launcher in every child's environment: the node rank (its processes' files, and the processes a
launcher's cleanup ends: several "nodes" may share a machine in tests)."""


def node_path(path: str) -> str:
    """The file a process of this node writes for the run-wide JSONL file ``path``: ``path`` itself on node 0 (and
    in a process no launcher started), ``<stem>.node<r><suffix>`` on node ``r``: writers on several hosts never
    append to one file of a shared file system. The node: the launcher's :data:`NODE_ENV` in a replica-group job,
    else torchrun's ``GROUP_RANK`` (the node's rank in its rendezvous)."""
    node = os.environ.get(NODE_ENV) or os.environ.get("GROUP_RANK", "0")
    if node in ("", "0"):
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.node{node}{suffix}"


def node_files(path: str | os.PathLike) -> list[str]:
    """Every node's file of the run-wide JSONL file ``path`` that exists, node 0's first, then by node rank."""
    path = os.fspath(path)
    stem, suffix = os.path.splitext(path)
    pattern = re.compile(re.escape(os.path.basename(stem)) + r"\.node(\d+)" + re.escape(suffix) + "$")
    others = [(int(m.group(1)), name) for name in glob.glob(f"{glob.escape(stem)}.node*{suffix}")
              if (m := pattern.match(os.path.basename(name)))]
    return ([path] if os.path.exists(path) else []) + [name for _, name in sorted(others)]


class EventLog:
    def __init__(self, path: str | None, source: str, **context: Any):
        self.path = path
        self.source = source
        self.context = context
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.path = node_path(path)

    def emit(self, event: str, *, console: bool = True, **fields: Any) -> dict[str, Any]:
        """Append the event to the log (and print it unless ``console`` is false: events of every step)."""
        record = {"time": time.time(), "event": event, "source": self.source, **self.context, **fields}
        if console:
            logger.info("[%s] %s %s", self.source, event, {k: v for k, v in fields.items()})
        if self.path:
            append_line(self.path, json.dumps(record, default=str))
        return record


def append_line(path: str, line: str) -> None:
    """Append ``line`` and a newline to ``path`` with one ``write`` on an ``O_APPEND`` descriptor: the processes of
    one host sharing the file never interleave, and a crash loses nothing written."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every event of the run-wide file ``path`` (every node's), in time order (each node's in file order where
    times tie); a line that is not one JSON object is skipped, with a warning."""
    return read_jsonl(path, "event", by_time=True)


def read_jsonl(path: str | os.PathLike, what: str = "record", by_time: bool = False) -> list[dict[str, Any]]:
    """The records of the run-wide JSONL file ``path``: every node's file (:func:`node_files`), node 0's first, each
    in file order, or merged by their ``time`` (a stable sort; clocks of different hosts may differ)."""
    records, files = [], node_files(path)
    for name in files:
        with open(name, "rb") as fh:
            records += json_records(fh.read().splitlines(), name, what)
    if by_time and len(files) > 1:
        records.sort(key=lambda record: record.get("time", 0.0) if isinstance(record.get("time"), (int, float))
                     else 0.0)
    return records


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
