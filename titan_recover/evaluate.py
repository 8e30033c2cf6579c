"""Loss of a full set of parameters on a fixed validation slice, in one process (the diloco syncer's global model,
a synchronous run's final parameters): the same model, the same tokens, comparable numbers.

The slice is the ``microbatches`` replica microbatch ids right after the job's training budget
(``training.steps`` steps of ``recover.replicas`` groups), ids that neither mode trains in that job. The forward is
the training forward's: the loader's fields as TorchTitan's trainer passes them (per-document ``positions``) and,
for FlexAttention or varlen attention, the block-causal document masks TorchTitan's model builds from them.
"""

from __future__ import annotations

from collections.abc import Callable

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


def takes_masks(model) -> bool:
    """Whether the model's attention needs masks in its forward (FlexAttention, varlen): the test TorchTitan's
    ``Trainer.post_dataloading_process`` applies before it builds them."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    from torchtitan.models.common.decoder import Decoder

    if not isinstance(model.config, Decoder.Config):
        return False
    inner = getattr(model.config.first_attention, "inner_attention", None)
    return isinstance(inner, (FlexAttention.Config, VarlenAttention.Config))


def forward_arguments(model, inputs: dict[str, torch.Tensor], device: torch.device):
    """``(tokens, keywords)`` of the model's forward for a loader batch, as TorchTitan's trainer builds them
    (``Trainer.post_dataloading_process``): every field but ``input`` is a keyword (``positions``: RoPE positions
    that restart at every document), and a model that takes masks gets ``attention_masks`` from its own
    ``get_attention_masks(positions)`` (causal within each document)."""
    kwargs = {k: v.to(device) for k, v in inputs.items() if k != "input"}
    positions = kwargs.get("positions")
    if positions is not None and takes_masks(model):
        kwargs["attention_masks"] = model.get_attention_masks(positions=positions)
    return inputs["input"].to(device), kwargs


class Validator:
    """Builds the config's model once (no parallelism, float32, on ``device``: CPU unless told) and evaluates
    parameter sets by name. ``shard_degree``: the replica group's data-parallel degree (a replica microbatch is that
    many local batches)."""

    def __init__(self, config, microbatches: int, shard_degree: int = 1, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = config.model_spec.model.build()
        self.model.init_weights(buffer_device=None)
        self.model.to(self.device).eval()
        data = config.dataloader
        self.positions = getattr(data, "document_positions", False) is not False  # as the loader emits them
        if takes_masks(self.model) and not self.positions:
            raise ValueError("the model's attention (FlexAttention / varlen) takes document masks, built from the "
                             "loader's positions: dataloader.document_positions must not be false")
        self.tokens = AddressableTokens(data.dataset_path, config.training.seq_len, shuffle=data.shuffle,
                                        seed=data.seed)
        self.ids = validation_ids(config, microbatches, shard_degree)
        self.shard_degree = shard_degree
        self.local_batch = config.training.local_batch_size

    @torch.no_grad()
    def loss(self, parameters: dict[str, torch.Tensor], progress: Callable[[], None] | None = None) -> float:
        """Mean token cross-entropy of the model with ``parameters`` (names as the plain model has them);
        ``progress`` is called after every microbatch (a caller watched for hangs says it is alive)."""
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
                                                        batch_size=self.local_batch, with_positions=self.positions)
                tokens, kwargs = forward_arguments(self.model, inputs, self.device)
                logits = self.model(tokens, **kwargs)
                total += float(torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), labels.to(self.device).reshape(-1),
                    reduction="sum"))
                count += labels.numel()
                if progress is not None:
                    progress()
        return total / count
