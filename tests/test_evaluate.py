"""The validation loss (titan_recover/evaluate.py) of a FlexAttention model equals the training forward's loss on the
same tokens: the loader's batch, TorchTitan's trainer's forward arguments (per-document positions and the
block-causal masks its model builds), TorchTitan's cross-entropy.

FlexAttention runs here as it runs in the syncer on CPU: TorchTitan's torch.compile'd ``flex_attention`` through
inductor's CPU code (forward only; the first compile takes ~35 s, later runs read inductor's cache).
"""

from __future__ import annotations

import types

import pytest
import torch

FLEX_RUN = ["--model.flavor", "tiny", "--platform.attention", "model", "--training.seq_len", "256",
            "--training.local_batch_size", "2", "--training.steps", "1", "--recover.diloco.eval_microbatches", "2"]


@pytest.fixture(scope="module")
def flex_config(default_data):
    from titan_recover.job_config import build_config

    config = build_config(None, [*FLEX_RUN, "--dataloader.dataset_path", str(default_data)])
    from torchtitan.models.common.attention import FlexAttention  # after build_config has activated the platform

    assert all(isinstance(layer.attention.inner_attention, FlexAttention.Config)
               for layer in config.model_spec.model.layers)
    assert config.dataloader.document_positions is True
    return config


def other_parameters(config) -> dict[str, torch.Tensor]:
    """A parameter set that is not the validator's own initialisation, with sharp attention that weighs in the
    residual stream (as trained attention does; at initialisation it is nearly uniform and small): which tokens a
    token attends to then changes the loss visibly."""
    model = config.model_spec.model.build()
    torch.manual_seed(7)
    model.init_weights(buffer_device=None)
    scale = {"attention.qkv_linear.wqkv.weight": 5.0, "attention.wo.weight": 20.0}
    return {name: p.detach() * next((v for k, v in scale.items() if name.endswith(k)), 1.0)
            for name, p in model.named_parameters()}


def training_forward_loss(config, parameters, ids, *, causal_only: bool = False) -> tuple[float, int]:
    """Mean token loss of TorchTitan's training forward: the learner's loader batch, TorchTitan's
    ``Trainer.post_dataloading_process`` (run on a stand-in holding what it reads), the model, TorchTitan's
    cross-entropy. ``causal_only``: one causal mask over the whole row instead (what forcing SDPA computes). Also
    returns how many rows hold a document start after their first token."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.trainer import Trainer

    from titan_recover.data.loader import AddressableDataLoader

    model = config.model_spec.model.build()
    model.load_state_dict(parameters, strict=False)
    model.eval()
    loader = AddressableDataLoader(config.dataloader, dp_world_size=1, dp_rank=0, seq_len=config.training.seq_len,
                                   local_batch_size=config.training.local_batch_size)
    # what the method reads of its trainer; one process without context parallelism, whose inputs get no SPMD type
    # annotations (the "spmd_types" backend only annotates the tensors, it does not change them)
    trainer = types.SimpleNamespace(
        model_config=config.model_spec.model, model_parts=[model], ntokens_seen=0,
        parallel_dims=types.SimpleNamespace(cp_enabled=False),
        config=types.SimpleNamespace(parallelism=types.SimpleNamespace(spmd_backend="partial_dtensor")))
    total, count, documents = 0.0, 0, 0
    with torch.no_grad():
        for g in ids:
            input_dict, labels = loader.microbatch(g, 0, shard_degree=1)
            documents += int((input_dict["positions"][:, 1:] == 0).any(dim=1).sum())
            if causal_only:
                row = torch.arange(labels.shape[1]).expand_as(labels)
                input_dict = {"input": input_dict["input"], "positions": row}
            inputs, labels, kwargs = Trainer.post_dataloading_process(trainer, input_dict, labels)
            total += float(cross_entropy_loss(model(inputs, **kwargs), labels))
            count += labels.numel()
    return total / count, documents


@pytest.mark.multiprocess  # not a process tree, but FlexAttention compiles through inductor: 35-60 s on a cold host
def test_validator_of_a_flex_model_gives_the_training_forward_loss(flex_config):
    """The old validator called the model with tokens only: FlexAttention asserted that a BlockMask is passed. The
    diloco syncer's evaluator (on its default device, the CPU) computes the same number."""
    from titan_recover.evaluate import validation_ids, Validator
    from titan_recover.recover.diloco.syncer.evaluation import GlobalEvaluator

    validator = Validator(flex_config, microbatches=2)
    parameters = other_parameters(flex_config)
    ids = validation_ids(flex_config, 2)
    expected, documents = training_forward_loss(flex_config, parameters, ids)
    assert documents > 0  # the slice packs several documents into a row: the document masks matter

    assert validator.loss(parameters) == pytest.approx(expected, rel=1e-6)
    assert next(validator.model.parameters()).device == torch.device("cpu")  # the default device
    evaluator = GlobalEvaluator(flex_config, ranks=1)
    beats = []  # the syncer beats between microbatches: a long evaluation is not a hang
    assert evaluator.loss(parameters, progress=lambda: beats.append(1)) == pytest.approx(expected, rel=1e-6)
    assert len(beats) == 2
    assert evaluator.validator.device == torch.device("cpu")
    causal, _ = training_forward_loss(flex_config, parameters, ids, causal_only=True)
    assert abs(causal - expected) > 1e-3, (causal, expected)  # what forcing SDPA would compute


def test_validator_refuses_a_flex_model_without_document_positions(flex_config, default_data):
    from titan_recover.evaluate import Validator
    from titan_recover.job_config import build_config

    config = build_config(None, [*FLEX_RUN, "--dataloader.dataset_path", str(default_data),
                                 "--dataloader.document_positions", "false"])
    with pytest.raises(ValueError, match="document_positions must not be false"):
        Validator(config, microbatches=1)
