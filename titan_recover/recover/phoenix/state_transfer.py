"""Streaming a replica's training state from a live peer's memory: chunked, checksummed, no disk (docs/phoenix.md).

The state of one rank (the same rank of every replica holds the same shards) is a fixed-order list of tensors
(parameter shards, then every optimizer state tensor, sorted by name) plus small metadata (the step, the
learning-rate schedule, the optimizers' scalar hyperparameters, the RNG states). :func:`transfer` moves it from the
donor to every other participant of a broadcast: first a header (metadata and the shape / dtype of every tensor,
which the receiver checks against its own before touching anything), then the tensors' bytes in chunks of at most
``chunk_bytes``, then the 64-bit xxHash3 checksum of every chunk (hashed by each side after the chunk went through,
so donor and receivers hash at the same time). Large tensors travel as slices of themselves (no copy on CPU:
received straight into the receiver's tensor); small ones packed, and a GPU tensor's slices, go through a ring of
at most ``ring`` host buffers (:class:`ChunkRing`), pinned and copied on a side stream on a GPU, so that the
donor's device-to-host copy of the next chunks, the broadcast of the current ones and a receiver's host-to-device
copy of the previous ones overlap. Receivers write into their existing tensors in place, as the chunks arrive, so
references held by the optimizer and by FSDP2 stay valid; a failed check fails the transfer, the receiver's
metadata (step, schedule, RNG) is only loaded after the last chunk verified, and a joiner whose transfer failed is
not admitted: it asks again (a receiver is always a joiner, so its partly written tensors are never trained on).

``broadcast(tensor)`` is the only communication: it must make ``tensor`` (a CPU tensor) equal to the donor's, in
place, or raise (the fault-tolerant group's ``broadcast_``). Tests pass a fake.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import xxhash

from titan_recover.recover.phoenix.staging import copies_for, CopyEvent, Done, HostCopies

Broadcast = Callable[[torch.Tensor], None]
DEFAULT_CHUNK_BYTES = 64 * 2**20
DEFAULT_DIRECT_BYTES = 2**20
DEFAULT_RING = 4


class StateMismatch(RuntimeError):
    """The donor's state does not have the layout of the receiver's (a different model, sharding or optimizer)."""


class ChecksumError(RuntimeError):
    """A chunk arrived with a checksum different from the donor's: the transfer failed and must be redone."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a (possibly distributed) tensor: a DTensor's local shard, anything else itself."""
    from torch.distributed.tensor import DTensor  # imported here: the coordinator, which reads this module's
    # config, never moves a tensor and need not load DTensor (0.6 s of a process start)

    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor of the optimizers' per-parameter state (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``), local
    shards, in parameter order and by name: what a state transfer sends after the parameters, and what the parameter
    vote signs with them (docs/scout.md). Empty before the first optimizer step."""
    out = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p, {})
                out.extend(local_tensor(state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor))
    return out


@dataclass
class TrainingState:
    """What a step needs, as held by one rank (see docs/phoenix.md for the list)."""

    model_parts: list[torch.nn.Module]
    optimizers: Iterable[torch.optim.Optimizer]
    schedulers: Any
    """An object with ``state_dict()`` / ``load_state_dict()`` (TorchTitan's LR scheduler container)."""
    train_state: Any
    """The trainer's step and tokens seen, as TorchTitan's checkpointer holds them (``state_dict()`` /
    ``load_state_dict()``; its ``"step"`` is the step the state belongs to)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """More state a step needs, by name, each with ``state_dict()`` / ``load_state_dict()`` of JSON-able values
    (the quota policy's speed estimates)."""

    def ensure_optimizer_state(self) -> None:
        """Create the optimizer state a fresh replica lacks (torch optimizers create it on their first step), so
        that the received bytes have somewhere to go: one step on zero gradients, parameters restored after it."""
        for opt in self.optimizers:
            params = [p for group in opt.param_groups for p in group["params"]]
            if all(p in opt.state and opt.state[p] for p in params):
                continue
            grads = [p.grad for p in params]
            values = [p.detach().clone() for p in params]  # the dry step must not change the parameters
            for p in params:
                p.grad = torch.zeros_like(p)
            with torch.no_grad():
                opt.step()
                for p, value, grad in zip(params, values, grads):
                    p.copy_(value)
                    p.grad = grad

    def parameter_tensors(self) -> list[torch.Tensor]:
        """The local parameter shards, in model order: the first of :meth:`tensors`."""
        return [local_tensor(p.data) for part in self.model_parts for p in part.parameters()]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.parameter_tensors(), *optimizer_tensors(self.optimizers)]

    def metadata(self) -> dict[str, Any]:
        groups = [[{k: v for k, v in g.items() if k != "params" and _is_json_scalar(v)} for g in opt.param_groups]
                  for opt in self.optimizers]
        rng = {"cpu": _b64(torch.get_rng_state())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
        train_state = self.train_state.state_dict()
        return {"train_state": train_state, "schedulers": self.schedulers.state_dict(), "param_groups": groups,
                "rng": rng, "extra": {name: s.state_dict() for name, s in self.extra.items()}}

    def load_metadata(self, meta: dict[str, Any]) -> None:
        self.train_state.load_state_dict(meta["train_state"])
        self.schedulers.load_state_dict(meta["schedulers"])
        for opt, groups in zip(self.optimizers, meta["param_groups"]):
            for group, values in zip(opt.param_groups, groups):
                group.update(values)
        for name, stateful in self.extra.items():
            stateful.load_state_dict(meta["extra"][name])
        torch.set_rng_state(_unb64(meta["rng"]["cpu"]))
        if "cuda" in meta["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_unb64(s) for s in meta["rng"]["cuda"]])


def _is_json_scalar(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    return isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float)) for x in v)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def tensor_spec(tensors: list[torch.Tensor]) -> list[list]:
    return [[list(t.shape), str(t.dtype)] for t in tensors]


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise StateMismatch("state transfer needs contiguous tensors")
    return t.detach().reshape(-1).view(torch.uint8)


