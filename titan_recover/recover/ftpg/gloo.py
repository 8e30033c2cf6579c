"""The ``gloo`` backend of the fault-tolerant group: one gloo group per (membership epoch, rank).

gloo gives no error to ring peers of a dead rank that are not its neighbours, and ``abort()`` does not release
a pending operation. So every collective here is issued asynchronously, in pieces (:mod:`.polled`), and polled:
each piece completes, or it fails (gloo error, no progress for the timeout), or the epoch's fault flag in the
coordinator's store appears. At most ``[recover.ftpg] in_flight`` pieces are issued at once; gloo's own timeout
applies to one piece. Consecutive whole host tensors smaller than ``COALESCE_BELOW_BYTES`` are reduced together, as
one coalesced operation (a model's many small gradients are not one round trip each; gloo copies a coalesced
operation's tensors into one buffer and back, so larger tensors go on their own).

A group is never reused after a fault: the next epoch builds a new one from a new store prefix. A failed group has
its connections closed at once (:func:`close_connections`): that fails whatever is still pending on it, and it stops
gloo's event loop from polling, without pause, data a live peer sent for a receive this member abandoned (gloo leaves
such data unread; docs/replica_groups.md "Backends"). A group its owner is done with (:meth:`PolledGlooGroup.close`:
the next epoch's replaces it, a state transfer is over) is destroyed on a thread of its own, after that closing if
it failed: its threads and connections go with it.

gloo reduces host memory. Tensors on a device are staged through a ring of pinned host chunks
(:mod:`.staging`): device -> host copy, reduction and host -> device copy of consecutive pieces overlap.
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import timedelta
from typing import Iterable

import torch
from torch.distributed import PrefixStore
from torch._C._distributed_c10d import (
    AllreduceCoalescedOptions,
    AllreduceOptions,
    BroadcastOptions,
    ProcessGroupGloo,
    ReduceOp,
)

from titan_recover.recover.ftpg.base import register_backend
from titan_recover.recover.ftpg.polled import (
    batches_of,
    check_contiguous,
    let_go,
    Piece,
    pieces_of,
    PolledGroup,
    Progress,
    rendezvous_client,
)
from titan_recover.recover.ftpg.staging import discard_staging, HostStaging, staging_for
from titan_recover.recover.groups.keys import GroupKeys


CLOSE_THREAD = "titan-recover-gloo-close"
"""The thread that closes a failed group's connections (:func:`close_connections`), one per failed group; nobody
waits for it (it may wait for gloo's timeout to connect to a peer)."""
RELEASE_THREAD = "titan-recover-gloo-release"
"""The thread on which a group its owner is done with is destroyed (:meth:`PolledGlooGroup.close`)."""
CLOSE_TAG = 0x7E5C0DE
"""The send/receive tag of the receive :func:`close_connections` posts and lets time out; nothing ever sends on it."""
CLOSE_WAIT = timedelta(milliseconds=1)
"""How long that receive is waited on before it times out (any positive time does: nobody sends on its tag)."""
COALESCE_BELOW_BYTES = 1 << 20
"""Whole host tensors below this size share a coalesced operation (up to a piece in all). On this project's CPU host
(``benchmarks/reduction_path.py``), coalescing 32 MiB gradients in pairs made the reduction of 512 MiB 2.3x slower
than one operation per tensor, from gloo's copies into and out of its flat buffer."""


@register_backend("gloo")
class PolledGlooGroup(PolledGroup):
    """The gloo group of one rank of each of one epoch's member replicas (``tag``: a second group of the same
    epoch and rank over some of them, such as a state transfer's donor and joiners)."""

    def __init__(self, store, **kwargs):
        super().__init__(store, **kwargs)
        self.pg = ProcessGroupGloo(
            PrefixStore(GroupKeys.group_prefix(self.epoch, self.rank, self.tag), rendezvous_client(store)),
            self.group_rank,
            len(self.members),
            timedelta(seconds=self.timeout_s),
        )
        self._staging: HostStaging | None = None
        self.closing: threading.Thread | None = None
        """Closing this group's connections after a failure (:func:`close_connections`), or None."""
        self.releasing: threading.Thread | None = None
        """Destroying the group once its owner is done with it (:meth:`close`), or None."""
        self.reduced = False
        """An all-reduce was issued on this group (its ring neighbours are connected)."""
        self.roots: set[int] = set()
        """The group ranks of the roots of the broadcasts issued on this group (its tree peers are connected)."""

    def close(self) -> None:
        """Destroy the gloo group on a thread of its own (:data:`RELEASE_THREAD`): a group kept would hold its
        threads (two workers and an event loop) and its connections (a socket per peer and the loop's descriptors)
        to the end of the run, one set per epoch. The group is never used again. A failed group is destroyed once
        its connections are closed (the closing thread ends first): nothing is pending on it then, and its
        destructor, which waits for its queued operations, returns at once. A healthy one has nothing pending
        either (each of its collectives completed, or it would have failed), and its destructor closes each
        connection softly: bytes this member sent that a slower peer has not read yet still reach it (gloo's
        ``Pair::~Pair``; ``tests/test_ftpg.py`` closes a broadcast's root as its peer starts to receive)."""
        if self.pg is None:
            return
        self.failed = True
        closing = self.closing
        self.releasing = let_go(self, "pg", name=RELEASE_THREAD,
                                first=lambda _pg: closing.join() if closing is not None else None)

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        self.allreduce_many_([tensor])

    def allreduce_many_(self, tensors: list[torch.Tensor], before_piece=None) -> None:
        check_contiguous(tensors)
        self.reduced = True
        self._guarded("allreduce", lambda: self._pipeline("allreduce", tensors, root=None,
                                                          before_piece=before_piece))

    def broadcast_many_(self, tensors: list[torch.Tensor], root_replica: int, on_each=None) -> None:
        """Broadcast each tensor in order, in pieces; ``on_each(i)`` is called on this thread as soon as tensor
        ``i`` is through, in order, while the later ones are in flight."""
        check_contiguous(tensors)
        root = self.members.index(root_replica)
        self.roots.add(root)
        self._guarded("broadcast", lambda: self._pipeline("broadcast", tensors, root=root, on_each=on_each))

    # ---- one collective, piece by piece ----------------------------------------------------------------------
    def _pipeline(self, name: str, tensors: list[torch.Tensor], root: int | None, on_each=None,
                  before_piece=None) -> None:
        """Issue the pieces, at most ``in_flight`` pending at once; stage them through host memory when the
        tensors live on a device. ``on_each`` follows the pieces of host tensors; for staged tensors it is called
        for all of them once the copies back are complete."""
        pieces = pieces_of(tensors, self.config.chunk_bytes)
        staging = self._staging_for(tensors)
        if root is None and staging is None:  # small host tensors go together (allreduce_coalesced)
            batches = batches_of(pieces, tensors, self.config.chunk_bytes, COALESCE_BELOW_BYTES)
        else:
            batches = [[(n, piece)] for n, piece in enumerate(pieces)]
        through = _InOrder(len(tensors), on_each if staging is None else None)
        through.mark([i for i, t in enumerate(tensors) if t.numel() == 0])
        last_piece = {index: n for n, (index, _, _) in enumerate(pieces)}
        progress = Progress(self.timeout_s)
        window: deque = deque()
        if staging is not None:
            staging.begin()
        try:
            for i, batch in enumerate(batches):
                if before_piece is not None:
                    holding = progress.clock()
                    for _, piece in batch:
                        before_piece(*piece)
                    progress.held(holding)
                window.append((i, batch, *self._issue(i, batch, root, staging)))
                if len(window) >= self.config.in_flight:
                    through.mark(self._finish(name, window.popleft(), root, staging, progress, last_piece))
            while window:
                through.mark(self._finish(name, window.popleft(), root, staging, progress, last_piece))
        finally:  # also after a failure: whatever the caller does next with the tensors runs after the copies back
            if staging is not None:
                staging.end()
        if staging is not None:
            if on_each is not None:
                staging.synchronize()
                for i in range(len(tensors)):
                    on_each(i)

    def _issue(self, i: int, batch: list[tuple[int, Piece]], root: int | None, staging: HostStaging | None):
        """Start batch ``i``: one piece copied out to its host slot first when staged (for a broadcast, only by
        the root), or several whole small host tensors reduced as one coalesced operation."""
        if len(batch) > 1:
            opts = AllreduceCoalescedOptions()
            opts.reduceOp = ReduceOp.SUM
            return None, _Pending(self.pg.allreduce_coalesced([piece[2] for _, piece in batch], opts))
        view = batch[0][1][2]
        host = view
        if staging is not None:
            staging.begin()  # after whatever the caller queued on the piece (a backup copy) in the meantime
            host = staging.slot(i, view)
            if root is None or root == self.group_rank:
                staging.copy_out(view, host)
        if root is None:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            return host, _Pending(self.pg.allreduce([host], opts))
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return host, _Pending(self.pg.broadcast([host], opts))

    def _finish(self, name, entry, root, staging, progress, last_piece) -> list[int]:
        """Wait for one batch, copy it back when staged; the tensors whose last piece it held."""
        i, batch, host, pending = entry
        self._wait(name, pending, progress)
        if staging is not None and (root is None or root != self.group_rank):
            staging.copy_back(i, host, batch[0][1][2])
        return [index for n, (index, _, _) in batch if last_piece[index] == n]

    def _staging_for(self, tensors: list[torch.Tensor]) -> HostStaging | None:
        if all(t.device.type == "cpu" for t in tensors):
            return None
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"a collective's tensors must live on one device, got {sorted(map(str, devices))}")
        self._staging = staging_for(devices.pop(), self.config.chunk_bytes, self.config.in_flight + 1)
        return self._staging

    # ---- PolledGroup ------------------------------------------------------------------------------------------
    def _wait_for(self, work: _Pending, seconds: float) -> bool:
        return work.done.wait(seconds)

    def _abort(self) -> None:
        # gloo cannot cancel one operation: the staging ring it may still write into is dropped (the next collective
        # gets a new one); the group's connections are closed once the flag is up (_disconnect)
        if self._staging is not None:
            discard_staging(self._staging)
            self._staging = None

    def _disconnect(self) -> None:
        if self.closing is None:
            peers = connected_first(self.group_rank, len(self.members), reduced=self.reduced, roots=sorted(self.roots))
            self.closing = threading.Thread(target=close_connections, daemon=True, name=CLOSE_THREAD,
                                            args=(self.pg, peers))
            self.closing.start()


