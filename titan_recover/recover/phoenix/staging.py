"""Host staging of a rank's tensors: host buffers and the copies between them and the tensors (docs/phoenix.md).

The state transfer's ring of chunk buffers (:mod:`titan_recover.recover.phoenix.state_transfer`) and the snapshots'
copy (:mod:`titan_recover.recover.phoenix.snapshots`) move bytes between a rank's tensors and host memory through
one small interface, chosen by where the tensors live (:func:`copies_for`):

* :class:`HostCopies` (CPU tensors): plain buffers, each copy done when it is asked for, nothing to wait for;
* :class:`StreamCopies` (CUDA tensors): pinned buffers, copies issued ``non_blocking`` on a dedicated CUDA stream
  behind the work already queued on the current stream, each batch marked by an event that the caller waits for
  (on the host before it reads or reuses a buffer, or on the device before the tensors change).

Tests replace either with a fake that defers its copies until their event is waited for.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

Pair = tuple[torch.Tensor, torch.Tensor]
"""(destination, source) of one copy."""


class CopyEvent(Protocol):
    def synchronize(self) -> None:
        """Block the calling thread until the copies it marks are complete."""


class Done:
    """The event of copies that completed when they were issued."""

    def synchronize(self) -> None:
        return None


class HostCopies:
    """Copies between CPU tensors and plain host buffers, done at once."""

    asynchronous = False
    """Copies may still run after :meth:`copy` returned (wait for their event before using their bytes)."""
    device = torch.device("cpu")
    """Where the tensors are."""

    def in_place(self, view: torch.Tensor) -> bool:
        """A slice of ``view`` can travel as itself (a CPU tensor: host memory already, no staging copy)."""
        return view.device.type == "cpu"

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A byte buffer in host memory."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, pairs: Iterable[Pair]) -> CopyEvent:
        """Copy each source into its destination; returns the event that marks them complete."""
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
        return Done()

    def wait_on_device(self, event: CopyEvent) -> None:
        """Order the work queued from now on on the current device stream after ``event`` (CPU: nothing)."""

    def join(self) -> None:
        """Order the work queued from now on on the current device stream after every copy issued (CPU: nothing)."""


class StreamCopies(HostCopies):
    """Copies between CUDA tensors and pinned host buffers on a dedicated stream of ``device``, so that they overlap
    the current stream's compute and the host's own work (a broadcast, a hash)."""

    asynchronous = True

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A pinned byte buffer: a device copy from or to it runs asynchronously."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, pairs: Iterable[Pair]) -> CopyEvent:
        """Issue the copies on the copy stream behind the work queued so far on the current stream (which wrote
        the sources or last read the destinations); returns the event recorded after them."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # a waiting thread sleeps instead of spinning
        event.record(self.stream)
        return event

    def wait_on_device(self, event: CopyEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def copies_for(tensors: Iterable[torch.Tensor]) -> HostCopies:
    """:class:`StreamCopies` on the device of the first CUDA tensor among ``tensors``, else :class:`HostCopies`
    (pinned memory only where CUDA is available: on a CPU-only machine pinning raises)."""
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)
    return HostCopies() if device is None else StreamCopies(device)
