"""A stop with a checkpoint, asked for by a signal, in a job without replica groups (docs/deploy.md "Stopping").

A scheduler warns a job before its time limit with a signal (SLURM: ``#SBATCH --signal=B:USR1@180``); the job
should then save a checkpoint it can resume from and end, instead of losing the steps since its last interval
checkpoint. ``titan_recover.torchrun`` (torchrun's agent, which would end on ``SIGUSR1``) notes the signal in a
node-local file whose path its workers inherit (:data:`STOP_FILE_ENV`): a worker started or restarted later sees it
too, and none is ended by a signal it has no handler for yet. A worker signalled itself notes it as well
(:func:`listen`, installed first thing in ``train.main``). The ranks may see the request at different steps, and a
checkpoint is a collective of every rank, so they agree on the step with one all-reduce (max) of the flag per step
(:class:`StopAgreement`), read ``lag`` steps after it was issued: on a GPU the host never waits for the step it
just queued, and every rank reads the same reduced value at the same step. A rank that stops writes
:func:`stopped_marker`, so that the agent exits 138 (stopped) rather than 0 (the budget trained).

With ``[recover] preemption_grace_s > 0``, ``SIGTERM`` to the job's first process (the launcher: what Kubernetes,
``docker stop`` or systemd send before they kill a job) is the same stop, named a preemption notice, and the job is
ended as ``SIGTERM`` ends it when it has not stopped within the grace or at a second ``SIGTERM``
(:class:`PreemptionNotice`; docs/deploy.md "Preemption").
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from titan_recover.recover.notice import REPEAT_S

STOP_SIGNAL = signal.SIGUSR1
PREEMPTION_SIGNAL = signal.SIGTERM
CHECKPOINT_SIGNAL = signal.SIGUSR2
"""To a launcher of replica groups: write a durable checkpoint of the next committed step and train on
(docs/deploy.md "A checkpoint now"); elsewhere noted and ignored, never the end of the job."""
STOP_FILE_ENV = "TITAN_RECOVER_STOP_FILE"
"""Set by ``titan_recover.torchrun`` for its workers: a node-local file that exists once the agent got
:data:`STOP_SIGNAL` (or, with a preemption grace, :data:`PREEMPTION_SIGNAL`); it holds that signal's name."""


def describe(cause: str) -> str:
    """What a stop request by the signal named ``cause`` is, for the messages that name it."""
    if cause == PREEMPTION_SIGNAL.name:
        return f"{cause}: a preemption notice"
    return f"{cause}, e.g. a scheduler's warning before the job's time limit"


@dataclass(slots=True)
class PreemptionNotice:
    """``SIGTERM`` with a grace (``[recover] preemption_grace_s``): the first asks for a stop with a checkpoint;
    the job is ended as ``SIGTERM`` ends it at a second one, or once ``grace_s`` passed since the first. With no
    grace (0) every ``SIGTERM`` ends the job at once."""

    grace_s: float
    since: float | None = None
    """When the first came (monotonic seconds), None before."""
    repeat_s: float = REPEAT_S
    """A ``SIGTERM`` this soon after the first is the same notice come by a second path, not a second one: a
    scheduler that signals every process of a job may also have the job's own ``srun`` forward it to the process it
    started, moments later (every other process of the node applies the same window: recover/notice.py). An
    operator who means "end it now" a second after the notice sends it again later, or SIGKILL."""

    def take(self, now: float) -> bool:
        """A ``SIGTERM`` came at ``now``: True if it asks for a stop with a checkpoint, False if it ends the job
        (ask :meth:`repeats` first)."""
        if self.grace_s <= 0 or self.since is not None:
            return False
        self.since = now
        return True

    def repeats(self, now: float) -> bool:
        """A ``SIGTERM`` at ``now`` is the notice already taken, arriving again (:attr:`repeat_s`): nothing to do.
        Never once the grace is over (a grace shorter than the window ends the job when it runs out)."""
        return self.since is not None and now - self.since < min(self.repeat_s, self.grace_s)

    def expired(self, now: float) -> bool:
        """A stop was asked for and ``grace_s`` has passed since."""
        return self.since is not None and now - self.since >= self.grace_s


