"""The syncer's inbox: deltas read from its store as the learners' send threads write them (docs/diloco.md).

Each (learner, rank) announces the incarnation sending from it and numbers its deltas from 0 in every syncer
store; a learner's delta of a fragment is delivered once every rank's pieces of it reach the same step. Each
rank's send thread sums the deltas of a fragment that queue up while the syncer is slow or away
(``transport.Delta.absorb``), each on its own, so one rank may send a fragment's deltas of steps 50 and 100 apart
and another one sum of both: the inbox sums a rank's pieces of a fragment likewise until every rank's last piece
is of the same step, so nothing is lost and no rank's delta is counted twice."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from titan_recover.recover.diloco.messages import DeltaMessage, read_sender, take_delta
from titan_recover.recover.diloco.rules import Version

HELLO_EVERY_S = 0.25


@dataclass
class Delivery:
    """A learner's delta of one fragment, every rank's piece of it."""

    learner: int
    fragment: int
    step: int
    tokens: int
    base: Version
    deltas: list[torch.Tensor]  # per rank


class Inbox:
    def __init__(self, store, *, learners: int, ranks: int):
        self.store, self.learners, self.ranks = store, learners, ranks
        self.senders: dict[tuple[int, int], tuple[int, int]] = {}  # (learner, rank) -> (incarnation, next no.)
        self.partial: dict[tuple[int, int, int], dict[int, DeltaMessage]] = {}
        """(learner, incarnation, fragment) -> each rank's pieces so far, summed (:meth:`_add`)."""
        self._hellos_at = 0.0

    def _read_hellos(self) -> None:
        """Which incarnation sends from each (learner, rank): a new one numbers its deltas from 0."""
        for learner in range(self.learners):
            for rank in range(self.ranks):
                incarnation = read_sender(self.store, learner, rank)
                if incarnation is not None and self.senders.get((learner, rank), (-1, 0))[0] != incarnation:
                    self.senders[(learner, rank)] = (incarnation, 0)
        self._hellos_at = time.monotonic()

    def receive(self) -> tuple[int, list[Delivery]]:
        """Read every delta written since the last call: (pieces read, deltas complete in every rank)."""
        if time.monotonic() - self._hellos_at > HELLO_EVERY_S:
            self._read_hellos()
        received, complete = 0, []
        for (learner, rank), (incarnation, number) in list(self.senders.items()):
            while (message := take_delta(self.store, learner, incarnation, rank, number)) is not None:
                number += 1
                received += 1
                key = (learner, incarnation, message.fragment)
                pieces = self.partial.setdefault(key, {})
                pieces[rank] = _add(pieces.get(rank), message)
                if len(pieces) == self.ranks and len({piece.step for piece in pieces.values()}) == 1:
                    del self.partial[key]
                    first = pieces[0]
                    complete.append(Delivery(learner, first.fragment, first.step, first.tokens, first.base,
                                             [pieces[p].data for p in range(self.ranks)]))
            self.senders[(learner, rank)] = (incarnation, number)
        return received, complete


def _add(held: DeltaMessage | None, message: DeltaMessage) -> DeltaMessage:
    """A rank's pieces of one fragment so far plus a later one, as its send thread would have summed them: the
    data and tokens added, the later step, the earlier base."""
    if held is None:
        return message
    return DeltaMessage(message.fragment, message.step, held.tokens + message.tokens, held.base,
                        held.data + message.data)