def close_connections(pg: ProcessGroupGloo, peers: list[int]) -> int | None:
    """Close every connection of a gloo group, failing its pending operations at once, through the first of
    ``peers`` (group ranks, in the order to try: :func:`connected_first`) that has a connection open; the group rank
    of that peer, or None if there was no open connection to do it through.

    ``ProcessGroupGloo.abort`` does nothing for gloo (a pending all-reduce stays pending: tests/test_ftpg.py)
    and an error on one connection leaves the others open. gloo's one path that closes them all is a receive timing
    out ("Application timeout caused pair closure": every pending operation of the group fails). So a receive on a
    tag nobody sends on is posted to a peer and waited on for ``CLOSE_WAIT``.

    Which peer: gloo connects lazily (``TORCH_GLOO_LAZY_INIT``), and a receive from a peer never connected tries to
    connect to it, until gloo's timeout if that peer is lost (the lost one is often the one never connected: a
    broadcast's tree leaves most pairs unconnected), so the peers this member's collectives connected come first.
    Posting to a peer whose connection an error closed fails at once; a wait that fails for any reason but the
    timeout (that connection's own error) moves on to the next peer. May block for gloo's timeout: call it off the
    training thread."""
    probe = torch.empty(1)
    for peer in peers:
        try:
            work = pg.recv([probe], peer, CLOSE_TAG)
        except RuntimeError:  # that connection is closed already
            continue
        try:
            work.wait(CLOSE_WAIT)
        except RuntimeError as error:
            if "Timed out" in str(error):  # every connection of the group is closed now
                return peer
            continue
        raise RuntimeError(f"a peer sent on the tag reserved for closing a gloo group ({CLOSE_TAG:#x})")
    return None


