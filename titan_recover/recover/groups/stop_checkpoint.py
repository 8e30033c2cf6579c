"""Who writes a stop's checkpoint, and who takes over when that writer is lost before it reports.

At a stop every member left in the stop's epoch that was a member of the epoch that committed the last step holds
that step's state, bit for bit. These are the *candidates*, lowest first (:func:`candidates`); the first writes the
checkpoint. The others wait until it reports, so that one lost between the stop and the end of its save (a node
that dies just after the stop was decided, a second preempted node) costs a turn, not the checkpoint.

Each turn (``round``) ends with one outcome in the job's store, ``stop/checkpoint/s{step}/r{round}``, written by
compare-and-set (the first word stands; every rank reads the same sequence):

- ``saved``: by the writer's rank 0 once its save returned (a DCP save returns on a rank once every rank of the
  group wrote its shard and the metadata is written);
- ``failed``: by the same rank when the save failed;
- ``lost``: by any waiting rank, once the coordinator named the writer lost after the stop (``stop/lost/<replica>``:
  its heartbeat timed out; docs/replica_groups.md "Liveness").

``failed`` and ``lost`` pass the turn to the next candidate; with none left the job stops without a checkpoint. The
wait follows progress, not size: a writer whose group beat keeps changing may take as long as its save takes; one
whose beat stood still for ``stall_timeout_s`` without the coordinator naming it lost means that the coordinator is
gone too, and the wait ends without a checkpoint, with a sentence saying so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from torch.distributed import Store

from titan_recover.recover.groups.keys import GroupKeys

SAVED, FAILED, LOST = "saved", "failed", "lost"


def candidates(left: tuple[int, ...], committed: tuple[int, ...]) -> tuple[int, ...]:
    """The replicas that may write a stop's checkpoint, in turn: those ``left`` in the stop's epoch that were members
    of the epoch that committed the last step (``committed``, the same on every survivor), lowest first. A joiner
    whose admission had not committed holds no such state (partly received, or an older checkpoint's): never one."""
    return tuple(sorted(m for m in left if m in committed))


@dataclass(frozen=True)
class Turn:
    """What a waiting candidate learnt: ``mine`` (this replica writes now), else who wrote (``written_by``, None if
    nobody did) and why the wait ended."""

    mine: bool
    written_by: int | None = None
    reason: str = ""


class StopCheckpoint:
    """The turns of one stop's checkpoint, seen from one rank (``replica``, ``rank``)."""

    def __init__(self, store: Store, *, step: int, candidates: tuple[int, ...], replica: int, rank: int,
                 stall_timeout_s: float, poll_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.store, self.step, self.candidates = store, step, candidates
        self.replica, self.rank = replica, rank
        self.stall_timeout_s, self.poll_s = stall_timeout_s, poll_s
        self.clock, self.sleep = clock, sleep
        self.round = 0
        self.handovers: list[tuple[int, str]] = []
        """(the writer that lost its turn, ``failed`` or ``lost``), in order."""
        self.last: Turn | None = None
        """What the last :meth:`await_turn` learnt."""

    @property
    def writer(self) -> int | None:
        """This round's writer; None once every candidate had its turn."""
        return self.candidates[self.round] if self.round < len(self.candidates) else None

    @property
    def mine(self) -> bool:
        return self.writer == self.replica

    def key(self) -> str:
        return GroupKeys.stop_checkpoint(self.step, self.round)

    def report(self, saved: bool) -> str:
        """The writer's rank 0, after its save: the round's outcome, as it stands (``lost`` if a waiting rank gave up
        on this writer first: the next candidate then writes the same step again, into its own staging folder; the
        first complete copy published stands: ``titan_recover.checkpoint.publish``)."""
        if self.rank != 0:
            return SAVED if saved else FAILED
        stored = self.store.compare_set(self.key(), "", SAVED if saved else FAILED)
        return stored.decode() if isinstance(stored, bytes) else stored

    def await_turn(self) -> Turn:
        """Wait until some candidate saved (not ``mine``), this replica's turn comes (``mine``), no candidate is left,
        or the writer stopped beating without the coordinator naming it lost."""
        self.last = self._await()
        return self.last

    def _await(self) -> Turn:
        beat, moved = None, self.clock()
        while True:
            writer = self.writer
            if writer is None:
                return Turn(False, None, f"every replica that held step {self.step} lost its turn to write it "
                                         f"({self.history()}): no checkpoint written")
            if writer == self.replica:
                return Turn(True)
            outcome = self._outcome()
            if outcome == SAVED:
                return Turn(False, writer)
            if outcome in (FAILED, LOST):
                self.handovers.append((writer, outcome))
                self.round += 1
                beat, moved = None, self.clock()
                continue
            if self.store.check([GroupKeys.stop_lost(writer)]):
                self.store.compare_set(self.key(), "", LOST)
                continue
            now_beat = self._beat(writer)
            if now_beat != beat:
                beat, moved = now_beat, self.clock()
            elif self.clock() - moved > self.stall_timeout_s:
                return Turn(False, None, f"replica {writer}, which writes the checkpoint of step {self.step}, has not "
                                         f"beaten for {self.stall_timeout_s:g} s and no coordinator named it lost: the "
                                         "coordinator is gone too; no checkpoint written")
            self.sleep(self.poll_s)

    def _outcome(self) -> str | None:
        key = self.key()
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        return raw.decode() if isinstance(raw, bytes) else raw

    def _beat(self, replica: int) -> bytes | None:
        key = GroupKeys.heartbeat(replica)
        return self.store.get(key) if self.store.check([key]) else None

    def history(self) -> str:
        """The turns lost so far, in words."""
        return ", ".join(f"replica {r} {outcome}" for r, outcome in self.handovers) or "none held it"
