"""compare_runs' arithmetic on synthetic curves (no processes)."""

from __future__ import annotations

import json

import pytest

from titan_recover.compare import difference, load_curve, plot


def _write(path, values, extra=None):
    path.mkdir()
    lines = [json.dumps({"step": s, "loss_metrics/global_avg_loss": v}) for s, v in values]
    (path / "metrics.jsonl").write_text("\n".join(lines + (extra or [])) + "\n")


def test_largest_difference_and_resumed_steps(tmp_path):
    _write(tmp_path / "ref", [(1, 4.0), (2, 3.0), (3, 2.0)])
    # step 2 logged twice (a resumed run): the last record counts
    _write(tmp_path / "run", [(1, 4.0), (2, 9.0), (3, 2.5)],
           [json.dumps({"step": 2, "loss_metrics/global_avg_loss": 3.25})])
    ref, run = load_curve(tmp_path / "ref"), load_curve(tmp_path / "run")
    assert run[2] == 3.25
    d = difference(ref, run, "run")
    assert d.max_abs == pytest.approx(0.5) and d.worst_step == 3 and d.common_steps == 3
    assert d.max_rel == pytest.approx(0.25)
    plot({"ref": ref, "run": run}, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_no_common_step_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="shares no step"):
        difference({1: 1.0}, {2: 1.0}, "x")
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        load_curve(tmp_path)


def test_final_parameters_are_compared_bitwise(tmp_path):
    import torch

    from titan_recover.compare import parameter_difference

    for run, bias in (("a", 0.0), ("b", 0.0), ("c", 1e-7)):
        folder = tmp_path / run / "final_parameters"
        folder.mkdir(parents=True)
        torch.save({"w": torch.ones(3), "b": torch.tensor([0.5 + bias])}, folder / "replica0_rank0.pt")
    same = parameter_difference(tmp_path / "a", tmp_path / "b")
    assert (same.files, same.tensors, same.different, same.max_abs) == (1, 2, 0, 0.0)
    off = parameter_difference(tmp_path / "a", tmp_path / "c")
    assert off.different == 1 and 0 < off.max_abs < 1e-6
    with pytest.raises(FileNotFoundError, match="save_final_parameters"):
        parameter_difference(tmp_path / "a", tmp_path)


def _run_folder(path, losses, events=()):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "replica": 0, "time": float(s), "loss_metrics/global_avg_loss": v}) + "\n"
        for s, v in losses))
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_resilience_events_become_marks_at_their_steps(tmp_path):
    """An event's own step, the step after an admission, else the step trained when it was written; routine
    events (every step's commit) are no marks."""
    from titan_recover.compare import event_marks

    _run_folder(tmp_path / "run", [(1, 4.0), (2, 3.0), (3, 2.0)], [
        {"event": "step_committed", "step": 1, "time": 1.0},
        {"event": "fault_injected", "step": 2, "time": 1.5, "replica": 1},
        {"event": "fault_injected", "step": 2, "time": 1.6, "replica": 1},
        {"event": "failure_detected", "time": 1.7, "replica": 1},
        {"event": "replica_admitted", "after_step": 2, "time": 2.5, "replica": 1},
    ])
    assert event_marks(tmp_path / "run") == {2: ["fault_injected", "failure_detected"], 3: ["replica_admitted"]}
    assert event_marks(tmp_path / "nothing") == {}


def test_the_reference_report_and_when_a_reference_is_reused(tmp_path):
    from titan_recover.reference import reference_folder, reference_overrides, report, RESOLVED, reusable

    run, ref = tmp_path / "rejoin", tmp_path / "rejoin-reference"
    assert reference_folder(str(run) + "/") == str(ref)
    assert reference_overrides(["--training.steps", "3"], str(run), None)[-6:] == [
        "--chaos.faults", "[]", "--chaos.random_faults", "0", "--dump_folder", str(ref)]
    _run_folder(run, [(1, 4.0), (2, 3.0), (3, 2.5)], [{"event": "fault_injected", "step": 2, "time": 1.5}])
    _run_folder(ref, [(1, 4.0), (2, 3.0), (3, 2.0)])
    text = report(str(run), str(ref))
    assert "largest |diff| 5.000e-01 at step 3" in text and "common_steps=3" in text
    assert (run / "reference.png").read_bytes()[:4] == b"\x89PNG"
    assert not reusable(str(ref), "config", 3)  # never finished: no resolved config written
    (ref / RESOLVED).write_text("config")
    assert reusable(str(ref), "config", 3)
    assert not reusable(str(ref), "other config", 3) and not reusable(str(ref), "config", 4)
    _run_folder(tmp_path / "same", [(1, 4.0), (2, 3.0), (3, 2.0)])
    assert "steps: equal" in report(str(tmp_path / "same"), str(ref))
