"""The step's cross-replica reduction started during the backward of the replica's last planned microbatch
(docs/invariant.md, "Overlapping the reduction with the last backward").

The earlier microbatches accumulate locally; while the last one's backward runs, each gradient part is handed to
the collective as soon as the backward has finished it (a post-accumulate-grad hook: autograd's for plain and
tensor-parallel parameters, FSDP2's after its reduce-scatter for sharded ones). The collective runs on a thread of
its own, over the fault-tolerant group of the epoch the step was planned in, and issues the parts in one fixed order
on every member: the parts reversed (the order a backward finishes them, as DDP's buckets), then the tail of small
sections, which the manager fills once the quota is done. A part that is not final yet holds the issue back (a
*gate*: the group's ``before_piece``); its waiting time does not count against the collective's progress deadline.

What the invariant needs is unchanged: the collective sums exactly the local accumulation, each part issued only
once it is final, with the backup of each piece taken just before the piece is issued; the ledger in the tail and
the commit barrier still decide; a failure during the step aborts this collective (the epoch's fault flag) and the
manager restores the accumulation and goes round again as after any aborted reduction.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch

from titan_recover.platform import bind_thread
from titan_recover.recover.invariant.reduction import Backup, issue_order, part_of

Collective = Callable[[list[torch.Tensor], Callable[[int, int, torch.Tensor], None]], None]
"""``collective(tensors, before_piece)``: the fault-tolerant group's ``allreduce_many_`` of one epoch."""


class Abandoned(RuntimeError):
    """The step's computation failed before the overlapped reduction had every part (the collective's thread
    stops at its next gate; the group reports it as a fault)."""


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the process's whole life (a stream is cheap to keep, not to make per step)."""
    return torch.cuda.Stream(device)


class SideStream:
    """The CUDA stream the collective's thread queues its work on (the gates' waits, the backup's copies, and what
    the group's issue makes NCCL's stream wait for), one per device, reused. Without it the thread's current stream
    is the device's default stream, the one the backward runs on: a gate's wait for a part's event (recorded on
    FSDP2's reduce-scatter stream) would hold every backward kernel queued after it behind that reduce-scatter,
    and the collective's pieces behind the backward, undoing the overlap."""

    def __init__(self, device: torch.device):
        self.stream = _side_stream(device)

    def running(self):
        """The collective's thread runs inside this: on the stream's device (:func:`bind_thread`: a new thread's
        is device 0), its current stream the side stream."""
        bind_thread(self.stream.device)
        return torch.cuda.stream(self.stream)

    def caller_waits(self) -> None:
        """The caller's stream (the training thread's) comes after everything the collective's thread queued."""
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


class OverlappedReduction:
    """One step's reduction of ``parts`` (in place; the local accumulation in parameter order) and ``tail``,
    issued by ``collective`` on a thread as :meth:`part_ready` / :meth:`release` / :meth:`tail_ready` allow.
    ``epoch``: the epoch whose group ``collective`` belongs to. ``backup``: saved piece by piece at the gate.
    ``side``: the collective thread's stream on a CUDA device (default: :class:`SideStream` of the parts' device;
    none on CPU)."""

    def __init__(self, parts: list[torch.Tensor], tail: torch.Tensor, collective: Collective, *, epoch: int,
                 backup: Backup | None = None, side: SideStream | None = None):
        self.parts, self.tail, self.epoch = parts, tail, epoch
        self.backup = backup
        device = tail.device
        self._side = side if side is not None or device.type != "cuda" else SideStream(device)
        self.order = issue_order(parts, tail)
        """The issue order, the same on every member and as without overlap."""
        self._collective = collective
        self._ready = [threading.Event() for _ in self.order]
        self._events: list[torch.cuda.Event | None] = [None] * len(self.order)
        self._abandoned: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="overlapped-reduction", daemon=True)
        self.reported_twice: list[int] = []
        """Parts (parameter order) whose hook fired again after they were reported final: the collective may have
        issued them with an earlier value (:meth:`check`)."""
        self._released = False

    def start(self) -> "OverlappedReduction":
        if self.backup is not None:
            self.backup.begin(self.parts)
        self._thread.start()
        return self

    # ---- the computing thread -----------------------------------------------------------------------------------
    def part_ready(self, index: int) -> None:
        """Part ``index`` (parameter order) is final: its hook fired in the last microbatch's backward. On a CUDA
        device the part is produced on the stream current at the hook (FSDP2's reduce-scatter stream, or the
        backward's): the collective's first read waits for an event recorded there."""
        at = part_of(index, len(self.parts))
        if self._ready[at].is_set():
            if not self._released:
                self.reported_twice.append(index)
            return
        part = self.parts[index]
        if part.device.type == "cuda":
            self._events[at] = torch.cuda.current_stream(part.device).record_event()
        self._ready[at].set()

    def release(self) -> None:
        """The last microbatch is computed: every part is final (a parameter that got no gradient has its zeros)."""
        self._released = True
        for index in range(len(self.parts)):
            self.part_ready(index)

    def check(self) -> None:
        """Raise if a part was reported final twice in the backward (a parameter whose gradient a backward
        accumulates more than once, as a reentrant activation checkpoint of a segment sharing it would): its first
        value may be what the collective summed."""
        if self.reported_twice:
            raise RuntimeError(
                f"the gradients of parameter(s) {sorted(set(self.reported_twice))} were accumulated more than once in "
                f"one backward, so the reduction overlapped with it may have sent an unfinished value; set "
                f"[recover.step] overlap_reduction = false for this model")

    def tail_ready(self) -> None:
        """The tail is filled in (after :meth:`release`)."""
        if self.tail.device.type == "cuda":
            self._events[-1] = torch.cuda.current_stream(self.tail.device).record_event()
        self._ready[-1].set()

    def abandon(self, reason: str) -> None:
        """The computation failed: the collective stops at its next gate (with :class:`Abandoned`)."""
        self._abandoned = reason
        for ready in self._ready:
            ready.set()

    def join(self) -> None:
        """Wait for the collective (it ends: every part is released, or abandoned, before this is called; the group
        bounds its own waits by the progress deadline and the fault flag) and raise what it raised."""
        self._thread.join()
        if self._side is not None:  # the backup's copies and a staging's copies back, before the caller reads them
            self._side.caller_waits()
        if self._error is not None:
            raise self._error

    # ---- the collective's thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._side is None:
                self._collective(self.order, self._gate)
            else:
                with self._side.running():
                    self._collective(self.order, self._gate)
        except BaseException as error:  # handed to the caller of join
            self._error = error

    def _gate(self, index: int, start: int, view: torch.Tensor) -> None:
        """Called by the group just before the piece of ``order[index]`` from element ``start`` is first issued."""
        if start == 0:
            self._ready[index].wait()  # set by the backward's hooks, release() or abandon(): see join()
            if self._abandoned is not None:
                raise Abandoned(f"the step's computation failed before its reduction was issued: {self._abandoned}")
            if self._events[index] is not None:
                torch.cuda.current_stream(view.device).wait_event(self._events[index])
        if self.backup is not None:
            self.backup.save_issued(index, start, view)
