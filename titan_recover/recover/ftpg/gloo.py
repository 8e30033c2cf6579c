"""The ``gloo`` backend of the fault-tolerant group: one gloo group per (membership epoch, rank).

gloo gives no error to ring peers of a dead rank that are not its neighbours, and ``abort()`` does not release
a pending operation. So every collective here is issued asynchronously and polled: it completes, or it fails
(gloo error, deadline), or the epoch's fault flag in the coordinator's store appears. Whichever comes first is
reported as :class:`FaultDetected`, and a failure seen here raises the flag so that every other member stops
waiting too. A group is never reused after a fault: the next epoch builds a new one from a new store prefix.
A failed group is never destroyed during the run either: gloo's destructor joins threads that may still be
blocked on a dead peer (observed: a survivor stuck for minutes), so the owner keeps it until the process exits.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, Store
from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions, ProcessGroupGloo, ReduceOp

from titan_recover.recover.ftpg.base import FaultDetected, FaultTolerantGroup, FTPGConfig, register_backend
from titan_recover.recover.groups.keys import fault_time_and_reason, GroupKeys, raise_fault_flag


@register_backend("gloo")
class PolledGlooGroup(FaultTolerantGroup):
    """The gloo group of one rank of each of one epoch's member replicas (``tag``: a second group of the same
    epoch and rank over some of them, such as a state transfer's donor and joiners)."""

    def __init__(
        self,
        store: Store,
        *,
        epoch: int,
        members: tuple[int, ...],
        replica: int,
        rank: int,
        timeout_s: float,
        config: FTPGConfig | None = None,
        on_poll=None,
        tag: str = "",
    ):
        self.store, self.epoch, self.members = store, epoch, members
        self.replica, self.rank = replica, rank
        self.timeout_s = timeout_s
        self.poll_s = (config or FTPGConfig()).poll_s
        self.on_poll = on_poll  # called at every poll: a rank waiting on its peers is alive and not hung
        self.group_rank = members.index(replica)
        self.pg = ProcessGroupGloo(
            PrefixStore(GroupKeys.group_prefix(epoch, rank, tag), store),
            self.group_rank,
            len(members),
            timedelta(seconds=timeout_s),
        )

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self._run("allreduce", lambda: self.pg.allreduce([tensor], opts))

    def broadcast_many_(self, tensors: list[torch.Tensor], root_replica: int, on_each=None) -> None:
        """Broadcast each tensor in order, all issued at once (gloo runs them back to back); ``on_each(i)`` is
        called on this thread as soon as tensor ``i`` is through, in order, while the later ones are in flight."""
        opts = BroadcastOptions()
        opts.rootRank = self.members.index(root_replica)
        opts.rootTensor = 0
        self._run("broadcast", lambda: [self.pg.broadcast([t], opts) for t in tensors], on_each)

    def _run(self, name: str, issue, on_each=None) -> None:
        fault_key = GroupKeys.fault(self.epoch)
        start = time.monotonic()
        deadline = start + self.timeout_s
        try:
            works = issue()
            works = works if isinstance(works, list) else [works]
            for i, work in enumerate(works):
                # Sleep on the work's future (no busy polling competing with gloo's threads for the CPU), waking
                # every poll_s to look at the epoch's fault flag and the deadline.
                done = threading.Event()
                work.get_future().then(lambda _fut, done=done: done.set())
                while not done.wait(self.poll_s):
                    if self.on_poll is not None:
                        self.on_poll()
                    if self.store.check([fault_key]):
                        _, reason = fault_time_and_reason(self.store.get(fault_key))
                        raise FaultDetected(f"{name} in epoch {self.epoch} abandoned: {reason}", raised_here=False)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name} did not complete within {self.timeout_s} s")
                work.wait()
                if on_each is not None:
                    on_each(i)
        except FaultDetected:
            raise
        except Exception as error:  # gloo's own error (peer reset, timeout) or our deadline
            reason = (
                f"replica {self.replica} rank {self.rank}: {name} in epoch {self.epoch} failed: "
                f"{type(error).__name__}: {str(error)[:200]}"
            )
            raise_fault_flag(self.store, self.epoch, reason)
            raise FaultDetected(reason, raised_here=True) from error
