"""Faults of a process that trains nothing (``[chaos]`` faults with ``process = "syncer"`` or ``"coordinator"``).

The process calls :meth:`ProcessFaults.maybe_inject` at each of its phases with a count (the syncer: merges so far;
the coordinator: the members' step, or the epoch it forms). A fault fires once, the first time its phase is reached
with a count at or past its ``step``, by the start of the process its ``incarnation`` names; it is logged as a
``fault_injected`` event before it acts.
"""

from __future__ import annotations

import os

from titan_recover.recover.chaos.config import FaultSpec
from titan_recover.recover.chaos.kinds import FAULTS


class ProcessFaults:
    def __init__(self, schedule: list[FaultSpec], process: str, start: int, events):
        self.pending = [f for f in schedule if f.process == process and f.incarnation == start]
        self.process, self.events = process, events

    def __bool__(self) -> bool:
        return bool(self.pending)

    def maybe_inject(self, step: int, phase: str) -> None:
        for fault in self.pending:
            if fault.phase == phase and step >= fault.step:
                self.pending.remove(fault)
                self.events.emit("fault_injected", kind=fault.kind, step=step, phase=phase, pid=os.getpid(),
                                 process=self.process)
                FAULTS.get(fault.kind)(None, fault)
                return
