"""What every backend shares: chunked collectives, waited on by polling, with a deadline that follows progress.

A collective is split into *pieces* (contiguous 1-D views of at most ``[recover.ftpg] chunk_mb``, in tensor order).
While a piece is in flight the caller's thread wakes every ``poll_s`` to look at the epoch's fault flag and at
the deadline, which is ``timeout_s`` after the *last piece completed* (or the collective started): a big tensor
on a slow link takes as long as it takes, a collective that stops moving fails after ``timeout_s`` (time the caller
holds a piece back, ``before_piece`` waiting for it to be final, is not counted). Whatever ends
it (the flag, the deadline, the backend's own error) is reported as :class:`FaultDetected`; a failure seen here
raises the flag, so every other member stops waiting too, and the backend's ``_abort`` releases what is pending.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any, Callable

import torch
from torch.distributed import Store, TCPStore

from titan_recover.recover.ftpg.base import FaultDetected, FaultTolerantGroup, FTPGConfig
from titan_recover.recover.groups.keys import fault_time_and_reason, GroupKeys, raise_fault_flag
from titan_recover.recover.stores.bounded import unbounded

Piece = tuple[int, int, torch.Tensor]
"""(index of the tensor it belongs to, its first element there, a contiguous 1-D view of that part)."""


def check_contiguous(tensors: list[torch.Tensor]) -> None:
    """A caller's mistake, raised before anything is issued (not a fault of the epoch)."""
    for index, tensor in enumerate(tensors):
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {index} of a collective is not contiguous (shape {tuple(tensor.shape)})")


