"""The job's metrics run and console, from the members' files (recover/job_log.py): no processes."""

from __future__ import annotations

import io
import json

from titan_recover.recover.job_log import ConsoleLines, event_step, JobLog, merge_step, run_name

LOSS = "loss_metrics/global_avg_loss"


def line(path, record):
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


class Recorder:
    def __init__(self):
        self.steps, self.closed = [], None

    def step(self, step, record, events):
        self.steps.append((step, record, [e["event"] for e in events]))

    def close(self, events):
        self.closed = [e["event"] for e in events]


def test_a_step_merges_the_members_lines_shared_figures_once_and_speeds_per_replica():
    records = [{"step": 3, "replica": 2, "time": 1.0, LOSS: 7.5, "recover/replicas": 2, "recover/quota/0": 1,
                "throughput(tps)": 90.0, "recover/compute_s": 0.5},
               {"step": 3, "replica": 0, "time": 1.1, LOSS: 7.5, "recover/replicas": 2, "recover/quota/0": 1,
                "throughput(tps)": 110.0, "recover/compute_s": 0.4}]
    merged = merge_step(records)
    assert merged[LOSS] == 7.5 and merged["recover/replicas"] == 2 and merged["recover/quota/0"] == 1
    assert merged["replica0/throughput(tps)"] == 110.0 and merged["replica2/throughput(tps)"] == 90.0
    assert merged["replica2/recover/compute_s"] == 0.5 and "throughput(tps)" not in merged
    assert merged["recover/members"] == 2 and "time" not in merged and "replica" not in merged


def test_event_steps():
    assert event_step({"event": "fault_injected", "step": 5}) == 5
    assert event_step({"event": "replica_admitted", "after_step": 7}) == 8
    assert event_step({"event": "failure_detected", "epoch": 2}) is None


def test_steps_are_handed_over_once_complete_with_their_events(tmp_path):
    """Step N is complete when a line of a later step appears (members commit in lockstep) or at the end; an
    event goes with its own step, one without a step with the step whose lines came after it, routine events
    only to the table; a line already present when the job log starts (a resumed run) is not logged again."""
    metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    line(metrics, {"step": 9, "replica": 0, "time": 0.0, LOSS: 1.0})  # an earlier run's
    recorder = Recorder()
    log = JobLog(str(tmp_path), [recorder])
    line(metrics, {"step": 1, "replica": 0, "time": 1.0, LOSS: 8.0})
    line(metrics, {"step": 1, "replica": 1, "time": 1.0, LOSS: 8.0})
    line(events, {"event": "step_committed", "step": 1, "time": 1.0})
    line(events, {"event": "fault_injected", "step": 2, "time": 1.5, "replica": 1})
    log.poll()
    assert recorder.steps == []  # step 1 may still get lines
    line(events, {"event": "failure_detected", "time": 1.6, "replica": 1})
    line(metrics, {"step": 2, "replica": 0, "time": 2.0, LOSS: 7.0})
    log.poll()
    assert [(s, r[LOSS], r["recover/members"], e) for s, r, e in recorder.steps] == [(1, 8.0, 2, [])]
    with open(metrics, "a") as fh:
        fh.write('{"step": 3, "replica": 0')  # a line still being written
    line(events, {"event": "stopped", "time": 9.0, "reason": "end"})
    log.close()
    assert [(s, e) for s, _, e in recorder.steps] == [(1, []), (2, ["fault_injected", "failure_detected"]),
                                                      (3, ["stopped"])]
    assert recorder.steps[1][1][LOSS] == 7.0 and recorder.steps[2][1] == {}
    assert recorder.closed == ["step_committed", "fault_injected", "failure_detected", "stopped"]


def test_the_console_has_a_line_per_step_and_per_resilience_event():
    out = io.StringIO()
    console = ConsoleLines(out)
    console.step(5, {LOSS: 7.123456, "recover/replicas": 2, "recover/recomputed": 1,
                     "replica0/recover/recovery_s": 0.25, "replica2/recover/recovery_s": 1.5},
                 [{"event": "failure_detected", "source": "coordinator", "replica": 1, "time": 1.0}])
    lines = out.getvalue().splitlines()
    assert lines == ["[event] failure_detected (step 5, coordinator): replica=1",
                     "step     5  loss 7.12346  members 2  recomputed 1  recovery 1.50 s"]


