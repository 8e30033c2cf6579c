"""Token sequences addressable in O(1) by index, from any process.

The token file is one stream of documents (``<bos> ... <eos>``). It is cut into ``n_windows`` windows of
``seq_len + 1`` tokens (stride ``seq_len``); sequence ``i`` is window ``perm_e(i mod n_windows)`` of epoch
``e = i // n_windows``, where ``perm_e`` is an affine bijection ``j -> (a * j + c_e) mod n_windows`` (``a`` coprime
with ``n_windows``; ``a`` and ``c_e`` drawn from the seed). So any sequence - and therefore any microbatch - is
computed from its index alone: no iteration state, no dependence on which replica or rank asks.

Addresses (see docs/data.md): a *replica microbatch* ``g`` is what one replica consumes in one forward/backward,
``batch_size x shard_degree`` sequences; shard rank ``s`` of it holds rows
``[(g * shard_degree + s) * batch_size, ... + batch_size)``.
"""

from __future__ import annotations

import json
import math
import pathlib
import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TokenFileMeta:
    dtype: str
    n_tokens: int
    vocab_size: int
    bos_id: int
    eos_id: int

    @classmethod
    def read(cls, folder: str | pathlib.Path) -> "TokenFileMeta":
        path = pathlib.Path(folder) / "meta.json"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: prepare the data first (python -m titan_recover.data.prepare --out {folder})"
            )
        raw = json.loads(path.read_text())
        return cls(**{k: raw[k] for k in ("dtype", "n_tokens", "vocab_size", "bos_id", "eos_id")})


class AddressableTokens:
    """Sequences of a prepared token folder, by global index. Cheap to construct; memory-maps the file."""

    def __init__(self, folder: str | pathlib.Path, seq_len: int, *, shuffle: bool = True, seed: int = 0):
        self.folder = pathlib.Path(folder)
        self.meta = TokenFileMeta.read(self.folder)
        self.seq_len = seq_len
        self.tokens = np.memmap(self.folder / "tokens.bin", dtype=np.dtype(self.meta.dtype), mode="r")
        if len(self.tokens) != self.meta.n_tokens:
            raise ValueError(f"{self.folder}/tokens.bin has {len(self.tokens)} tokens, meta.json says {self.meta.n_tokens}")
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"{self.folder} holds {len(self.tokens)} tokens, fewer than one sequence of {seq_len + 1}")
        self.shuffle = shuffle
        self.seed = seed
        rng = random.Random(seed)
        self._stride = 1
        if shuffle and self.n_windows > 1:
            while True:
                self._stride = rng.randrange(1, self.n_windows)
                if math.gcd(self._stride, self.n_windows) == 1:
                    break

    def window(self, index: int) -> int:
        """The window that global sequence ``index`` reads."""
        epoch, j = divmod(index, self.n_windows)
        if not self.shuffle:
            return j
        offset = random.Random(self.seed * 1_000_003 + epoch).randrange(self.n_windows)
        return (self._stride * j + offset) % self.n_windows

    def sequence(self, index: int) -> np.ndarray:
        start = self.window(index) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def rows(self, start: int, count: int, *, with_positions: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Sequences ``[start, start + count)`` as TorchTitan's ``({"input", "positions"}, labels)``.

        ``positions`` restart at 0 at every document start (after ``<eos>``) and at the window start, as
        TorchTitan's own text loader emits them for block-causal attention.
        """
        batch = np.stack([self.sequence(i) for i in range(start, start + count)])
        inputs, labels = batch[:, :-1], batch[:, 1:]
        out = {"input": torch.from_numpy(np.ascontiguousarray(inputs))}
        if with_positions:
            out["positions"] = torch.from_numpy(self.document_positions(inputs))
        return out, torch.from_numpy(np.ascontiguousarray(labels))

    def document_positions(self, inputs: np.ndarray) -> np.ndarray:
        length = inputs.shape[1]
        idx = np.broadcast_to(np.arange(length), inputs.shape)
        # a document starts at column 0 and right after each <eos>
        starts = np.zeros(inputs.shape, dtype=bool)
        starts[:, 0] = True
        starts[:, 1:] = inputs[:, :-1] == self.meta.eos_id
        last_start = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
        return (idx - last_start).astype(np.int64)

    def microbatch(
        self, g: int, shard_rank: int, *, shard_degree: int, batch_size: int, with_positions: bool = True
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Replica microbatch ``g``'s rows for shard rank ``shard_rank`` (``batch_size`` sequences)."""
        if not 0 <= shard_rank < shard_degree:
            raise ValueError(f"shard_rank {shard_rank} outside [0, {shard_degree})")
        return self.rows((g * shard_degree + shard_rank) * batch_size, batch_size, with_positions=with_positions)