Segment = tuple[int, int, int]
"""(tensor index, byte offset in that tensor, length)."""


def plan_pieces(sizes: list[int], chunk_bytes: int, direct_bytes: int) -> list[tuple[bool, list[Segment]]]:
    """The broadcasts of a transfer, the same on both sides (a function of the tensor sizes only): a tensor of at
    least ``direct_bytes`` goes as slices of itself of at most ``chunk_bytes`` (``direct``: no copy on CPU);
    smaller ones are packed, in order, into staging chunks of at most ``chunk_bytes``."""
    pieces: list[tuple[bool, list[Segment]]] = []
    packed: list[Segment] = []
    room = chunk_bytes
    for index, size in enumerate(sizes):
        if size >= direct_bytes:
            pieces.extend((True, [(index, offset, min(chunk_bytes, size - offset))])
                          for offset in range(0, size, chunk_bytes))
            continue
        offset = 0
        while offset < size:
            n = min(size - offset, room)
            packed.append((index, offset, n))
            offset += n
            room -= n
            if room == 0:
                pieces.append((False, packed))
                packed, room = [], chunk_bytes
    if packed:
        pieces.append((False, packed))
    return pieces


def checksum(data: torch.Tensor) -> int:
    """xxHash3 (64 bits) of a CPU byte tensor, as a signed int64."""
    value = xxhash.xxh3_64_intdigest(data.numpy())
    return value - (1 << 64) if value >= 1 << 63 else value


def _send_text(text: str | None, broadcast: Broadcast) -> str:
    length = torch.tensor([len(text.encode()) if text is not None else 0], dtype=torch.int64)
    broadcast(length)
    payload = torch.zeros(int(length.item()), dtype=torch.uint8)
    if text is not None:
        payload.copy_(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))
    broadcast(payload)
    return bytes(payload.numpy()).decode()


@dataclass
class TransferStats:
    bytes: int
    chunks: int
    host_buffers: int = 0
    """Host buffers this side allocated for staged chunks (at most ``ring``)."""


def transfer(state: TrainingState, broadcast: Broadcast, *, is_donor: bool,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES, direct_bytes: int = DEFAULT_DIRECT_BYTES,
             broadcast_many: Callable[..., None] | None = None, ring: int = DEFAULT_RING,
             copies: HostCopies | None = None,
             digest: Callable[[torch.Tensor], int] | None = checksum) -> TransferStats:
    """Make every participant's state equal to the donor's (a collective: every participant calls it).
    ``broadcast_many(tensors, on_each)`` (optional): broadcast a list of tensors in order, all in flight at once,
    calling ``on_each(i)`` as each one is through (the fault-tolerant group's ``broadcast_many_``); default: one
    ``broadcast`` after the other. ``ring``: at most this many host buffers for the chunks that need one (the
    :class:`ChunkRing`); ``copies``: how bytes reach host memory (default: :func:`copies_for` the tensors).
    ``digest``: what each side computes of every chunk's host bytes (and of the header) and the receivers compare
    with the donor's, :func:`checksum` (the job's transfers never pass another); None: nothing is hashed or verified.
    Every participant must pass the same. Only ``benchmarks/state_transfer.py`` passes others, to price the digests
    (None) and to tell their hashing from their reads of memory (a hash of a cache-resident buffer as long).

    On the wire: the header (:func:`_exchange_header`), the chunks in order, the donor's digests in one tensor (one
    per chunk, then the header's: the metadata is loaded only after both verified)."""
    if ring < 1:
        raise ValueError(f"a state transfer needs a ring of at least one buffer, got {ring}")
    if not is_donor:
        state.ensure_optimizer_state()
    tensors = state.tensors()
    views = [bytes_view(t) for t in tensors]
    sizes = [v.numel() for v in views]
    header, text = _exchange_header(state, tensors, broadcast, is_donor=is_donor, chunk_bytes=chunk_bytes,
                                    direct_bytes=direct_bytes)
    pieces = plan_pieces(sizes, header["chunk_bytes"], header["direct_bytes"])
    chunks = ChunkRing(pieces, views, copies or copies_for(tensors), ring=ring, is_donor=is_donor,
                       digest=digest)
    digests = chunks.run(broadcast_many or _one_after_another(broadcast))
    header_digest = digest(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)) if digest else 0
    computed = torch.cat([digests, torch.tensor([header_digest], dtype=torch.int64)])
    donors = computed.clone()
    broadcast(donors)
    if not is_donor:
        _verify_chunks(computed, donors)
        state.load_metadata(header["meta"])
    return TransferStats(bytes=sum(sizes), chunks=len(pieces), host_buffers=chunks.allocated)