def test_the_run_is_named_after_the_toml_file():
    assert run_name("train_configs/rejoin.toml", None, "/tmp/x").startswith("rejoin-20")
    assert run_name("train_configs/rejoin.toml", None, "outputs/rejoin-reference/").startswith("rejoin-reference-20")
    assert run_name("train_configs/rejoin.toml", "mine", "x") == "mine"
    assert run_name(None, None, "outputs/llama3_tiny").startswith("llama3_tiny-20")


def test_torchtitans_peak_lookup_is_quiet_and_says_whether_it_fell_back():
    """TorchTitan's lookup, as RunMetrics runs it: on CPU it falls back to an A100's peak (so no MFU is computed)
    and its warnings about it are not printed."""
    import logging

    from torchtitan.tools import utils

    from titan_recover.metrics import _PeakLookupLogs

    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root, quiet, known, collect = logging.getLogger(), _PeakLookupLogs(), _PeakLookupLogs(), Collect()
    root.addFilter(quiet)
    root.addHandler(collect)
    try:
        utils.get_peak_flops("cpu")
        assert quiet.fell_back and not [m for m in seen if "fallback" in m or "lspci" in m], seen
        root.addFilter(known)
        utils.get_peak_flops("NVIDIA H100 80GB HBM3")
        assert not known.fell_back
    finally:
        root.removeFilter(quiet)
        root.removeFilter(known)
        root.removeHandler(collect)


def test_an_event_every_process_reported_is_one_console_line():
    out = io.StringIO()
    ConsoleLines(out).step(6, {}, [{"event": "spare_promoted", "step": 6, "source": f"{r}/0", "spares": [3]}
                                   for r in (0, 2, 3)])
    assert out.getvalue() == "[event] spare_promoted (step 6, 0/0, 2/0, 3/0): spares=[3]\n"


def test_a_diloco_job_is_one_wandb_run_each_learner_on_its_own_step(tmp_path, monkeypatch):
    """Diloco learners are not in lockstep: the job's one run holds each learner's lines as ``learner<i>/*`` with
    its own step, the syncer's as ``syncer/*`` (the global model's validation loss among them), and every
    resilience event; lines written before the job log started (a resumed run's) are not logged again."""
    from wandb_offline import read_run

    from titan_recover.recover.job_log import DilocoJobLog, DilocoWandbRun

    monkeypatch.delenv("WANDB_MODE", raising=False)
    metrics, syncer, events = (tmp_path / f"{name}.jsonl" for name in ("metrics", "syncer_metrics", "events"))
    line(metrics, {"step": 50, "replica": 0, "time": 0.0, LOSS: 1.0})  # an earlier run's
    run = DilocoWandbRun(run_dir=str(tmp_path), project="titan_recover", name="diloco-test", group="diloco",
                         mode="offline")
    log = DilocoJobLog(str(tmp_path), run)
    line(metrics, {"step": 1, "replica": 0, "time": 1.0, LOSS: 8.0})
    line(metrics, {"step": 1, "replica": 1, "time": 1.1, LOSS: 8.1})
    line(metrics, {"step": 2, "replica": 0, "time": 1.2, LOSS: 7.5})
    line(syncer, {"step": 1, "time": 1.3, "merges": 1, "val_loss": 7.9, "quorum_size": 2})
    line(events, {"event": "fault_injected", "time": 1.4, "replica": 1, "step": 2, "source": "1/0"})
    line(events, {"event": "fragment_merged", "time": 1.5})  # routine: only in the table
    log.poll()
    log.close()
    logged = read_run(tmp_path / "wandb")
    assert (logged.name, logged.group) == ("diloco-test", "diloco")
    rows = list(logged.history.values())
    learner0 = [(r["learner0/step"], r[f"learner0/{LOSS}"]) for r in rows if "learner0/step" in r]
    assert learner0 == [(1, 8.0), (2, 7.5)]
    assert [(r["learner1/step"], r[f"learner1/{LOSS}"]) for r in rows if "learner1/step" in r] == [(1, 8.1)]
    assert [(r["syncer/merges"], r["syncer/val_loss"]) for r in rows if "syncer/merges" in r] == [(1, 7.9)]
    assert [r["events/fault_injected"] for r in rows if "events/fault_injected" in r] == [1]
    assert not [r for r in rows if "events/fragment_merged" in r]


