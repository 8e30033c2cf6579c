"""Loss of a full set of parameters on a fixed validation slice, in one process (the diloco syncer's global model,
a synchronous run's final parameters): the same model, the same tokens, comparable numbers.

The slice is the ``microbatches`` replica microbatch ids right after the job's training budget
(``training.steps`` steps of ``recover.replicas`` groups), ids that neither mode trains in that job.
"""

from __future__ import annotations

import torch

from titan_recover import platform

platform.activate()

from titan_recover.data.addressable import AddressableTokens  # noqa: E402


def plain_name(name: str) -> str:
    """A parameter's name as the plain model has it (activation-checkpoint and compile wrappers removed)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def accumulation_steps(training, batch_degree: int) -> int:
    """TorchTitan's gradient accumulation steps of one replica group."""
    if training.global_batch_size < 0:
        return 1
    return training.global_batch_size // (training.local_batch_size * batch_degree)


def validation_ids(config, microbatches: int, batch_degree: int = 1) -> list[int]:
    first = config.training.steps * max(1, config.recover.replicas) * accumulation_steps(config.training, batch_degree)
    return list(range(first, first + microbatches))


class Validator:
    """Builds the config's model once (CPU, no parallelism) and evaluates parameter sets by name. ``shard_degree``:
    the replica group's data-parallel degree (a replica microbatch is that many local batches)."""

    def __init__(self, config, microbatches: int, shard_degree: int = 1):
        self.model = config.model_spec.model.build()
        self.model.init_weights(buffer_device=None)
        self.model.eval()
        data = config.dataloader
        self.tokens = AddressableTokens(data.dataset_path, config.training.seq_len, shuffle=data.shuffle,
                                        seed=data.seed)
        self.ids = validation_ids(config, microbatches, shard_degree)
        self.shard_degree = shard_degree
        self.local_batch = config.training.local_batch_size

    @torch.no_grad()
    def loss(self, parameters: dict[str, torch.Tensor]) -> float:
        """Mean token cross-entropy of the model with ``parameters`` (names as the plain model has them)."""
        own = dict(self.model.named_parameters())
        missing = sorted(set(own) - set(parameters))
        if missing:
            raise KeyError(f"parameters missing for validation: {missing[:5]}")
        for name, p in own.items():
            p.copy_(parameters[name].reshape(p.shape).to(p.dtype))
        total, count = 0.0, 0
        for g in self.ids:
            for shard in range(self.shard_degree):
                inputs, labels = self.tokens.microbatch(g, shard, shard_degree=self.shard_degree,
                                                        batch_size=self.local_batch, with_positions=False)
                logits = self.model(inputs["input"])
                total += float(torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum"))
                count += labels.numel()
        return total / count
