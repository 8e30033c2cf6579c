"""The ``nccl`` backend of the fault-tolerant group: a NCCL communicator per (membership epoch, rank), on the device.

Tensors never leave the device. Each epoch's group creates its own communicator from the epoch's store prefix
(``ProcessGroupNCCL`` with ``config.blocking = False``: a non-blocking communicator, whose abort returns even while
a kernel waits on a dead peer), connected on the device at the group's first collective, inside the same guard as
the collective (a peer lost while connecting is a fault of the epoch, not a crash), on a thread of its own that also
runs the communicator's own first collective (a non-blocking communicator finishes its initialisation at its first
use): the group holds a communicator only once it is ready. A collective is issued in
pieces, all at once (NCCL queues them on its stream in order), and the caller's thread polls each piece's
completion (``work.is_completed()``, a query of its CUDA event) together with the epoch's fault flag and the
progress deadline (:mod:`.polled`). On a fault the communicator is aborted (``ncclCommAbort``), which releases the
kernels still waiting, and the group is never used again: the next epoch creates a new communicator, and the
previous epoch's is aborted once the new group exists (:meth:`NcclGroup.close`). An aborted communicator is let go
at once, off the training thread (:func:`_let_go`): what it holds (its device buffers, the inputs of pieces never
waited for) is freed, where a failed group kept alive would keep up to a gradient on the device per fault.

NCCL's own watchdog never decides for this group: the communicator is created with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (read by each ``ProcessGroupNCCL`` when it is constructed; the process's
other groups keep theirs), so an error on a piece (a peer's connection reset) marks the piece failed instead of
tearing the process down, and the wait here turns it into a fault; and its timeout (the group's, which NCCL applies
to every piece from its issue, whatever a collective's options say) is :data:`WATCHDOG`, far behind the progress
deadline.

Why this and not ``torch.distributed.shrink_group`` or a communicator in a subprocess (torchft's
``ProcessGroupBabyNCCL``): docs/replica_groups.md, "Backends". Run on one GPU as a group of one only
(docs/platform.md, "What ran on a GPU"); never with two ranks.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Callable

import torch
from torch.distributed import PrefixStore, Store
from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions, ReduceOp

from titan_recover.platform import bind_thread, synchronize
from titan_recover.recover.ftpg.base import register_backend
from titan_recover.recover.ftpg.polled import (check_contiguous, let_go, pieces_of, PolledGroup, Progress,
                                               rendezvous_client)
from titan_recover.recover.groups.keys import GroupKeys

_QUERY_S = 0.0005
"""How often a waiting thread queries a piece's CUDA event (a query is cheap; a NCCL piece has no future to sleep
on that completes on the host)."""


WATCHDOG = timedelta(days=7)
"""NCCL's timeout for this group's pieces: NCCL counts it from each piece's issue, for every piece of a collective
issued at once, so any finite bound would fail a big collective that still makes progress; the progress deadline
(:class:`~.polled.Progress`) and the fault flag end a stuck one, by aborting the communicator."""

ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CONNECT_THREAD = "titan-recover-nccl-connect"
"""The thread on which a group's communicator is built and connected (:class:`_Connecting`)."""
RELEASE_THREAD = "titan-recover-nccl-release"
"""The thread on which a communicator a group is done with is aborted (if asked) and destroyed (:func:`_let_go`)."""


