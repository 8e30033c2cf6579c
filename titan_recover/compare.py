"""Lay runs' loss curves over each other and measure how far they drift from a reference.

Used by ``scripts/compare_runs.py``; every run is a run folder (its ``metrics.jsonl``, every node's file of it) or
a JSONL file.
"""

from __future__ import annotations

import datetime
import pathlib
import re
from dataclasses import dataclass

LOSS = "loss_metrics/global_avg_loss"


def load_curve(run: str | pathlib.Path, metric: str = LOSS, replica: int | None = None) -> dict[int, float]:
    """``{step: value}`` from a run folder or JSONL file; for a step logged twice (a resumed run, or several
    replica groups logging the same cross-replica loss) the last wins. ``replica`` keeps one replica's lines."""
    path = pathlib.Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl (is it a run folder, i.e. a dump_folder?)")
    curve: dict[int, float] = {}
    for record in _records(path):
        if replica is not None and record.get("replica") != replica:
            continue
        if metric in record:
            curve[int(record["step"])] = float(record[metric])
    if not curve:
        raise ValueError(f"{path}: no {metric!r} values")
    return curve


@dataclass(frozen=True)
class Difference:
    run: str
    common_steps: int
    max_abs: float
    max_rel: float
    worst_step: int


def difference(reference: dict[int, float], other: dict[int, float], name: str = "") -> Difference:
    steps = sorted(set(reference) & set(other))
    if not steps:
        raise ValueError(f"{name or 'run'} shares no step with the reference")
    diffs = [(abs(other[s] - reference[s]), s) for s in steps]
    max_abs, worst = max(diffs)
    max_rel = max(abs(other[s] - reference[s]) / max(abs(reference[s]), 1e-30) for s in steps)
    return Difference(name, len(steps), max_abs, max_rel, worst)


@dataclass(frozen=True)
class ParameterDifference:
    run: str
    files: int
    """Rank files (``final_parameters/replica{i}_rank{k}.pt``) both runs hold."""
    tensors: int
    different: int
    """Tensors not bitwise equal (``torch.equal``)."""
    max_abs: float


def parameter_difference(reference: str | pathlib.Path, other: str | pathlib.Path, name: str = "") -> ParameterDifference:
    """Every final parameter shard both runs saved (``[recover] save_final_parameters``), compared bitwise."""
    import torch

    ours, theirs = pathlib.Path(reference) / "final_parameters", pathlib.Path(other) / "final_parameters"
    files = sorted(f.name for f in ours.glob("*.pt")) if ours.is_dir() else []
    missing = [f for f in files if not (theirs / f).is_file()]
    if not files or missing:
        raise FileNotFoundError(f"{name or other}: final parameters missing ({missing or 'none saved'}); run both "
                                "with --recover.save_final_parameters")
    tensors = different = 0
    max_abs = 0.0
    for f in files:
        a, b = torch.load(ours / f), torch.load(theirs / f)
        if sorted(a) != sorted(b):
            raise ValueError(f"{f}: the runs hold different parameters ({sorted(set(a) ^ set(b))[:4]} ...)")
        for key in a:
            tensors += 1
            if not torch.equal(a[key], b[key]):
                different += 1
                max_abs = max(max_abs, float((a[key].double() - b[key].double()).abs().max()))
    return ParameterDifference(name, len(files), tensors, different, max_abs)


