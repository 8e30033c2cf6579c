"""The fault-tolerant group's contract: the interface every backend implements, their registry, ``[recover.ftpg]``
and the factory that builds the configured backend.

A backend is one class and one registration::

    @register_backend("mine")
    class MyGroup(FaultTolerantGroup):
        def __init__(self, store, *, config, epoch, members, replica, rank, timeout_s, on_poll=None, tag=""):
            ...

after which ``[recover.ftpg] backend = "mine"`` picks it. Every module of this package is imported with it, so a
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
    :class:`FaultDetected` (never a hang) when a member fails, the deadline passes or the epoch's fault flag is up.

    A group is never reused after a fault: the next epoch builds a new one. Its owner keeps a failed group alive
    until the process exits (destroying one whose peer died may block)."""

    epoch: int
    """The membership epoch the group belongs to."""
    members: tuple[int, ...]
    """The member replicas, sorted; a member's group rank is its index here."""

    @property
    def size(self) -> int:
        return len(self.members)

    @abc.abstractmethod
    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the members, in place."""

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


@dataclass(kw_only=True, slots=True)
class FTPGConfig:
    """``[recover.ftpg]``: the fault-tolerant group across replica groups (docs/replica_groups.md)."""

    backend: str = "gloo"
    """Registered backend: ``gloo`` (gloo collectives issued asynchronously and polled for the epoch's fault flag
    and the deadline; CPU tensors)."""

    poll_s: float = 0.01
    """How often a member waiting on a collective looks at the epoch's fault flag and the deadline: a member
    whose peers gloo leaves waiting is released within this much of the flag being raised."""

    def __post_init__(self) -> None:
        BACKENDS.get(self.backend)  # raises, naming the registered backends
        if self.poll_s <= 0:
            raise ValueError(f"recover.ftpg.poll_s must be > 0, got {self.poll_s}")


def build_group(config: FTPGConfig, store: Store, *, epoch: int, members: tuple[int, ...], replica: int,
                rank: int, timeout_s: float, on_poll: Callable[[], None] | None = None,
                tag: str = "") -> FaultTolerantGroup:
    """The configured backend's group of the ranks ``rank`` of ``epoch``'s ``members`` (``replica``: this
    rank's replica; ``tag``: a second group of the same epoch and rank over some of them, such as a state
    transfer's donor and joiners). ``on_poll`` is called while a collective waits (the rank is alive, not hung)."""
    if replica not in members:
        raise ValueError(f"replica {replica} is not a member of epoch {epoch} ({members})")
    backend = BACKENDS.get(config.backend)
    return backend(store, config=config, epoch=epoch, members=tuple(members), replica=replica, rank=rank,
                   timeout_s=timeout_s, on_poll=on_poll, tag=tag)