def test_reading_events_skips_a_broken_line_and_says_so(tmp_path, caplog):
    """A writer killed mid-line, or lines of several hosts interleaved by a network file system: the readers
    (the comparison, --reference) keep every whole event and say how many lines they skipped, not crash."""
    from titan_recover.recover.events import EventLog, read_events

    path = tmp_path / "events.jsonl"
    log = EventLog(str(path), "coordinator")
    log.emit("epoch_formed", console=False, epoch=0)
    with open(path, "a") as fh:
        fh.write('{"time": 1.0, "event": "step_comm\n[1, 2]\n')  # a partial line, and a line that is no event
    log.emit("epoch_formed", console=False, epoch=1)
    assert [e["epoch"] for e in read_events(path)] == [0, 1]
    assert "2 line(s) that are not one event skipped" in caplog.text


def test_each_node_writes_its_own_file_and_every_reader_merges_them(tmp_path, monkeypatch):
    """Appends of several hosts to one file of a network file system may corrupt each other: node r's processes
    write ``events.node<r>.jsonl`` / ``metrics.node<r>.jsonl`` (node 0 the plain names), and the readers (events,
    metrics, the job log's tail, which picks up a node's file that appears later) read every node's."""
    from titan_recover.metrics import JsonlLogger
    from titan_recover.recover.events import EventLog, NODE_ENV, node_path, read_events, read_jsonl
    from titan_recover.recover.job_log import NodeFilesTail

    events, metrics = tmp_path / "events.jsonl", tmp_path / "metrics.jsonl"
    tail = NodeFilesTail(str(metrics))
    monkeypatch.delenv(NODE_ENV, raising=False)  # a process no launcher started: node 0's names
    monkeypatch.delenv("GROUP_RANK", raising=False)
    EventLog(str(events), "coordinator").emit("epoch_formed", console=False, epoch=0)
    JsonlLogger(str(metrics), {"replica": 0}).log({LOSS: 8.0}, step=1)
    monkeypatch.setenv(NODE_ENV, "0")
    JsonlLogger(str(metrics), {"replica": 1}).log({LOSS: 8.0}, step=1)
    assert [r["replica"] for r in tail.read()] == [0, 1]
    for node in (10, 2):  # node 10 after node 2, not before (by number, not name)
        monkeypatch.setenv(NODE_ENV, str(node))
        EventLog(str(events), f"{node}/0").emit("joined", console=False, epoch=0)
        JsonlLogger(str(metrics), {"replica": node}).log({LOSS: 8.0}, step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "events.jsonl", "events.node10.jsonl", "events.node2.jsonl",
        "metrics.jsonl", "metrics.node10.jsonl", "metrics.node2.jsonl"]
    assert [e["source"] for e in read_events(events)] == ["coordinator", "10/0", "2/0"]  # by time
    assert [r["replica"] for r in read_jsonl(metrics)] == [0, 1, 2, 10]  # node 0's first, then by node
    assert sorted(r["replica"] for r in tail.read()) == [2, 10]  # the files that appeared since
    JsonlLogger(str(metrics), {"replica": 11}).log({LOSS: 7.0}, step=2)  # node 2's
    assert [r["replica"] for r in tail.read()] == [11]
    fresh = NodeFilesTail(str(metrics))
    fresh.skip_to_end()
    assert fresh.read() == []
    monkeypatch.delenv(NODE_ENV)  # a job without replica groups: torchrun's node rank names the file
    monkeypatch.setenv("GROUP_RANK", "3")
    assert node_path(str(events)) == str(tmp_path / "events.node3.jsonl")
