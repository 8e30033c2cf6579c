"""The fault-tolerant group's contract: the interface every backend implements, their registry, ``[recover.ftpg]``
and the factory that builds the configured backend.

A backend is one class and one registration::

    @register_backend("mine")
    class MyGroup(FaultTolerantGroup):
        def __init__(self, store, *, config, epoch, members, replica, rank, timeout_s, device, on_poll=None,
                     fault_seen=None, tag=""):
            ...

after which ``[recover.ftpg] backend = "mine"`` picks it (``auto`` is not a class: :func:`build_group` resolves it
to ``nccl`` for CUDA devices and ``gloo`` otherwise). Every module of this package is imported with it, so a
backend in a new module here registers by existing; one declared elsewhere registers when its module is imported.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed import Store

from titan_recover.registry import Registry


class FaultDetected(RuntimeError):
    """A collective across replicas failed, timed out, or another member raised the epoch's fault flag."""

    def __init__(self, reason: str, *, raised_here: bool):
        super().__init__(reason)
        self.reason = reason
        self.raised_here = raised_here
        """This member saw the failure first and raised the epoch's fault flag (False: it answered the flag)."""


class FaultTolerantGroup(abc.ABC):
    """Collectives over the same rank of each of one epoch's member replicas, that end in
    :class:`FaultDetected` (never a hang) when a member fails, the collective stops making progress for the
    timeout, or the epoch's fault flag is up.

    A group is never reused after a fault: the next epoch builds a new one. Its owner closes a group it is done
    with (:meth:`close`)."""

    epoch: int
    """The membership epoch the group belongs to."""
    members: tuple[int, ...]
    """The member replicas, sorted; a member's group rank is its index here."""

    @property
    def size(self) -> int:
        return len(self.members)

    def close(self) -> None:
        """The owner is done with this group (the next epoch's replaces it, a state transfer is over; failed or
        not): release what it holds (connections, threads, buffers) without blocking the caller; the group is
        never used again. Default: nothing."""

    @abc.abstractmethod
    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (contiguous, on the group's device or the host) over the members, in place."""

    def allreduce_many_(self, tensors: list[torch.Tensor],
                        before_piece: Callable[[int, int, torch.Tensor], None] | None = None) -> None:
        """Sum each tensor over the members, in place, as one collective. ``before_piece(index, start, view)`` is
        called, in order, just before a part of tensor ``index`` (elements ``start`` to ``start + view.numel()``)
        is first written by the collective: the caller may still read it there (a backup taken piece by piece,
        overlapping the reduction of the pieces before). This default reduces tensor by tensor."""
        for index, tensor in enumerate(tensors):
            if before_piece is not None:
                before_piece(index, 0, tensor.view(-1))
            self.allreduce_sum_(tensor)

    def broadcast_(self, tensor: torch.Tensor, root_replica: int) -> None:
        """Replace ``tensor`` with ``root_replica``'s, in place."""
        self.broadcast_many_([tensor], root_replica)

    @abc.abstractmethod
    def broadcast_many_(self, tensors: list[torch.Tensor], root_replica: int,
                        on_each: Callable[[int], None] | None = None) -> None:
        """Broadcast each tensor from ``root_replica`` in order; ``on_each(i)`` is called on the caller's thread
        as soon as tensor ``i`` is through, in order."""


BACKENDS: Registry[type[FaultTolerantGroup]] = Registry("fault-tolerant group backend")


def register_backend(name: str) -> Callable[[type[FaultTolerantGroup]], type[FaultTolerantGroup]]:
    """Class decorator: ``[recover.ftpg] backend = name`` builds this class."""
    return BACKENDS.register(name)


def backends() -> list[str]:
    return BACKENDS.names()


AUTO = "auto"
"""``[recover.ftpg] backend = "auto"``: ``nccl`` where the job's device is CUDA, ``gloo`` elsewhere."""


@dataclass(kw_only=True, slots=True)
class FTPGConfig:
    """``[recover.ftpg]``: the fault-tolerant group across replica groups (docs/replica_groups.md)."""

    backend: str = AUTO
    """Registered backend, or ``auto`` (``nccl`` on CUDA devices, ``gloo`` elsewhere). ``gloo``: gloo collectives
    issued asynchronously and polled for the epoch's fault flag and the deadline; CUDA tensors are staged through
    pinned host chunks. ``nccl``: a NCCL communicator per (epoch, rank) on the device, non-blocking, aborted on a
    fault (docs/replica_groups.md, "Backends")."""

    poll_s: float = 0.01
    """How often a member waiting on a collective looks at the epoch's fault flag and the deadline: a member
    whose peers gloo leaves waiting is released within this much of the flag being raised."""

    chunk_mb: float = 64.0
    """A collective's unit of progress: tensors are reduced / broadcast in chunks of at most this many MiB, and
    ``[recover] collective_timeout_s`` is the time allowed without one completing (never the time for the whole
    tensor). Also the size of a pinned staging buffer."""

    in_flight: int = 2
    """Chunks issued and not yet complete at once (gloo; with CUDA tensors the staging buffers are
    ``in_flight + 1`` pinned chunks, so that device-to-host copy, reduction and host-to-device copy overlap)."""

    def __post_init__(self) -> None:
        if self.backend != AUTO:
            BACKENDS.get(self.backend)  # raises, naming the registered backends
        if self.poll_s <= 0:
            raise ValueError(f"recover.ftpg.poll_s must be > 0, got {self.poll_s}")
        if self.chunk_mb <= 0:
            raise ValueError(f"recover.ftpg.chunk_mb must be > 0, got {self.chunk_mb}")
        if self.in_flight < 1:
            raise ValueError(f"recover.ftpg.in_flight must be >= 1, got {self.in_flight}")

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * 2**20))

    def resolved_backend(self, device: torch.device) -> str:
        """The backend a group on ``device`` gets (``auto`` resolved)."""
        if self.backend == AUTO:
            return "nccl" if device.type == "cuda" else "gloo"
        return self.backend


def build_group(config: FTPGConfig, store: Store, *, epoch: int, members: tuple[int, ...], replica: int,
                rank: int, timeout_s: float, device: torch.device | str = "cpu",
                on_poll: Callable[[], None] | None = None, fault_seen: Callable[[int], bool] | None = None,
                tag: str = "") -> FaultTolerantGroup:
    """The configured backend's group of the ranks ``rank`` of ``epoch``'s ``members`` (``replica``: this
    rank's replica; ``device``: where the tensors it reduces live; ``tag``: a second group of the same epoch and
    rank over some of them, such as a state transfer's donor and joiners). ``on_poll`` is called while a
    collective waits (the rank is alive, not hung). ``fault_seen(epoch)``: whether the epoch's fault flag is up,
    answered without a store request (the membership client's heartbeat thread blocks on the flag); None: the
    group looks in the store at every poll. ``timeout_s``: the time a collective may go without progress."""
    if replica not in members:
        raise ValueError(f"replica {replica} is not a member of epoch {epoch} ({members})")
    device = torch.device(device)
    backend = BACKENDS.get(config.resolved_backend(device))
    return backend(store, config=config, epoch=epoch, members=tuple(members), replica=replica, rank=rank,
                   timeout_s=timeout_s, device=device, on_poll=on_poll, fault_seen=fault_seen, tag=tag)
