"""TorchTitan dataloader component over :class:`~titan_recover.data.addressable.AddressableTokens`.

Iterating it (as stock TorchTitan does) yields this data-parallel rank's local batches in the order
``n = c * dp_world_size + dp_rank`` for ``c = 0, 1, ...``, through torchdata's ``StatefulDataLoader`` (so its
position is checkpointed like any TorchTitan loader). The project's trainer does not iterate it: it asks for the
microbatch it needs by address (:meth:`AddressableDataLoader.microbatch`), which is what lets any replica compute
any microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from titan_recover import platform

platform.activate()  # before any TorchTitan module (the rule every module importing TorchTitan follows)

from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402

from titan_recover.data.addressable import AddressableTokens  # noqa: E402

_ENDLESS = 2**62  # an addressable stream has no end; epochs wrap inside AddressableTokens


class _RankLocalBatches(Dataset):
    def __init__(self, tokens: AddressableTokens, dp_rank: int, dp_world_size: int, batch_size: int, positions: bool):
        self.tokens, self.dp_rank, self.dp_world_size = tokens, dp_rank, dp_world_size
        self.batch_size, self.positions = batch_size, positions

    def __len__(self) -> int:
        return _ENDLESS

    def __getitem__(self, c: int):
        n = c * self.dp_world_size + self.dp_rank
        return self.tokens.rows(n * self.batch_size, self.batch_size, with_positions=self.positions)


class AddressableDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "python_docs"
        """Name shown in logs; the data itself is read from ``dataset_path``."""

        dataset_path: str | None = "data/python_docs"
        """Folder written by ``python -m titan_recover.data.prepare`` (tokens.bin, meta.json, tokenizer)."""

        shuffle: bool = True
        """Visit the token windows in a seeded pseudo-random order (an O(1) bijection per epoch)."""

        seed: int = 0
        """Seed of the window order."""

        document_positions: bool | None = None
        """Emit per-document ``positions`` (RoPE positions and block-causal masks). Unset: on when the model's
        attention takes document masks (FlexAttention, varlen), off for causal SDPA (the CPU fallback)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        tokenizer: Any = None,
        snapshot_every_n_steps: int | None = None,
        **_: Any,
    ):
        if config.dataset_path is None:
            raise ValueError("dataloader.dataset_path must name a prepared data folder")
        self.tokens = AddressableTokens(config.dataset_path, seq_len, shuffle=config.shuffle, seed=config.seed)
        self.local_batch_size = local_batch_size
        self.document_positions = config.document_positions is not False
        super().__init__(
            _RankLocalBatches(self.tokens, dp_rank, dp_world_size, local_batch_size, self.document_positions),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=None,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )

    def local_batch(self, n: int, batch_size: int | None = None):
        """Rows ``[n * b, (n + 1) * b)`` (``b`` = this loader's local batch size unless given)."""
        b = batch_size or self.local_batch_size
        return self.tokens.rows(n * b, b, with_positions=self.document_positions)

    def microbatch(self, g: int, shard_rank: int, *, shard_degree: int, batch_size: int | None = None):
        """Replica microbatch ``g``, shard rank ``shard_rank`` (see :mod:`titan_recover.data.addressable`)."""
        return self.tokens.microbatch(
            g,
            shard_rank,
            shard_degree=shard_degree,
            batch_size=batch_size or self.local_batch_size,
            with_positions=self.document_positions,
        )