def bitwise_equal(a, b) -> bool:
    """Nested dicts, lists and tuples of tensors and plain values equal bit for bit (tensors also in dtype): how
    runs' saved optimizer and schedule states (``final_optimizer/``) are compared. A list equals a tuple of the same
    items: a state transfer sends the param groups as JSON, which turns AdamW's ``betas`` tuple into a list."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(bitwise_equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(bitwise_equal(x, y) for x, y in zip(a, b)))
    return type(a) is type(b) and a == b


def event_marks(run: str | pathlib.Path) -> dict[int, list[str]]:
    """The resilience events of a run folder by step (``<run>/events.jsonl``; routine events left out, each kind
    once per step): an event's own step, else the step being trained when it was written (the first step whose
    metrics line came after it). Empty without an event log."""
    from titan_recover.recover.events import read_events
    from titan_recover.recover.job_log import event_step, is_resilience_event

    folder = pathlib.Path(run)
    events = [e for e in read_events(folder / "events.jsonl") if is_resilience_event(e)] if folder.is_dir() else []
    if not events:
        return {}
    times = sorted((float(r["time"]), int(r["step"])) for r in _records(folder / "metrics.jsonl") if "time" in r)
    marks: dict[int, list[str]] = {}
    for event in events:
        step = event_step(event)
        if step is None:
            step = next((s for t, s in times if t >= event.get("time", 0.0)), times[-1][1] if times else 0)
        kinds = marks.setdefault(step, [])
        if event["event"] not in kinds:
            kinds.append(event["event"])
    return dict(sorted(marks.items()))


def _records(path: pathlib.Path) -> list[dict]:
    """The records of a run's JSONL file, every node's (``metrics.jsonl``, ``metrics.node1.jsonl``, ...)."""
    from titan_recover.recover.events import read_jsonl

    return read_jsonl(path)


def plot(curves: dict[str, dict[int, float]], out: str | pathlib.Path, metric: str = LOSS,
         marks: dict[str, dict[int, list[str]]] | None = None) -> None:
    """The curves over each other (the first is the reference) and each run's difference from it below; ``marks``
    (a run's :func:`event_marks`) are drawn as vertical lines in the run's colour, named by their kinds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(curves)
    reference = curves[names[0]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i, name in enumerate(names):
        steps = sorted(curves[name])
        style = {"linewidth": 2.5, "alpha": 0.5} if i == 0 else {"linewidth": 1.2, "linestyle": "--"}
        color = f"C{i}"  # the same colour for a run in both panels
        top.plot(steps, [curves[name][s] for s in steps], label=name, color=color, **style)
        if i:
            common = sorted(set(reference) & set(curves[name]))
            bottom.plot(common, [curves[name][s] - reference[s] for s in common], label=name, color=color)
    every_step = [s for curve in curves.values() for s in curve]
    near = 0.08 * (max(every_step) - min(every_step)) if every_step else 0.0
    labelled: tuple[float, float] | None = None  # (step, points below the top where free space starts)
    for i, name, step, kinds in sorted(((i, name, step, kinds) for i, name in enumerate(names)
                                        for step, kinds in (marks or {}).get(name, {}).items()),
                                       key=lambda mark: mark[2]):
        for axis in (top, bottom):
            axis.axvline(step, color=f"C{i}", linestyle=":", linewidth=1.0, alpha=0.8)
        # a label near the one before goes under it instead of over it
        below = labelled[1] if labelled is not None and step - labelled[0] < near else 2.0
        top.annotate("\n".join(kinds), (step, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -below),
                     textcoords="offset points", fontsize=6, color=f"C{i}", va="top", ha="left")
        labelled = (step, below + 7.5 * len(kinds) + 2.0)
    top.set_ylabel(metric)
    top.legend(loc="lower left")
    top.grid(alpha=0.3)
    bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set_ylabel(f"minus {names[0]}")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


_STEP_LINE = re.compile(
    r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?step:\s*(\d+)\s.*?loss:\s*([-\d.naif]+)"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class ConsoleStep:
    """One ``step: N loss: X ...`` line of TorchTitan's console log."""

    time: float  # seconds since the epoch, millisecond resolution
    step: int
    loss: float


def parse_console_steps(text: str) -> list[ConsoleStep]:
    """Steps logged by TorchTitan's metrics processor in a console log (works for stock TorchTitan too)."""
    out = []
    for line in _ANSI.sub("", text).splitlines():
        m = _STEP_LINE.match(line)
        if m:
            stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append(ConsoleStep(stamp, int(m.group(2)), float(m.group(3))))
    return out
