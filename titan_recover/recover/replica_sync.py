"""One rank's synchronisation with the other replicas: epochs, the gradient reduction and its commit point.

:meth:`ReplicaSync.reduce_once` is the only place a step's cross-replica result is decided. It reduces a buffer
(a *copy* of the local gradients, with the step's ledger) over the fault-tolerant group, then runs the commit
barrier: ``commit`` and the buffer holds the sum; ``abort`` (a fault anywhere in the epoch) and the rank has moved
to the next epoch, where the caller (:mod:`~titan_recover.recover.step_recovery`) completes the step's microbatches
and tries again. The start-up broadcast goes through the same commit barrier (as step 0), so that every member
agrees on the epoch the first step's quotas start from.
"""

from __future__ import annotations

import logging
import time

import torch

from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.events import EventLog
from titan_recover.recover.ftpg import FaultDetected, FaultTolerantGroup, fault_time_and_reason, raise_fault_flag
from titan_recover.recover.member import ReplicaMember
from titan_recover.recover.protocol import decide_commit, Keys

logger = logging.getLogger(__name__)


class ReplicaSync:
    def __init__(self, config: RecoverConfig, member: ReplicaMember, events: EventLog, chaos=None):
        self.config, self.member, self.events, self.chaos = config, member, events, chaos
        self.group: FaultTolerantGroup | None = None
        # Groups of past epochs, kept alive until the process exits: destroying a gloo group whose peer died can
        # block on its threads (see ftpg). One small group per membership change.
        self._retired: list[FaultTolerantGroup] = []
        self.recoveries: list[dict] = []  # recovery latencies of the current step, for metrics
        self.committed_epoch = -1  # epoch of the last commit (start-up broadcast or step): quotas start from it
        self.committed_members: tuple[int, ...] = ()

    @property
    def epoch(self) -> int:
        return self.member.epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self.member.members

    def start(self) -> None:
        """Register, wait for epoch 0, build its group."""
        self.member.register()
        self.member.wait_for_epoch(-1, self.config.startup_timeout_s + self.config.agree_timeout_s)
        self._build_group()
        self.events.emit("joined", epoch=self.epoch, members=list(self.members))

    def _build_group(self) -> None:
        if self.group is not None:
            self._retired.append(self.group)
        self.group = FaultTolerantGroup(
            self.member.store,
            epoch=self.epoch,
            members=self.members,
            replica=self.member.replica,
            position=self.member.rank,
            timeout_s=self.config.collective_timeout_s,
            on_poll=self.member.progress,
        )

    def members_of(self, epoch: int) -> tuple[int, ...]:
        return self.member.members_of(epoch)

    def catch_up(self, step: int | None) -> None:
        """Before a collective: if the coordinator has moved on (a fault elsewhere), move to its epoch."""
        if self.member.current_epoch() > self.epoch or self.member.store.check([Keys.fault(self.epoch)]):
            self._next_epoch(step)

    def _next_epoch(self, step: int | None) -> None:
        noticed = time.time()
        flag = self.member.store.get(Keys.fault(self.epoch)) if self.member.store.check([Keys.fault(self.epoch)]) else None
        fault_time, reason = fault_time_and_reason(flag) if flag else (noticed, "coordinator moved on")
        old = self.epoch
        epoch, members, why = self.member.wait_for_epoch(old, self.config.agree_timeout_s)
        agreed = time.time()
        self._build_group()
        built = time.time()
        record = {
            "step": step, "from_epoch": old, "epoch": epoch, "members": list(members), "reason": why,
            "fault_raised_at": fault_time, "noticed_at": noticed, "agreed_at": agreed, "built_at": built,
            "detect_s": max(0.0, noticed - fault_time), "agree_s": agreed - noticed, "build_s": built - agreed,
        }
        self.recoveries.append(record)
        self.events.emit("epoch_entered", **record)
        if self.chaos is not None and step is not None:
            self.chaos.maybe_inject(step, "rebuild")

    def broadcast_from_lowest(self, tensors: list[torch.Tensor]) -> None:
        """Make this position's tensors equal to the lowest member replica's (used at start), then commit as
        step 0 so that every member agrees on the epoch the first step starts from."""
        for _ in range(self.config.max_epochs_per_step + 1):
            self.catch_up(step=None)
            # staged in host memory: the fault-tolerant group is gloo, whatever device the parameters live on
            flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])
            try:
                self.group.broadcast_(flat, root_replica=min(self.members))
                decision = self._commit_barrier(0)
            except FaultDetected as fault:
                logger.warning("broadcast failed: %s", fault.reason)
                decision = self._propose(0, "abort")
            if decision == "commit":
                offset = 0
                for t in tensors:
                    t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
                self._committed()
                return
            self._next_epoch(step=0)
        raise RuntimeError(f"start-up broadcast failed in {self.config.max_epochs_per_step + 1} consecutive epochs")

    def _committed(self) -> None:
        self.committed_epoch, self.committed_members = self.epoch, self.members

    def reduce_once(self, step: int, buffer: torch.Tensor, attempt: int = 1) -> bool:
        """Sum ``buffer`` in place over the current epoch's members and run the commit barrier.

        True: committed, ``buffer`` holds the sum. False: aborted, this rank is now in the next epoch (``buffer``
        is garbage). Raises ``TooFewReplicas`` / ``Excluded`` when the next epoch says so.
        """
        self.member.progress(step=step, phase="reduction")
        try:
            if self.chaos is not None:
                self.chaos.maybe_inject(step, "reduction")
            self.group.allreduce_sum_(buffer)
            self.member.progress(phase="commit")
            if self.chaos is not None:
                self.chaos.maybe_inject(step, "commit")
            decision = self._commit_barrier(step)
        except FaultDetected as fault:
            logger.warning("step %d epoch %d: %s", step, self.epoch, fault.reason)
            decision = self._propose(step, "abort")
        if decision == "commit":
            self._committed()
            self.events.emit("step_committed", step=step, epoch=self.epoch, members=list(self.members),
                             attempts=attempt)
            return True
        self._next_epoch(step)
        return False

    def _propose(self, step: int, proposal: str) -> str:
        stored = self.member.store.compare_set(Keys.decision(self.epoch, step), "", proposal)
        return stored.decode() if isinstance(stored, bytes) else stored

    def _commit_barrier(self, step: int) -> str:
        store = self.member.store
        key = Keys.reduced(self.epoch, step)
        expected = len(self.members) * self.member.ranks_per_replica
        count = store.add(key, 1)
        deadline = time.monotonic() + self.config.collective_timeout_s
        while True:
            proposal = decide_commit(count, expected, store.check([Keys.fault(self.epoch)]))
            if proposal is None and store.check([Keys.decision(self.epoch, step)]):
                return store.get(Keys.decision(self.epoch, step)).decode()
            if proposal is None and time.monotonic() > deadline:
                raise_fault_flag(store, self.epoch, f"replica {self.member.replica}: commit barrier of step {step} timed out")
                proposal = "abort"
            if proposal is not None:
                return self._propose(step, proposal)
            time.sleep(0.002)
            count = store.add(key, 0)