class StopSignal:
    """Whether this process was asked to stop: :data:`STOP_SIGNAL` came to it, or its agent's stop file exists."""

    def __init__(self):
        self.signalled = False
        self.file = os.environ.get(STOP_FILE_ENV, "")
        if threading.current_thread() is threading.main_thread():  # Python installs handlers there only
            signal.signal(STOP_SIGNAL, self._note)

    def _note(self, _signum, _frame) -> None:
        self.signalled = True

    @property
    def requested(self) -> bool:
        return self.signalled or bool(self.file and os.path.exists(self.file))

    @property
    def cause(self) -> str:
        """The name of the signal that asked: the one the agent wrote in its file, else :data:`STOP_SIGNAL`."""
        try:
            with open(self.file) as noted:
                return noted.read().strip() or STOP_SIGNAL.name
        except OSError:  # no agent, or only this process was signalled
            return STOP_SIGNAL.name


@functools.cache
def listen() -> StopSignal:
    """This process's one :class:`StopSignal` (its handler installed at the first call)."""
    return StopSignal()


def stopped_marker() -> str | None:
    """The file a rank that stopped on a request writes next to its agent's stop file (None without an agent)."""
    file = os.environ.get(STOP_FILE_ENV, "")
    return os.path.join(os.path.dirname(file), "stopped") if file else None


class StopAgreement:
    """Every rank calls :meth:`poll` once per step, in step order: it issues the all-reduce (max) of this step's
    flag and returns the agreed answer of the step ``lag`` before (False until then), the same on every rank.

    ``all_reduce_max(tensor)`` starts the reduction in place and returns something with ``wait()`` (a c10d work);
    ``device`` holds the flag (the reduction's backend needs it there: NCCL on CUDA). The flags (and on CUDA their
    pinned host copies and events) are a ring of ``lag + 1`` slots allocated at the first poll: a slot is written
    again only after its answer was read, so no step allocates."""

    def __init__(self, device: torch.device | str, all_reduce_max: Callable[[torch.Tensor], object] | None = None,
                 lag: int = 2):
        if lag < 1:
            raise ValueError(f"lag must be at least 1 step, got {lag}")
        self.device, self.lag = torch.device(device), lag
        self.all_reduce_max = all_reduce_max or _world_all_reduce_max
        self._slots: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        """(flag on the device, what the host reads, event or None) per slot."""
        self._polls = 0

    def _ring(self) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
        if not self._slots:
            for _ in range(self.lag + 1):
                flag = torch.zeros(1, dtype=torch.int32, device=self.device)
                if self.device.type == "cuda":
                    host = torch.empty(1, dtype=torch.int32, pin_memory=True)
                    self._slots.append((flag, host, torch.cuda.Event()))
                else:
                    self._slots.append((flag, flag, None))
        return self._slots

    @property
    def host_buffers(self) -> int:
        """How many distinct host tensors the ring reads its answers from (0 before the first poll)."""
        return len({host.data_ptr() for _, host, _ in self._slots})

    def poll(self, requested: bool) -> bool:
        ring = self._ring()
        flag, host, done = ring[self._polls % len(ring)]
        flag.fill_(int(requested))  # filled on the device (a tensor built from a host value would be waited for)
        self.all_reduce_max(flag).wait()  # on CUDA: the current stream waits for it, the host does not
        if done is not None:
            host.copy_(flag, non_blocking=True)
            done.record()
        self._polls += 1
        if self._polls <= self.lag:
            return False
        _, host, done = ring[(self._polls - 1 - self.lag) % len(ring)]
        if done is not None:
            done.synchronize()  # queued ``lag`` steps ago: done by now
        return bool(host.item())


def _world_all_reduce_max(tensor: torch.Tensor):
    return torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, async_op=True)
