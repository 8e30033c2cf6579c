"""The job's one metrics run and its readable console, written by the launcher of node 0 (docs/outputs.md).

Every member of a replica-group job appends its per-step metrics to ``<run>/metrics.jsonl`` (one line per replica
and step, tagged ``replica``) and its resilience events to ``<run>/events.jsonl``. A :class:`JobLog` in the
launcher follows both files and hands each committed step, merged over the replicas, and each resilience event to
its sinks: the job's single wandb run (:class:`WandbRun`) and the console (:class:`ConsoleLines`). The launcher
outlives every replica, so a replica's death leaves no gap in the run; a member writes nothing it would not write
anyway, and a sink that fails costs the job nothing.

A step is complete once a line of a later step appears: members commit in lockstep and each logs step ``N``
before it starts step ``N + 1``, whose commit needs every member; at the end every step left is complete. The
files are read metrics first, then events, so an event written before a metrics line is seen with it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Protocol

from titan_recover.recover.events import json_records, node_files

logger = logging.getLogger(__name__)

LOSS = "loss_metrics/global_avg_loss"

PER_REPLICA = ("recover/computed_here", "recover/compute_s", "recover/wait_s", "recover/recovery_s",
               "throughput(tps)", "tflops", "mfu(%)", "time_metrics/", "memory/")
"""Figures that differ between replicas (what a replica computed, its timings and speed, its memory): logged as
``replica<i>/<key>``. Every other key is the same on every member of a step (loss, tokens, members, quotas by
replica) and is logged once."""

ROUTINE_EVENTS = frozenset({
    "step_committed", "block_claimed", "training_started", "snapshot_stored", "fragment_merged", "global_evaluated",
    "final_parameters", "job_finished", "syncer_finished", "learner_finished", "learner_started", "syncer_started",
    "checkpoint_verified", "coordinator_started", "join_requested", "joined", "epoch_entered", "admitted",
    "initial_model",
})
"""Events of every step or of every start: in the table of events, not marked on the charts and not on the
console. Every other kind (a fault injected, a failure detected, an epoch formed, microbatches reassigned, a
replica admitted, a spare promoted, a straggler confirmed, a vote attributed, ...) is a resilience event."""


def is_resilience_event(event: dict[str, Any]) -> bool:
    return event.get("event") not in ROUTINE_EVENTS


def event_step(event: dict[str, Any]) -> int | None:
    """The step an event belongs to: its ``step``, or the step after ``after_step`` (an admission), else None
    (the step being trained when it happened)."""
    step = event.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    after = event.get("after_step")
    return after + 1 if isinstance(after, int) and not isinstance(after, bool) else None


def merge_step(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One wandb record out of the members' lines of one step: the figures every member shares once (the lowest
    replica's), the :data:`PER_REPLICA` figures as ``replica<i>/<key>``, and ``recover/members`` (how many
    replicas logged the step)."""
    merged: dict[str, Any] = {}
    for record in sorted(records, key=lambda r: r.get("replica", 0)):
        replica = record.get("replica")
        for key, value in record.items():
            if key in ("step", "time", "replica") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if replica is not None and key.startswith(PER_REPLICA):
                merged[f"replica{replica}/{key}"] = value
            else:
                merged.setdefault(key, value)
    merged["recover/members"] = len({r.get("replica") for r in records})
    return merged


class JsonlTail:
    """The complete lines appended to a JSONL file since the last read (a line still being written waits)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return json_records(data[:end].splitlines(), self.path, "record")

    def skip_to_end(self) -> None:
        """Lines already in the file are not read."""
        self.offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0


class NodeFilesTail:
    """The complete lines appended to every node's file of a run-wide JSONL file (``events.jsonl``,
    ``events.node1.jsonl``, ...: :func:`~titan_recover.recover.events.node_files`) since the last read, node 0's
    first; a node's file that appears later is read from its start."""

    def __init__(self, path: str):
        self.path = path
        self.tails: dict[str, JsonlTail] = {}

    def _follow_new(self) -> list[JsonlTail]:
        for name in node_files(self.path):
            if name not in self.tails:
                self.tails[name] = JsonlTail(name)
        return list(self.tails.values())

    def read(self) -> list[dict[str, Any]]:
        return [record for tail in self._follow_new() for record in tail.read()]

    def skip_to_end(self) -> None:
        """Lines already in the files are not read (a resumed run's)."""
        for tail in self._follow_new():
            tail.skip_to_end()