def _one_after_another(broadcast: Broadcast) -> Callable[..., None]:
    """``broadcast_many`` from a single ``broadcast``: each tensor in turn."""
    def broadcast_many(tensors: list[torch.Tensor], on_each) -> None:
        for i, t in enumerate(tensors):
            broadcast(t)
            on_each(i)

    return broadcast_many


def _exchange_header(state: TrainingState, tensors: list[torch.Tensor], broadcast: Broadcast, *, is_donor: bool,
                     chunk_bytes: int, direct_bytes: int) -> tuple[dict[str, Any], str]:
    """The donor's header (metadata, the layout of its tensors, its chunk sizes), sent by the donor and received by
    every participant, and its text as this side holds it (hashed with the chunks); raises :class:`StateMismatch`
    where this rank's tensors do not have the donor's layout."""
    header = None
    if is_donor:
        header = json.dumps({"meta": state.metadata(), "spec": tensor_spec(tensors), "chunk_bytes": chunk_bytes,
                             "direct_bytes": direct_bytes})
    text = _send_text(header, broadcast)
    try:
        received = json.loads(text)
    except json.JSONDecodeError as error:
        raise ChecksumError(f"the state transfer's header arrived damaged ({error})") from error
    _check_layout(received["spec"], tensor_spec(tensors))
    return received, text


def _check_layout(donor: list[list], here: list[list]) -> None:
    """Raise :class:`StateMismatch`, naming the first difference, unless the two tensor specs are equal."""
    if donor == here:
        return
    mismatch = next(i for i, (a, b) in enumerate(zip(donor, here)) if a != b) if len(donor) == len(here) else None
    raise StateMismatch(
        f"donor state has {len(donor)} tensors, this rank {len(here)}"
        + (f"; first difference at tensor {mismatch}: donor {donor[mismatch]}, here {here[mismatch]}"
           if mismatch is not None else "")
        + ": the joining replica must be built from the same config as the running ones"
    )


def plan_ring(staged: list[bool], ring: int) -> tuple[list[list[int]], list[int | None]]:
    """How the chunks go through a ring of ``ring`` host buffers, the same on both sides (a function of which
    chunks are ``staged``, i.e. need a host buffer): the windows, successive runs of chunk indices issued together
    with at most ``ring`` staged chunks each, and every chunk's buffer (the staged chunk ``k``-th among the staged
    ones uses buffer ``k % ring``; a chunk that travels in place uses none)."""
    windows: list[list[int]] = []
    slots: list[int | None] = []
    held = count = 0  # staged chunks in the current window, in all windows so far
    for index, needs_buffer in enumerate(staged):
        if not windows or (needs_buffer and held == ring):
            windows.append([])
            held = 0
        windows[-1].append(index)
        slots.append(count % ring if needs_buffer else None)
        count += needs_buffer
        held += needs_buffer
    return windows, slots