def connected_first(group_rank: int, size: int, *, reduced: bool, roots: Iterable[int] = ()) -> list[int]:
    """Every other group rank, those a member's collectives have connected first: after an all-reduce (gloo's ring)
    its ring neighbours, left then right; for each broadcast root, its peers in gloo's broadcast tree
    (:func:`broadcast_peers`); then the rest in order."""
    near = [(group_rank - 1) % size, (group_rank + 1) % size] if reduced else []
    for root in roots:
        near.extend(broadcast_peers(group_rank, size, root))
    return [peer for peer in dict.fromkeys(near + list(range(size))) if peer != group_rank]


def broadcast_peers(group_rank: int, size: int, root: int) -> list[int]:
    """The group ranks a member exchanges with in gloo's broadcast from ``root`` (``gloo/broadcast.cc``, read, not
    imported: a binomial tree over ranks renumbered so that the root is 0; in round ``i`` a member whose renumbered
    rank has no bit set above ``i`` pairs with the rank differing in bit ``i``, receiving from it if that bit is
    its own, sending to it otherwise): the parent it receives from first (none for the root), then its children."""
    vrank = (group_rank - root) % size
    rounds = (size - 1).bit_length()  # gloo's log2ceil(size)
    mask = (1 << rounds) - 1
    parent: list[int] = []
    children: list[int] = []
    for i in range(rounds):
        mask ^= 1 << i
        vpeer = vrank ^ (1 << i)
        if vrank & mask or vpeer >= size:
            continue
        (parent if vrank & (1 << i) else children).append((vpeer + root) % size)
    return parent + children


class _Pending:
    """A gloo work and an event set when its future completes: the waiting thread sleeps on the event (no busy
    polling competing with gloo's threads for the CPU) and wakes at once when the piece is through."""

    def __init__(self, work):
        self.work = work
        self.done = threading.Event()
        work.get_future().then(lambda _fut: self.done.set())

    def wait(self) -> None:
        self.work.wait()


class _InOrder:
    """Calls ``on_each(i)`` for tensors 0, 1, ... in order, as each one is marked through."""

    def __init__(self, count: int, on_each):
        self.count, self.on_each = count, on_each
        self.through: set[int] = set()
        self.next = 0

    def mark(self, indices: list[int]) -> None:
        self.through.update(indices)
        while self.next in self.through:
            if self.on_each is not None:
                self.on_each(self.next)
            self.next += 1