@register_backend("nccl")
class NcclGroup(PolledGroup):
    """The NCCL communicator of one rank of each of one epoch's member replicas, on this rank's device."""

    def __init__(self, store, **kwargs):
        super().__init__(store, **kwargs)
        if self.device.type != "cuda":
            raise ValueError(f"[recover.ftpg] backend = \"nccl\" needs CUDA tensors; this rank's device is "
                             f"{self.device} (use backend = \"auto\" or \"gloo\")")
        self.pg = None
        """The communicator, connected by the first collective (inside its guard)."""
        self._lock = threading.Lock()
        """Between the thread that connects the communicator and a fault's abort on the caller's thread."""

    def _communicator(self, name: str):
        """Connect the communicator (first collective of the group) on a thread of its own, waited for as a piece
        is: the fault flag and the progress deadline end the wait. A rank other than the communicator's root waits
        in the store for the root's unique id, blocking, up to the store's timeout; a root lost before it built its
        group (a joiner of a lower replica that died) would otherwise hold this thread, and the flag, that long. A
        communicator that arrives after the group failed is aborted and let go by the connecting thread."""
        if self.pg is None:
            prefix = PrefixStore(GroupKeys.group_prefix(self.epoch, self.rank, self.tag),
                                 rendezvous_client(self.store))
            self._wait(f"{name} (connecting)", _Connecting(lambda: self._connect_unless_failed(prefix)),
                       Progress(self.timeout_s))
        return self.pg

    def _connect_unless_failed(self, store: Store) -> None:
        pg = self._connect(store, self.group_rank, len(self.members))
        with self._lock:
            self.pg = pg
            if self.failed:  # the caller gave up meanwhile: nobody else will let it go
                _let_go(self, abort=True)

    def _connect(self, store: Store, group_rank: int, size: int):
        """A new non-blocking communicator of this epoch, ready: connected and its first collective through. Only
        then does the group hold it, so a fault's abort never meets one still initialising (NCCL's abort waits for
        the communicator's lock, which its initialisation holds, up to ``TORCH_NCCL_NONBLOCKING_TIMEOUT``). A
        failure aborts it here, on this thread. Tests replace it with a fake."""
        from torch.distributed import ProcessGroupNCCL

        bind_thread(self.device)
        # the time NCCL allows a non-blocking init or abort before giving up (torchft sets it the same way). torch
        # reads it once per process: the launcher sets it before the process starts; this covers one it did not
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(max(self.timeout_s, 1))))
        options = ProcessGroupNCCL.Options()
        options.config.blocking = False
        options._timeout = WATCHDOG
        with _environment(ASYNC_ERROR_HANDLING_ENV, "0"):  # errors are ours to handle: no teardown by the watchdog
            pg = ProcessGroupNCCL(store, group_rank, size, options)
        try:
            pg.eager_connect_single_device(self.device)  # the unique id exchanged, NCCL's init started
            self._first_collective(pg)  # a non-blocking communicator's init completes at its first use
            return pg
        except BaseException as error:
            pg.abort()
            # destroyed here, off the training thread where the error is raised again: no frame of its traceback
            # may hold it (its destructor joins NCCL's watchdog)
            traceback.clear_frames(error.__traceback__)
            del pg
            raise

    def _first_collective(self, pg) -> None:
        """A one-element all-reduce on ``pg`` (every member issues it, at its own connection), on a stream of its
        own (queued behind nothing of the training's), waited for within the group's timeout: the communicator's
        initialisation and NCCL's connections to its peers happen here, on the connecting thread, where the
        caller's wait watches the fault flag, not inside a collective the caller issues."""
        with _own_stream(self.device):
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            work = pg.allreduce([torch.zeros(1, device=self.device)], opts)
        progress = Progress(self.timeout_s)
        while not work.is_completed():
            if progress.expired():
                raise TimeoutError(f"the communicator's first collective did not complete in {self.timeout_s} s")
            time.sleep(_QUERY_S)
        _raise_if_failed(work)

    def close(self) -> None:
        """Abort the communicator of a group that is done with (a new epoch's group replaces it), off the caller's
        thread (:func:`_let_go`): ``ProcessGroupNCCL.abort`` of an idle communicator took 1.0 s on an H200 (torch
        2.11, NCCL 2.28; docs/platform.md), time an epoch change would otherwise wait. Nothing is pending on it: the
        group's collectives all completed, or it would have failed."""
        if self.pg is not None and not self.failed:
            self.failed = True
            _let_go(self, abort=True)

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        self.allreduce_many_([tensor])

    def allreduce_many_(self, tensors: list[torch.Tensor], before_piece=None) -> None:
        self._check_device(tensors)
        self._guarded("allreduce", lambda: self._collective("allreduce", tensors, root=None,
                                                            before_piece=before_piece))

    def broadcast_many_(self, tensors: list[torch.Tensor], root_replica: int, on_each=None) -> None:
        self._check_device(tensors)
        root = self.members.index(root_replica)
        self._guarded("broadcast", lambda: self._collective("broadcast", tensors, root=root, on_each=on_each))

    def _check_device(self, tensors: list[torch.Tensor]) -> None:
        """A caller's mistake, not a fault of the epoch: raised before anything is issued."""
        check_contiguous(tensors)
        off = [str(t.device) for t in tensors if t.device != self.device]
        if off:
            raise ValueError(f"the nccl group of {self.device} was given tensors on {sorted(set(off))}")

    def _collective(self, name: str, tensors: list[torch.Tensor], root: int | None, on_each=None,
                    before_piece=None) -> None:
        pieces = pieces_of(tensors, self.config.chunk_bytes)
        self._communicator(name)
        works = []
        for piece in pieces:
            if before_piece is not None:  # queued on the caller's stream, which NCCL's stream waits for
                before_piece(*piece)
            # no local reference to the communicator: a fault's traceback keeps this frame, and the communicator
            # must be let go off this thread (:func:`_let_go`)
            works.append(self._issue(self.pg, piece[2], root))
        progress = Progress(self.timeout_s)
        last = {index: i for i, (index, _, _) in enumerate(pieces)}
        reported = 0
        for i, work in enumerate(works):
            self._wait(name, work, progress)
            index = pieces[i][0]
            if on_each is not None and last[index] == i:
                synchronize(self.device)  # the callback reads the tensor on the host: its pieces must be done
                while reported <= index:
                    on_each(reported)
                    reported += 1
        if on_each is not None:
            for index in range(reported, len(tensors)):
                on_each(index)

    @staticmethod
    def _issue(pg, view: torch.Tensor, root: int | None):
        if root is None:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            return pg.allreduce([view], opts)
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return pg.broadcast([view], opts)

    # ---- PolledGroup ------------------------------------------------------------------------------------------
    def _wait_for(self, work, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_QUERY_S)
        _raise_if_failed(work)
        return True

    def _abort(self) -> None:
        with self._lock:  # a communicator still connecting is let go by its thread (failed is set first)
            if self.pg is not None:
                self.pg.abort()
                _let_go(self)  # a failed group is never used again (its ``failed`` says so)