class ChunkRing:
    """The chunks of one transfer on one side, through at most ``ring`` host buffers.

    A chunk of a CPU tensor's slice travels as that slice (no copy); every other chunk (packed small tensors, a
    device tensor's slice) travels through a buffer of the ring. The windows of :func:`plan_ring` are issued one
    after the other with ``broadcast_many``; as chunk ``i`` is through, each side hashes it, a receiver starts
    writing it back into its tensors (``copies``, asynchronous on a GPU) and the donor starts filling its buffer
    with the chunk that uses it next. Before a window is issued the copies of its buffers are waited for: the
    donor's fill (the bytes are there), a receiver's write-back of the buffer's previous chunk (it may be
    overwritten). So the donor's device-to-host copy of the next window, the broadcast of this one and a
    receiver's host-to-device copy of the previous one overlap, and at most ``ring`` buffers ever exist."""

    def __init__(self, pieces: list[tuple[bool, list[Segment]]], views: list[torch.Tensor], copies: HostCopies, *,
                 ring: int, is_donor: bool, digest: Callable[[torch.Tensor], int] | None = checksum):
        self.pieces, self.views, self.copies, self.ring, self.is_donor = pieces, views, copies, ring, is_donor
        self.digest = digest
        staged = [not (direct and copies.in_place(views[segments[0][0]])) for direct, segments in pieces]
        self.windows, self.slots = plan_ring(staged, ring)
        self.staged = [i for i, needs_buffer in enumerate(staged) if needs_buffer]
        self.ordinal = {chunk: k for k, chunk in enumerate(self.staged)}
        self.buffer_bytes = max((_chunk_bytes(pieces[i]) for i in self.staged), default=0)
        self.buffers: list[torch.Tensor | None] = [None] * ring
        self.events: list[CopyEvent] = [Done()] * ring
        self.digests = torch.zeros(len(pieces), dtype=torch.int64)
        self.allocated = 0

    def run(self, broadcast_many: Callable[..., None]) -> torch.Tensor:
        """Broadcast every chunk, window after window; returns this side's digest of every chunk."""
        try:
            if self.is_donor:
                for chunk in self.staged[: self.ring]:
                    self._fill(chunk)
            for window in self.windows:
                buffers = [self._buffer(chunk) for chunk in window]
                for chunk in window:  # the donor's fill is done, a receiver's previous write-back from the buffer too
                    if self.slots[chunk] is not None:
                        self.events[self.slots[chunk]].synchronize()
                broadcast_many(buffers, lambda j, window=window, buffers=buffers: self._through(window[j], buffers[j]))
            for event in self.events:
                event.synchronize()
        finally:  # also after a failure: whatever trains next runs after the copies still in flight
            self.copies.join()
        return self.digests

    def _through(self, chunk: int, buffer: torch.Tensor) -> None:
        """Chunk ``chunk`` went through (while the later ones of its window travel)."""
        staged = self.slots[chunk] is not None
        if staged and not self.is_donor:
            self._write_back(chunk, buffer)
        if self.digest is not None:
            self.digests[chunk] = self.digest(buffer)  # the host bytes that went through
        if staged and self.is_donor:  # hashed: the buffer may take the chunk that uses it next
            following = self.ordinal[chunk] + self.ring
            if following < len(self.staged):
                self._fill(self.staged[following])

    def _buffer(self, chunk: int) -> torch.Tensor:
        """The bytes chunk ``chunk`` travels in: its tensor's slice, or its ring buffer (allocated at first use)."""
        segments = self.pieces[chunk][1]
        slot = self.slots[chunk]
        if slot is None:
            index, offset, n = segments[0]
            return self.views[index][offset : offset + n]
        if self.buffers[slot] is None:
            self.buffers[slot] = self.copies.host_buffer(self.buffer_bytes)
            self.allocated += 1
        return self.buffers[slot][: _chunk_bytes(self.pieces[chunk])]

    def _pairs(self, chunk: int, buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor slice, buffer slice) of every segment of a staged chunk."""
        pairs, at = [], 0
        for index, offset, n in self.pieces[chunk][1]:
            pairs.append((self.views[index][offset : offset + n], buffer[at : at + n]))
            at += n
        return pairs

    def _fill(self, chunk: int) -> None:
        """The donor starts copying a staged chunk's segments into its buffer."""
        pairs = self._pairs(chunk, self._buffer(chunk))
        self.events[self.slots[chunk]] = self.copies.copy((part, tensor) for tensor, part in pairs)

    def _write_back(self, chunk: int, buffer: torch.Tensor) -> None:
        """A receiver starts copying a staged chunk from its buffer into its tensors (before the digests are
        checked: a receiver is a joiner, whose failed transfer is redone before it trains)."""
        self.events[self.slots[chunk]] = self.copies.copy(self._pairs(chunk, buffer))


def _chunk_bytes(piece: tuple[bool, list[Segment]]) -> int:
    return sum(n for _, _, n in piece[1])


def _verify_chunks(computed: torch.Tensor, donors: torch.Tensor) -> None:
    """A receiver's check: raise :class:`ChecksumError` naming every chunk whose digest differs from the donor's
    (the last digest is the header's)."""
    bad = (computed != donors).nonzero().flatten().tolist()
    header = len(computed) - 1
    if bad:
        chunks = [i for i in bad if i != header]
        raise ChecksumError("the state transfer failed its checksum: "
                            + ", ".join(([f"chunk(s) {chunks}"] if chunks else [])
                                        + (["the header (metadata)"] if header in bad else [])))