class Sink(Protocol):
    def step(self, step: int, record: dict[str, Any], events: list[dict[str, Any]]) -> None:
        """A complete step: its merged record and the resilience events that belong to it."""

    def close(self, events: list[dict[str, Any]]) -> None:
        """The job ended; ``events``: every event of the run, routine ones included."""


class Follower(ABC):
    """Follows JSONL files of a run folder (:attr:`FILES`, without ``.jsonl``) in a thread, calling :meth:`poll`
    every ``poll_s``; from the files' ends at the start (a resumed run's old lines are not logged again) unless
    ``from_start``."""

    FILES: tuple[str, ...] = ()

    def __init__(self, run_dir: str, poll_s: float = 0.5, from_start: bool = False):
        self.tails = {name: NodeFilesTail(os.path.join(run_dir, f"{name}.jsonl")) for name in self.FILES}
        if not from_start:
            for tail in self.tails.values():
                tail.skip_to_end()
        self.poll_s = poll_s
        self.all_events: list[dict[str, Any]] = []
        """Every event read so far, routine ones included."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self):
        self._thread = threading.Thread(target=self._run, name="job-log", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as error:  # noqa: BLE001 - the job trains on; the files keep everything
                logger.warning("job log: reading the run's files failed: %s", error)

    @abstractmethod
    def poll(self) -> None:
        """Read what the files gained since the last call and hand it on (each follower its own way)."""

    def stop_following(self) -> None:
        """Ends the thread (the caller then reads what is left)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


class JobLog(Follower):
    """Follows ``<run>/metrics.jsonl`` and ``<run>/events.jsonl`` and feeds the sinks each complete step."""

    FILES = ("metrics", "events")

    def __init__(self, run_dir: str, sinks: list[Sink], poll_s: float = 0.5, from_start: bool = False):
        super().__init__(run_dir, poll_s, from_start)
        self.sinks = sinks
        self.pending: dict[int, list[dict[str, Any]]] = {}
        self.pending_events: list[dict[str, Any]] = []
        self.last_step = 0
        """The last step handed to the sinks."""

    def poll(self, final: bool = False) -> None:
        for record in self.tails["metrics"].read():
            if not isinstance(record.get("step"), int):
                continue  # not a step's line
            step = record["step"]
            if step > self.last_step:
                self.pending.setdefault(step, []).append(record)
        for event in self.tails["events"].read():
            self.all_events.append(event)
            if is_resilience_event(event):
                self.pending_events.append(event)
        newest = max(self.pending, default=0)
        for step in sorted(self.pending):
            if step < newest or final:
                self._hand_over(step, self.pending.pop(step))

    def _hand_over(self, step: int, records: list[dict[str, Any]]) -> None:
        """Step ``step`` is complete: it carries the events of its own and earlier steps, and those that name no
        step and were written before its last line."""
        written = max((r.get("time", 0.0) for r in records), default=float("inf"))
        mine, later = [], []
        for event in self.pending_events:
            at = event_step(event)
            (mine if (at is not None and at <= step) or (at is None and event.get("time", 0.0) <= written)
             else later).append(event)
        self.pending_events = later
        self.last_step = step
        record = merge_step(records) if records else {}
        for sink in self.sinks:
            try:
                sink.step(step, record, mine)
            except Exception as error:  # noqa: BLE001 - a sink never ends the job
                logger.warning("job log: %s failed at step %d: %s", type(sink).__name__, step, error)

    def close(self) -> None:
        """Stops following, hands every step left over, then closes the sinks."""
        self.stop_following()
        self.poll(final=True)
        if self.pending_events:  # events after the last step (the job's stop): at the step after it
            self._hand_over(self.last_step + 1, [])
        for sink in self.sinks:
            try:
                sink.close(self.all_events)
            except Exception as error:  # noqa: BLE001
                logger.warning("job log: closing %s failed: %s", type(sink).__name__, error)


