"""``RecoverTrainer``: TorchTitan's ``Trainer`` with the project's config sections and addressable data.

Importing this module activates the platform (see :mod:`titan_recover.platform`) before TorchTitan's trainer is
imported, so on a CPU-only machine TorchTitan runs on CPU + gloo without edits to its files.

Hook overridden (TorchTitan's own implementation still serves any other loader):

* ``batch_generator``: microbatches come from the addressable loader by id, derived from the step counter, so
  the data position is a pure function of ``step`` (checkpoint-exact, and later: computable by any replica);
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from titan_recover import platform
from titan_recover.platform import PlatformConfig

platform.activate()

import torch  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titan_recover.data.loader import AddressableDataLoader  # noqa: E402
from titan_recover.recover import RecoverConfig  # noqa: E402


class RecoverTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        platform: PlatformConfig = field(default_factory=PlatformConfig)
        recover: RecoverConfig = field(default_factory=RecoverConfig)

    def batch_layout(self) -> tuple[int, int]:
        """``(batch_degree, batch_rank)``: data-parallel size and this rank's index (replicate-major)."""
        if self.parallel_dims.dp_enabled:
            mesh = self.parallel_dims.get_mesh("batch")
            return mesh.size(), mesh.get_local_rank()
        return 1, 0

    def microbatch_order(self, step: int) -> Iterator[int]:
        """Local-batch indices ``n`` this rank consumes in ``step`` (1-based), one per gradient-accumulation
        step: ``n = ((step - 1) * A + a) * dp + r``. With ``r = replica * shard_degree + shard``, ``n`` is
        microbatch ``g = ((step - 1) * A + a) * replicas + replica`` at shard rank ``shard``."""
        dp, r = self.batch_layout()
        accumulation = self.gradient_accumulation_steps
        for a in range(accumulation):
            yield ((step - 1) * accumulation + a) * dp + r

    def batch_generator(
        self, data_iterable: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        if not isinstance(self.dataloader, AddressableDataLoader):
            return super().batch_generator(data_iterable)
        # Read the step now: TorchTitan creates this iterator before the loop and advances ``self.step``
        # before the first ``next()``, when a generator body would only start running.
        return self._addressable_batches(first_step=self.step + 1)

    def _addressable_batches(self, first_step: int) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        local_batch = self.config.training.local_batch_size
        chunks = self.num_pipeline_parallel_microbatches
        step = first_step
        while True:
            for n in self.microbatch_order(step):
                start = time.perf_counter()
                input_dict, labels = self.dataloader.local_batch(n, local_batch)
                elapsed = time.perf_counter() - start
                for c in range(chunks):
                    part = slice(c * local_batch // chunks, (c + 1) * local_batch // chunks)
                    chunk_labels = labels[part]
                    self.metrics_processor.ntokens_since_last_log += chunk_labels.numel()
                    self.metrics_processor.data_loading_times.append(elapsed / chunks)
                    yield {k: v[part] for k, v in input_dict.items()}, chunk_labels
            step += 1
