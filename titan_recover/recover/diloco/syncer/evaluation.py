"""The global model's validation loss (docs/diloco.md, "End of the job and metrics"), computed in the syncer
process by :mod:`titan_recover.evaluate`, the code that evaluates a synchronous run's final parameters."""

from __future__ import annotations

import torch


class GlobalEvaluator:
    """Loss on the validation slice (``eval_microbatches`` replica microbatch ids right after the budget), on
    ``[recover.diloco] eval_device``: CPU unless a GPU is named (the launcher checked that no learner uses it). Needs
    the run's whole config (model, tokenizer, data); the validator is built at the first evaluation."""

    def __init__(self, config, ranks: int):
        self.config, self.ranks = config, ranks
        self.validator = None

    def loss(self, parameters: dict[str, torch.Tensor], progress=None) -> float:
        """``progress``: called after every validation microbatch (the syncer's beat)."""
        if self.validator is None:
            # imported here: titan_recover.evaluate loads TorchTitan's model and data code
            from titan_recover.config.validate import resolve_layout
            from titan_recover.evaluate import Validator

            layout = resolve_layout(self.config.parallelism, self.ranks)  # a learner's mesh
            device = torch.device(self.config.recover.diloco.eval_device)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # compiled kernels and the allocator's context there, not on cuda:0
            self.validator = Validator(self.config, self.config.recover.diloco.eval_microbatches,
                                       shard_degree=layout.dp_shard, device=device)
        return self.validator.loss(parameters, progress)
