"""What an offline wandb run holds, read from its ``run-<id>.wandb`` file (a LevelDB-style log of wandb's protobuf
records, the file ``wandb sync`` uploads): the run's name, group and project, and its history by step."""

from __future__ import annotations

import json
import pathlib
import struct
import time
from dataclasses import dataclass, field

_BLOCK, _HEADER = 32768, 7
_FULL, _LAST = 1, 4


def records(path: pathlib.Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb data file"
    pos, pending = 7, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if kind == 0 and length == 0:
            pos += _BLOCK - pos % _BLOCK
            continue
        pending += data[pos:pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@dataclass
class OfflineRun:
    name: str = ""
    group: str = ""
    project: str = ""
    history: dict[int, dict] = field(default_factory=dict)
    """``{step: {key: value}}``, every logged row merged by its step."""


def finished_records(path: pathlib.Path, timeout_s: float = 20.0) -> list:
    """The file's records once its run's ``exit`` record is in. ``run.finish()`` can return before wandb's service
    has written the whole file (seen once in a full suite: the file read right after held no ``run`` record yet), so
    this reads again until the exit record is there, ``timeout_s`` at most."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = list(records(path)) if path.stat().st_size >= _HEADER else []
        except DecodeError:  # a record cut where the writer had got to
            found = []
        if any(r.WhichOneof("record_type") == "exit" for r in found):
            return found
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s: the run did not finish"
        time.sleep(0.1)


def read_run(folder: pathlib.Path) -> OfflineRun:
    """The one offline run under ``folder`` (``<folder>/offline-run-*/run-*.wandb``), once it is written whole."""
    files = sorted(folder.glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline wandb run under {folder}, found {files}"
    run = OfflineRun()
    for record in finished_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name, run.group, run.project = record.run.display_name, record.run.run_group, record.run.project
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run.history.setdefault(int(row["_step"]), {}).update(row)
    return run