def _describe(event: dict[str, Any]) -> str:
    """The event's fields (its reason whole, the others cut at 160 characters)."""
    fields = {k: v for k, v in event.items() if k not in ("time", "event", "source", "pid", "step", "reason")}
    text = ", ".join(f"{k}={v}" for k, v in fields.items())
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{text}; reason: {event['reason']}" if event.get("reason") else text


def step_line(step: int, record: dict[str, Any]) -> str:
    """``step 5  loss 7.12345  members 3  recomputed 1  recovery 0.42 s`` (the slowest member's recovery)."""
    recovery = max((v for k, v in record.items() if k.endswith("/recover/recovery_s")), default=0.0)
    loss = record.get(LOSS)
    members = record.get("recover/replicas", record.get("recover/members", 0))
    loss_text = f"{loss:.5f}" if isinstance(loss, (int, float)) else "-"
    return (f"step {step:5d}  loss {loss_text}  members {members}  recomputed "
            f"{int(record.get('recover/recomputed', 0))}  recovery {recovery:.2f} s")


class ConsoleLines:
    """A person's view of a replica-group job: one line per committed step (loss, members, microbatches
    recomputed, recovery time) and one per resilience event."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def step(self, step: int, record: dict[str, Any], events: list[dict[str, Any]]) -> None:
        """The step's events, one line per kind and step (every process that reported it named, the first
        one's fields shown), then the step's line."""
        grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for event in events:
            at = event_step(event)
            grouped.setdefault((str(event.get("event")), at if at is not None else step), []).append(event)
        for (kind, at), same in grouped.items():
            sources = ", ".join(str(e.get("source", "?")) for e in same)
            self.stream.write(f"[event] {kind} (step {at}, {sources}): {_describe(same[0])}\n")
        if record:
            self.stream.write(step_line(step, record) + "\n")
        self.stream.flush()

    def close(self, events: list[dict[str, Any]]) -> None:
        self.stream.flush()


EVENT_COLUMNS = ["step", "kind", "replica", "source", "reason"]


def event_row(event: dict[str, Any], step: int) -> list[Any]:
    replica = event.get("replica", event.get("learner"))
    reason = event.get("reason") or _describe(event)
    return [step, event.get("event"), -1 if replica is None else replica, event.get("source", ""), str(reason)]


class WandbRun:
    """The job's one wandb run: every complete step's merged record at its step, a marker for every resilience
    event (``events/count`` and ``events/<kind>``: how many at that step) and, at the end, the table of events
    (step, kind, replica, source, reason). Offline unless ``[metrics] wandb_mode`` (or ``WANDB_MODE``) says
    otherwise; the table is ``event_table``; the files go under ``<run>/wandb/``, which ``wandb sync`` uploads
    as one run."""

    def __init__(self, *, run_dir: str, project: str, name: str, group: str, mode: str, config: dict | None = None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), name=name, group=group,
                              mode=os.environ.get("WANDB_MODE", mode), dir=run_dir, config=config or {},
                              job_type="train", reinit="create_new")
        self.rows: list[list[Any]] = []

    def step(self, step: int, record: dict[str, Any], events: list[dict[str, Any]]) -> None:
        record = dict(record)
        if events:
            record["events/count"] = len(events)
            for event in events:
                key = f"events/{event.get('event')}"
                record[key] = record.get(key, 0) + 1
        for event in events:
            at = event_step(event)
            self.rows.append(event_row(event, at if at is not None else step))
        self.run.log(record, step=step)

    def close(self, events: list[dict[str, Any]]) -> None:
        self.run.log({"event_table": self.wandb.Table(columns=EVENT_COLUMNS, data=self.rows)})
        self.run.finish()


def run_name(toml_path: str | None, configured: str | None, run_dir: str) -> str:
    """The job's wandb run name: ``[metrics] wandb_run_name``, else the TOML file's name (the run folder's where it
    extends it: ``rejoin-reference``) and the start time."""
    if configured:
        return configured
    folder = os.path.basename(os.path.normpath(run_dir))
    stem = os.path.splitext(os.path.basename(toml_path))[0] if toml_path else folder
    if folder.startswith(f"{stem}-"):
        stem = folder
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


# ---- diloco mode ---------------------------------------------------------------------------------------------
def learner_record(record: dict[str, Any]) -> dict[str, Any]:
    """A learner's metrics line as the job run's row: every figure as ``learner<i>/<key>``, its own step as
    ``learner<i>/step`` (the x-axis of its charts: learners are not in lockstep)."""
    learner = record.get("replica", 0)
    row = {f"learner{learner}/{key}": value for key, value in record.items()
           if key not in ("step", "time", "replica") and isinstance(value, (int, float)) and not isinstance(value, bool)}
    row[f"learner{learner}/step"] = record["step"]
    return row


def syncer_record(record: dict[str, Any]) -> dict[str, Any]:
    """The syncer's line (one per merge or evaluation) as ``syncer/<key>``; ``syncer/merges`` is its x-axis."""
    row = {f"syncer/{key}": value for key, value in record.items()
           if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool)}
    row["syncer/merges"] = record.get("merges", record.get("step", 0))
    return row


