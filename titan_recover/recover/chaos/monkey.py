"""Deterministic fault injection: the faults of one rank, fired at an exact (replica, rank, step, phase).

The schedule is the ``[chaos]`` section's (:mod:`~titan_recover.recover.chaos.config`); what a fault does is its
registered kind's (:mod:`~titan_recover.recover.chaos.kinds`). Every injection is logged as a ``fault_injected``
event *before* it acts, so a test can assert that it fired.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from titan_recover.recover.chaos.config import FaultSpec, JOB_START_ENV
from titan_recover.recover.chaos.kinds import FAULTS, flip_bit


class ChaosMonkey:
    """The faults of one rank; :meth:`maybe_inject` is called at every phase of every step.

    ``run_dir`` and ``job_start`` (default: ``TITAN_RECOVER_JOB_START``) are needed only by time-triggered faults
    (``at_s``): the run folder holds their once-per-job markers."""

    def __init__(self, schedule: list[FaultSpec], replica: int, rank: int, events, incarnation: int = 0,
                 run_dir: str | None = None, job_start: float | None = None):
        self.mine = [f for f in schedule if f.process == "trainer" and f.replica == replica and f.rank == rank
                     and (f.at_s is not None or f.incarnation == incarnation)]
        self._index = {id(f): i for i, f in enumerate(schedule)}  # a fault's place in the job's schedule
        self.events = events
        self.slowdown = 1.0
        self.desync_due = False
        """A ``desync`` fired: the next collective issued through :meth:`collective` diverges."""
        self._fired: set[int] = set()
        self.tensors: dict[str, Callable[[], list[torch.Tensor]]] = {}
        """Where bit flips land: ``parameter`` / ``gradient`` -> this rank's local tensors (set by the trainer)."""
        self.pending: dict[str, FaultSpec] = {}
        """Bit flips waiting for their moment (a gradient after a backward, an activation in a forward)."""
        self.run_dir, self.job_start = run_dir, job_start
        if any(f.at_s is not None for f in self.mine):
            if self.job_start is None:
                if JOB_START_ENV not in os.environ:
                    raise ValueError(f"chaos faults with at_s need the job's start time in {JOB_START_ENV} "
                                     "(./run_train.sh and python -m titan_recover.launch set it)")
                self.job_start = float(os.environ[JOB_START_ENV])
            if run_dir is None:
                raise ValueError("chaos faults with at_s need the run folder (their once-per-job markers)")

    def maybe_inject(self, step: int, phase: str) -> None:
        """Fire the faults scheduled for (step, phase), each once (a phase recurs within a step: every
        microbatch has a forward, a retried reduction is a reduction again), and the time-triggered ones due at
        this phase, each once per job."""
        for fault in self.mine:
            if fault.phase != phase or id(fault) in self._fired:
                continue
            if fault.at_s is None:
                if fault.step != step:
                    continue
                elapsed = None
            else:
                elapsed = time.time() - self.job_start
                if elapsed < fault.at_s:
                    continue
                self._fired.add(id(fault))
                if not self._claim(fault):
                    continue  # an earlier start of this job fired it
            self._fired.add(id(fault))
            timing = {} if elapsed is None else {"at_s": fault.at_s, "elapsed_s": round(elapsed, 3)}
            self.events.emit("fault_injected", kind=fault.kind, step=step, phase=phase, pid=os.getpid(), **timing)
            FAULTS.get(fault.kind)(self, fault)

    def _claim(self, fault: FaultSpec) -> bool:
        """Create the fault's marker in the run folder; False if it exists (the fault fired in this job)."""
        folder = os.path.join(self.run_dir, "chaos")
        os.makedirs(folder, exist_ok=True)
        try:
            os.close(os.open(os.path.join(folder, f"fault-{self._index[id(fault)]}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def collective(self, issue: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        """``issue`` (a collective on one tensor) as a faulty rank calls it: once a ``desync`` fired, the next call
        issues another collective than its peers (a tensor of another shape), as torchft injects faults through a
        process-group wrapper."""
        def issue_or_diverge(tensor: torch.Tensor) -> None:
            if self.desync_due:
                self.desync_due = False
                tensor = torch.zeros(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
            issue(tensor)

        return issue_or_diverge

    @property
    def slowed(self) -> bool:
        """A ``slow`` fault fired: :meth:`after_compute` needs the microbatch's device time (the caller waits for
        the device before measuring it)."""
        return self.slowdown > 1

    def after_compute(self, elapsed_s: float) -> None:
        """Called after every microbatch: a ``slow`` rank sleeps so the microbatch took ``factor`` times as long."""
        if self.slowdown > 1:
            time.sleep(elapsed_s * (self.slowdown - 1))

    def after_backward(self) -> None:
        """Called after every microbatch's backward: a pending gradient flip lands now."""
        spec = self.pending.pop("gradient", None)
        if spec is not None:
            flip_bit(next(g for g in self.tensors["gradient"]() if g is not None), spec.element, spec.bit)

    def on_activation(self, output: torch.Tensor) -> None:
        """Called with the first layer's output in every forward: a pending activation flip lands in it."""
        spec = self.pending.pop("activation", None)
        if spec is not None:
            with torch.no_grad():
                flip_bit(output, spec.element, spec.bit)
