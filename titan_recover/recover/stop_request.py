"""A stop with a checkpoint, asked for by a signal, in a job without replica groups (docs/deploy.md "Stopping").

A scheduler warns a job before its time limit with a signal (SLURM: ``#SBATCH --signal=B:USR1@180``); the job
should then save a checkpoint it can resume from and end, instead of losing the steps since its last interval
checkpoint. ``titan_recover.torchrun`` passes ``SIGUSR1`` on to its workers (torchrun's agent would end on it); each
rank notes it in a flag (:class:`StopSignal`). The ranks may see it at different steps, and a checkpoint is a
collective of every rank, so they agree on the step with one all-reduce (max) of the flag per step
(:class:`StopAgreement`), read ``lag`` steps after it was issued: on a GPU the host never waits for the step it just
queued, and every rank reads the same reduced value at the same step.
"""

from __future__ import annotations

import collections
import signal
from typing import Callable

import torch

STOP_SIGNAL = signal.SIGUSR1


class StopSignal:
    """Notes ``STOP_SIGNAL`` in this process (installed from the main thread, as Python requires)."""

    def __init__(self):
        self.requested = False
        signal.signal(STOP_SIGNAL, self._note)

    def _note(self, _signum, _frame) -> None:
        self.requested = True


class StopAgreement:
    """Every rank calls :meth:`poll` once per step, in step order: it issues the all-reduce (max) of this step's
    flag and returns the agreed answer of the step ``lag`` before (False until then), the same on every rank.

    ``all_reduce_max(tensor)`` starts the reduction in place and returns something with ``wait()`` (a c10d work);
    ``device`` holds the flag (the reduction's backend needs it there: NCCL on CUDA)."""

    def __init__(self, device: torch.device | str, all_reduce_max: Callable[[torch.Tensor], object] | None = None,
                 lag: int = 2):
        if lag < 1:
            raise ValueError(f"lag must be at least 1 step, got {lag}")
        self.device, self.lag = torch.device(device), lag
        self.all_reduce_max = all_reduce_max or _world_all_reduce_max
        self._pending: collections.deque = collections.deque()

    def poll(self, requested: bool) -> bool:
        flag = torch.tensor([int(requested)], dtype=torch.int32, device=self.device)
        self.all_reduce_max(flag).wait()  # on CUDA: the current stream waits for it, the host does not
        if self.device.type == "cuda":
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending.append((host, done))
        else:
            self._pending.append((flag, None))
        if len(self._pending) <= self.lag:
            return False
        host, done = self._pending.popleft()
        if done is not None:
            done.synchronize()  # queued ``lag`` steps ago: done by now
        return bool(host.item())


def _world_all_reduce_max(tensor: torch.Tensor):
    return torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, async_op=True)