class DilocoWandbRun:
    """A diloco job's one wandb run: each learner's figures against its own step (``learner<i>/*`` over
    ``learner<i>/step``), the syncer's against its merges (``syncer/*`` over ``syncer/merges``: the global
    model's validation loss, goodput, quorum), every resilience event as ``events/<kind>`` against the seconds
    since the job started (``elapsed_s``), and the table of events at the end."""

    def __init__(self, *, run_dir: str, project: str, name: str, group: str, mode: str, config: dict | None = None):
        self.inner = WandbRun(run_dir=run_dir, project=project, name=name, group=group, mode=mode, config=config)
        self.run = self.inner.run
        self.run.define_metric("elapsed_s")
        self.run.define_metric("syncer/*", step_metric="syncer/merges")
        self.run.define_metric("events/*", step_metric="elapsed_s")
        self.learners: set[int] = set()
        self.started = time.time()

    def learner(self, record: dict[str, Any]) -> None:
        learner = record.get("replica", 0)
        if learner not in self.learners:
            self.learners.add(learner)
            self.run.define_metric(f"learner{learner}/*", step_metric=f"learner{learner}/step")
        self.run.log(learner_record(record))

    def syncer(self, record: dict[str, Any]) -> None:
        self.run.log(syncer_record(record))

    def event(self, event: dict[str, Any]) -> None:
        at = event_step(event)
        self.inner.rows.append(event_row(event, at if at is not None else -1))
        elapsed = float(event.get("time", time.time())) - self.started
        self.run.log({"elapsed_s": elapsed, "events/count": 1, f"events/{event.get('event')}": 1})

    def close(self, events: list[dict[str, Any]]) -> None:
        self.inner.close(events)


class DilocoJobLog(Follower):
    """Follows a diloco job's ``metrics.jsonl`` (the learners'), ``syncer_metrics.jsonl`` and ``events.jsonl``
    and hands every line to the job's run as it appears (no step to wait for: learners are not in lockstep)."""

    FILES = ("metrics", "syncer_metrics", "events")

    def __init__(self, run_dir: str, sink: DilocoWandbRun, poll_s: float = 0.5):
        super().__init__(run_dir, poll_s)
        self.sink = sink

    def poll(self) -> None:
        try:
            for record in self.tails["metrics"].read():
                if isinstance(record.get("step"), int):
                    self.sink.learner(record)
            for record in self.tails["syncer_metrics"].read():
                self.sink.syncer(record)
            for event in self.tails["events"].read():
                self.all_events.append(event)
                if is_resilience_event(event):
                    self.sink.event(event)
        except Exception as error:  # noqa: BLE001 - the job trains on; the files keep everything
            logger.warning("job log: %s", error)

    def close(self) -> None:
        self.stop_following()
        self.poll()
        try:
            self.sink.close(self.all_events)
        except Exception as error:  # noqa: BLE001
            logger.warning("job log: closing the wandb run failed: %s", error)