class _Connecting:
    """A communicator's connection on a thread of its own, as a piece the caller's wait polls
    (:meth:`PolledGroup._wait`): complete once the thread ended; ``wait()`` raises what it raised."""

    def __init__(self, connect: Callable[[], None]):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(connect,), daemon=True, name=CONNECT_THREAD)
        self.thread.start()

    def _run(self, connect: Callable[[], None]) -> None:
        try:
            connect()
        except BaseException as error:  # noqa: BLE001 (raised on the caller's thread by wait())
            self.error = error

    def is_completed(self) -> bool:
        return not self.thread.is_alive()

    def exception(self) -> None:
        """Nothing (read before ``wait()``, as a NCCL piece's error is): ``wait()`` raises the thread's error."""
        return None

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _raise_if_failed(work) -> None:
    """Raise the error of a NCCL piece that completed with one (``is_completed()`` is true once NCCL reported an
    error on it: a peer's connection reset), before anything calls its ``wait()``: torch's ``WorkNCCL::wait`` aborts
    the communicator on the calling thread before it raises (1.0-3.5 s on an H200, docs/platform.md), which would hold
    the fault flag behind the abort; the group's failure path aborts beside the flag (:meth:`PolledGroup._guarded`).
    ``Work.exception`` is marked deprecated by torch (it warns once) and has no replacement that does not wait; a
    torch without it, or whose ``exception`` is no longer implemented (as ``is_success`` is not), leaves the error
    to ``wait()`` as before."""
    exception = getattr(work, "exception", None)
    if exception is None:
        return
    try:
        error = exception()
    except NotImplementedError:
        return
    except Exception as unreadable:  # the binding could not hand the error over: the piece failed all the same
        error = unreadable
    if error is not None:
        raise RuntimeError(f"a NCCL piece failed: {error}")


def _own_stream(device: torch.device):
    """A context whose current stream is a new one of ``device`` (CUDA), else nothing."""
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else nullcontext()


def _let_go(group: NcclGroup, abort: bool = False) -> None:
    """Take ``group``'s communicator from it and drop the last reference on a thread of its own (:func:`let_go`),
    after aborting it there if ``abort``. Until it is destroyed it holds the inputs of every piece no one waited for
    (with torch's default of no ``recordStream``, NCCL keeps them alive until a wait, or until a later call on the
    training thread that a failed group never gets): gradient views that would keep a whole gradient on the device
    per fault. Its destructor joins NCCL's watchdog thread, which may still be writing its debug dump, so it must
    not run on the training thread."""
    let_go(group, "pg", name=RELEASE_THREAD, first=(lambda pg: pg.abort()) if abort else None)


@contextmanager
def _environment(name: str, value: str):
    """``name`` set to ``value`` inside the block, as it was after (put back by replacing it, in place, where it was
    set before: the launcher sets it in every process, launcher.NCCL_ASYNC_ERROR_HANDLING_ENV)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
