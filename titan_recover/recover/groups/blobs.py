"""Byte payloads in a TCPStore: the store server refuses messages above 8 MB, so a payload is written as pieces of
at most 4 MB under ``{prefix}/{i}`` and read back by size. Used by the snapshot keepers and the diloco syncer."""

from __future__ import annotations

import numpy as np
import torch

PIECE_BYTES = 4 * 2**20


def piece_key(prefix: str, piece: int) -> str:
    return f"{prefix}/{piece}"


def pieces_of(nbytes: int) -> int:
    return (nbytes + PIECE_BYTES - 1) // PIECE_BYTES


def put_blob(store, prefix: str, payload: torch.Tensor | np.ndarray) -> int:
    """Write a CPU byte tensor (or array) in pieces; returns its size in bytes. The caller writes its own
    completion mark afterwards: a reader must never see a half-written payload as complete."""
    data = payload.numpy() if isinstance(payload, torch.Tensor) else payload
    for piece, at in enumerate(range(0, len(data), PIECE_BYTES)):
        store.set(piece_key(prefix, piece), data[at : at + PIECE_BYTES].tobytes())
    return len(data)


def get_blob(store, prefix: str, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` bytes written by :func:`put_blob` under ``prefix``, as a CPU uint8 tensor."""
    data = bytearray().join(store.get(piece_key(prefix, piece)) for piece in range(pieces_of(nbytes)))
    if len(data) != nbytes:
        raise ValueError(f"{prefix}: {len(data)} bytes stored, {nbytes} expected")
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def delete_blob(store, prefix: str, nbytes: int) -> None:
    for piece in range(pieces_of(nbytes)):
        store.delete_key(piece_key(prefix, piece))

