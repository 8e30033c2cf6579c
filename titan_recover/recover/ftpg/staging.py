"""Host staging of device tensors for a backend that reduces host memory (gloo): a ring of pinned chunks.

A piece of a CUDA tensor goes device -> pinned host slot (on a copy stream), through the host collective, and
back host -> device (on the same stream), with up to ``slots`` pieces in the ring: while piece ``i`` is reduced,
piece ``i + 1`` is copied out and piece ``i - 1`` copied back. A slot is reused only after its copy back has
completed (an event per slot). :meth:`HostStaging.begin` orders the copy stream after the work that produced the
tensors; :meth:`HostStaging.end` orders the caller's stream after the copies back.

Slots are allocated once per process (:func:`staging_for`) and reused by every group: pinning host memory is
slow. After a fault the ring is discarded (:func:`discard_staging`), since an abandoned collective may still be
writing into its slots; the next one allocates a fresh ring.
"""

from __future__ import annotations

import torch


class HostStaging:
    def __init__(self, device: torch.device, chunk_bytes: int, slots: int):
        self.device, self.chunk_bytes, self.slots = device, chunk_bytes, slots
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._free: list[torch.cuda.Event | None] = [None] * slots
        self.pinned = cuda and torch.cuda.is_available()

    def begin(self) -> None:
        """The copies out start after everything the caller's stream has queued (the tensors' producers)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def slot(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """The host buffer of piece ``i`` (slot ``i % slots``), shaped and typed as ``like``; waits until the slot's
        previous copy back is complete."""
        s = i % self.slots
        if self._free[s] is not None:
            self._free[s].synchronize()
            self._free[s] = None
        if self._buffers[s] is None:
            self._buffers[s] = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        nbytes = like.numel() * like.element_size()
        if nbytes > self.chunk_bytes:
            raise ValueError(f"a piece of {nbytes} bytes does not fit a staging slot of {self.chunk_bytes}")
        return self._buffers[s][:nbytes].view(like.dtype)

    def copy_out(self, piece: torch.Tensor, host: torch.Tensor) -> None:
        """Device -> host; returns once ``host`` holds the piece (the host collective reads it next)."""
        done = self._copy(host, piece)
        if done is not None:
            done.synchronize()

    def copy_back(self, i: int, host: torch.Tensor, piece: torch.Tensor) -> None:
        """Host -> device, queued on the copy stream; slot ``i % slots`` is free again once it has run."""
        self._free[i % self.slots] = self._copy(piece, host)

    def _copy(self, target: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event | None:
        """``target <- source``: at once without a stream, else queued on the copy stream (its event returned)."""
        if self.stream is None:
            target.copy_(source)
            return None
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # a waiting thread sleeps instead of spinning against gloo's
            done.record(self.stream)
        return done

    def end(self) -> None:
        """The caller's stream waits for every copy back (the caller may use the tensors at once)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


    def synchronize(self) -> None:
        """The host waits for every copy back (a callback may read the tensors)."""
        if self.stream is not None:
            self.stream.synchronize()


_RINGS: dict[tuple[str, int, int], HostStaging] = {}


def staging_for(device: torch.device, chunk_bytes: int, slots: int) -> HostStaging:
    """This process's ring for ``device`` (allocated on first use, then shared by every group)."""
    key = (str(device), chunk_bytes, slots)
    if key not in _RINGS:
        _RINGS[key] = HostStaging(device, chunk_bytes, slots)
    return _RINGS[key]


def discard_staging(staging: HostStaging) -> None:
    """Forget a ring an abandoned collective may still write into (its memory lives as long as that collective)."""
    for key, ring in list(_RINGS.items()):
        if ring is staging:
            del _RINGS[key]