def pieces_of(tensors: list[torch.Tensor], chunk_bytes: int) -> list[Piece]:
    """Every tensor as consecutive 1-D views of at most ``chunk_bytes`` (at least one element each), in order; an
    empty tensor has no piece."""
    check_contiguous(tensors)
    out: list[Piece] = []
    for index, tensor in enumerate(tensors):
        flat = tensor.view(-1)
        step = max(1, chunk_bytes // max(1, flat.element_size()))
        out.extend((index, start, flat[start : start + step]) for start in range(0, flat.numel(), step))
    return out


def batches_of(pieces: list[Piece], tensors: list[torch.Tensor], chunk_bytes: int,
               small_bytes: int) -> list[list[tuple[int, Piece]]]:
    """The pieces, numbered, in batches issued as one operation each: consecutive whole tensors smaller than
    ``small_bytes`` share a batch up to ``chunk_bytes`` in all (one coalesced operation instead of one per small
    tensor, such as a model's many norm weights); every other piece is a batch of its own (a coalesced operation
    copies its tensors into one buffer and back, which costs more than it saves for larger tensors). A batch holds
    one dtype (gloo's coalesced all-reduce refuses a mix)."""
    batches: list[list[tuple[int, Piece]]] = []
    room = 0
    for n, piece in enumerate(pieces):
        index, start, view = piece
        nbytes = view.numel() * view.element_size()
        whole = start == 0 and view.numel() == tensors[index].numel() and nbytes < min(small_bytes, chunk_bytes)
        if whole and batches and room >= nbytes and batches[-1][-1][1][2].dtype == view.dtype:
            batches[-1].append((n, piece))
            room -= nbytes
            continue
        batches.append([(n, piece)])
        room = chunk_bytes - nbytes if whole else 0
    return batches


def let_go(owner: Any, attribute: str, *, name: str,
           first: Callable[[Any], None] | None = None) -> threading.Thread:
    """Take ``owner.attribute`` from ``owner`` (it becomes None) and drop the last reference to it on a thread named
    ``name`` (returned), after ``first(it)`` there: a communicator's destructor may block (it joins its threads), so
    it must not run on the training thread. Nothing but the thread holds it meanwhile (no local variable of the
    caller: the caller must hold no other reference for the destructor to run there)."""
    holder = [getattr(owner, attribute)]
    setattr(owner, attribute, None)

    def release() -> None:
        try:
            if first is not None:
                first(holder[0])
        finally:
            holder.clear()

    thread = threading.Thread(target=release, daemon=True, name=name)
    thread.start()
    return thread


def rendezvous_client(store: Store) -> Store:
    """The store client a group connects its peers through: a connection of its own to a TCPStore. gloo connects
    lazily, on its own thread, and waits there for a peer's address (a blocking ``get``, up to the group's timeout);
    NCCL's non-root ranks wait the same way for the root's unique id (on a thread of the group's, :mod:`.nccl`). A
    TCPStore client answers one request at a time, so on the member's client a peer that never came (lost before it
    built its group) would hold every request of the member's behind that wait, the fault flag's included: with
    gloo a flag raised at once was seen only at the group's timeout (``tests/test_ftpg.py``). Any other store as it
    is (a HashStore waits without holding its lock; the etcd store gives each thread its own connection)."""
    inner = unbounded(store)  # the group's waits are bounded by its own timeout and flag
    return inner.clone() if isinstance(inner, TCPStore) else store


class Progress:
    """The deadline of one collective: ``timeout_s`` after the last piece completed (or the start)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.clock = timeout_s, clock
        self.last = clock()
        self.pieces = 0

    def advanced(self) -> None:
        self.last = self.clock()
        self.pieces += 1

    def held(self, since: float) -> None:
        """The caller held the next piece back from ``since`` (this clock) until now (a piece not final yet: an
        overlapped reduction): that time is not the collective's, the deadline moves by it."""
        self.last += max(0.0, self.clock() - since)

    def expired(self) -> bool:
        return self.clock() - self.last > self.timeout_s


class PolledGroup(FaultTolerantGroup):
    """A backend's common part: the members, the fault flag, the progress deadline. A subclass issues pieces and
    says how to wait on one (:meth:`_wait_for`) and how to release what is pending after a fault (:meth:`_abort`)."""

    def __init__(self, store: Store, *, epoch: int, members: tuple[int, ...], replica: int, rank: int,
                 timeout_s: float, config: FTPGConfig | None = None, device: torch.device | str = "cpu",
                 on_poll: Callable[[], None] | None = None, fault_seen: Callable[[int], bool] | None = None,
                 tag: str = ""):
        self.store, self.epoch, self.members = store, epoch, members
        self.replica, self.rank, self.tag = replica, rank, tag
        self.timeout_s = timeout_s
        self.config = config or FTPGConfig()
        self.device = torch.device(device)
        self.on_poll = on_poll  # called at every poll: a rank waiting on its peers is alive and not hung
        self.fault_seen = fault_seen  # the flag without a store request (build_group), or None: ask the store
        self.group_rank = members.index(replica)
        self.failed = False
        """A collective of this group failed: it is never used again (the next epoch builds a new group)."""

    # ---- what a backend provides ----------------------------------------------------------------------------
    @abc.abstractmethod
    def _wait_for(self, work, seconds: float) -> bool:
        """True once ``work`` is complete, False if still pending after ``seconds``."""

    def _abort(self) -> None:
        """Release whatever this group has pending after a fault (a backend that cannot does nothing)."""

    def _disconnect(self) -> None:
        """After a fault, once the epoch's flag is up (a peer that sees its connection go reads why there): close
        what the group still holds open to its peers (a backend whose abort did that does nothing)."""

    # ---- the shared wait --------------------------------------------------------------------------------------
    def _wait(self, name: str, work, progress: Progress) -> None:
        """Wait for one piece, watching the fault flag and the progress deadline; the piece counts as progress."""
        fault_key = GroupKeys.fault(self.epoch)
        while not self._wait_for(work, self.config.poll_s):
            if self.on_poll is not None:
                self.on_poll()
            if self.fault_seen(self.epoch) if self.fault_seen is not None else self.store.check([fault_key]):
                _, reason = fault_time_and_reason(self.store.get(fault_key))
                raise FaultDetected(f"{name} in epoch {self.epoch} abandoned: {reason}", raised_here=False)
            if progress.expired():
                raise TimeoutError(f"{name} made no progress for {self.timeout_s} s ({progress.pieces} "
                                   f"piece(s) of at most {self.config.chunk_mb} MiB completed)")
        work.wait()
        progress.advanced()

    def _guarded(self, name: str, body: Callable[[], None]) -> None:
        """Run a collective; any failure becomes :class:`FaultDetected`, aborts this group and (when seen here
        first) raises the epoch's fault flag."""
        if self.failed:
            raise FaultDetected(f"{name} on a failed group of epoch {self.epoch}", raised_here=False)
        try:
            body()
        except FaultDetected:
            self._fail()
            self._disconnect()
            raise
        except Exception as error:  # the backend's own error (peer reset, its timeout) or our deadline
            reason = (
                f"replica {self.replica} rank {self.rank}: {name} in epoch {self.epoch} failed: "
                f"{type(error).__name__}: {str(error)[:200]}"
            )
            # releasing what is pending (NCCL's abort: 1.0 s on an H200, longer while device work queued before the
            # collective finishes, docs/platform.md) needs no store, and the flag, which tells the other members,
            # needs no communicator: side by side. The caller returns once both are done: until the abort returns,
            # a kernel of the failed collective may still write into the tensors it was given.
            failures: list[BaseException] = []
            releasing = threading.Thread(target=self._fail_into, args=(failures,), daemon=True,
                                         name="titan-recover-ftpg-release")
            releasing.start()
            first = True
            try:
                _, flagged = fault_time_and_reason(raise_fault_flag(self.store, self.epoch, reason))
                first = flagged == reason
            except Exception as store_error:  # the store is lost too: the fault stands, with both reasons
                reason += f"; raising the epoch's fault flag failed: {type(store_error).__name__}: {store_error}"
            releasing.join()
            if failures:
                reason += f"; releasing the group failed: {type(failures[0]).__name__}: {failures[0]}"
            self._disconnect()
            if not first:  # another member's failure came first (this one may be its consequence: a closed peer)
                raise FaultDetected(f"{name} in epoch {self.epoch} abandoned: {flagged} (here: {reason})",
                                    raised_here=False) from error
            raise FaultDetected(reason, raised_here=True) from error

    def _fail(self) -> None:
        self.failed = True
        self._abort()

    def _fail_into(self, failures: list[BaseException]) -> None:
        """:meth:`_fail` on another thread, its exception (if any) appended to ``failures``."""
        try:
            self._fail()
        except BaseException as error:  # noqa: BLE001 (reported in the fault's reason by the caller)
            failures.append(error)
