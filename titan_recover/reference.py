"""``./run_train.sh CONFIG --reference``: the run, its failure-free reference, and how far apart they are.

The reference is the same config without ``[chaos]`` (``chaos.faults = []``, ``chaos.random_faults = 0``) in the
sibling folder ``<dump_folder>-reference``, in the same wandb group (the TOML file's name, by default). It is run
unless that folder already holds a complete reference of the same resolved config (its ``reference.toml``, written
once the reference finished, equals the config the reference would run now, and every step is logged). Then the
largest per-step difference of the loss is printed and the overlay written to ``<dump_folder>/reference.png``, the
run's resilience events as vertical marks (:mod:`titan_recover.compare`).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from titan_recover.compare import difference, event_marks, load_curve, LOSS, plot

RESOLVED = "reference.toml"
"""In a reference's folder: the resolved config it ran, written once it finished (what a later run compares)."""

PLOT = "reference.png"


def reference_folder(dump_folder: str) -> str:
    return os.path.normpath(dump_folder) + "-reference"


def reference_overrides(overrides: list[str], dump_folder: str, run_name: str | None) -> list[str]:
    """The run's overrides, then no faults, the sibling folder, and a run name saying it is the reference."""
    extra = ["--chaos.faults", "[]", "--chaos.random_faults", "0", "--dump_folder", reference_folder(dump_folder)]
    if run_name:
        extra += ["--metrics.wandb_run_name", f"{run_name}-reference"]
    return [*overrides, *extra]


def reusable(folder: str, config_text: str, steps: int) -> bool:
    """Whether ``folder`` holds a finished reference of exactly this resolved config, every step logged."""
    resolved = pathlib.Path(folder) / RESOLVED
    if not resolved.is_file() or resolved.read_text() != config_text:
        return False
    try:
        return set(range(1, steps + 1)) <= set(load_curve(folder))
    except (FileNotFoundError, ValueError):
        return False


def launch(toml_path: str | None, overrides: list[str], launcher_args: list[str]) -> int:
    """One job through this launcher, as the user would start it; its exit code."""
    cmd = [sys.executable, "-m", "titan_recover.launch", *([toml_path] if toml_path else []), *launcher_args,
           *overrides]
    return subprocess.call(cmd)


def report(run: str, reference: str, out: str | None = None) -> str:
    """The comparison: one line with the largest per-step difference of the loss, the overlay written to
    ``out`` (default ``<run>/reference.png``). Returns the text printed."""
    ref_curve, run_curve = load_curve(reference), load_curve(run)
    d = difference(ref_curve, run_curve, "run")
    out = out or os.path.join(run, PLOT)
    plot({"reference (no faults)": ref_curve, "run": run_curve}, out, LOSS,
         marks={"run": event_marks(run)})
    verdict = "equal" if d.max_abs == 0 else f"largest |diff| {d.max_abs:.3e} at step {d.worst_step}"
    return (f"loss against the failure-free reference over {d.common_steps} common steps: {verdict} (relative "
            f"{d.max_rel:.3e})\nplot: {out}\nmax_abs_diff={d.max_abs:.6e} max_rel_diff={d.max_rel:.6e} "
            f"common_steps={d.common_steps}")


def run_with_reference(config, toml_path: str | None, overrides: list[str], launcher_args: list[str]) -> int:
    """The run, then its reference (or the one already there), then the comparison. The exit code is the run's,
    or 1 when the reference fails."""
    from titan_recover.config.render import render_toml
    from titan_recover.job_config import build_config

    dump_folder = config.dump_folder
    ref_overrides = reference_overrides(overrides, dump_folder, config.metrics.wandb_run_name)
    ref_config = build_config(toml_path, ref_overrides)
    ref_text, ref_dir = render_toml(ref_config), reference_folder(dump_folder)
    code = launch(toml_path, overrides, launcher_args)
    if code != 0:
        print(f"[titan_recover] the run exited with {code}: no comparison", file=sys.stderr, flush=True)
        return code
    if reusable(ref_dir, ref_text, ref_config.training.steps):
        print(f"[titan_recover] reusing the reference in {ref_dir} (same resolved config)", file=sys.stderr,
              flush=True)
    else:
        print(f"[titan_recover] the failure-free reference: the same config without [chaos], in {ref_dir}",
              file=sys.stderr, flush=True)
        (pathlib.Path(ref_dir) / RESOLVED).unlink(missing_ok=True)
        if launch(toml_path, ref_overrides, launcher_args) != 0:
            print("[titan_recover] the reference run failed: no comparison", file=sys.stderr, flush=True)
            return 1
        pathlib.Path(ref_dir, RESOLVED).write_text(ref_text)
    print(report(dump_folder, ref_dir), flush=True)
    return 0
