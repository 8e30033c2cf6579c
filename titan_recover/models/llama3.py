"""Llama 3: TorchTitan's flavors, registered as they are, plus ``tiny`` for fast CPU tests and ``small`` (dim 512,
8 layers, 8 heads, vocabulary 32768, ~60 M parameters) for CPU benchmarks that need a large gradient.

``tiny`` (dim 64, 2 layers, 4 heads, vocab 2048, ~0.36 M parameters) is built from the same building blocks as
TorchTitan's ``debugmodel`` and shares its parallelize / pipelining functions, so FSDP2 / TP / PP apply to it
unchanged. Its training defaults are those of ``llama3_debugmodel``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch.nn as nn

from titan_recover import platform

platform.activate()  # TorchTitan's llama3 package imports its trainer, which copies the device globals

from torchtitan.models import llama3 as tt_llama3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config  # noqa: E402
from torchtitan.models.common.param_init import depth_scaled_std  # noqa: E402
from torchtitan.models.llama3 import config_registry as tt_configs  # noqa: E402
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock  # noqa: E402

from titan_recover.models import RegisteredModel, register_model  # noqa: E402

_HARDWARE = {
    "debugmodel": "any: 6 M parameters, CPU or one GPU",
    "1B": "1+ GPUs with 24 GB",
    "3B": "1+ GPUs with 40 GB",
    "8B": "8x 80 GB GPUs (one node) with FSDP",
    "70B": "64+ 80 GB GPUs (8 nodes), FSDP + TP 8",
    "405B": "128+ 80 GB GPUs (16+ nodes), FSDP + TP 8 + PP",
}


def _tiny_model_config(attn_backend: str = "flex") -> Llama3Model.Config:
    return _model_config(dim=64, n_heads=4, n_layers=2, vocab=2048, attn_backend=attn_backend)


def _model_config(*, dim: int, n_heads: int, n_layers: int, vocab: int, attn_backend: str) -> Llama3Model.Config:
    linear_init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}
    out_std = dim**-0.5
    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=4096, theta=500000, scaling="llama")
    layers = []
    for layer_id in range(n_layers):
        depth_init = {
            "weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id)),
            "bias": nn.init.zeros_,
        }
        layers.append(
            Llama3TransformerBlock.Config(
                attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
                ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
                attention=make_gqa_config(
                    dim=dim,
                    n_heads=n_heads,
                    wqkv_param_init=linear_init,
                    wo_param_init=depth_init,
                    inner_attention=get_attention_config(attn_backend),
                    fuse_qkv=True,
                    rope=rope,
                ),
                feed_forward=make_ffn_config(
                    dim=dim,
                    hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
                    w1_param_init=linear_init,
                    w2w3_param_init=depth_init,
                ),
            )
        )
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init={"weight": partial(nn.init.normal_, std=1.0)}
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(
            in_features=dim,
            out_features=vocab,
            param_init={
                "weight": partial(nn.init.trunc_normal_, std=out_std, a=-3 * out_std, b=3 * out_std),
                "bias": nn.init.zeros_,
            },
        ),
        layers=layers,
    )


def _tiny_spec():
    return dataclasses.replace(tt_llama3.model_registry("debugmodel"), flavor="tiny", model=_tiny_model_config())


def _small_spec():
    model = _model_config(dim=512, n_heads=8, n_layers=8, vocab=32768, attn_backend="flex")
    return dataclasses.replace(tt_llama3.model_registry("debugmodel"), flavor="small", model=model)


def _stock_spec(flavor: str):
    return lambda: tt_llama3.model_registry(flavor)


def _stock_config(flavor: str):
    return getattr(tt_configs, f"llama3_{flavor.lower()}", tt_configs.llama3_debugmodel)


for _flavor in tt_llama3.llama3_configs:
    register_model(
        RegisteredModel(
            name="llama3",
            flavor=_flavor,
            model_spec=_stock_spec(_flavor),
            base_config=_stock_config(_flavor),
            hardware=_HARDWARE.get(_flavor, ""),
        )
    )

register_model(
    RegisteredModel(
        name="llama3",
        flavor="tiny",
        model_spec=_tiny_spec,
        base_config=tt_configs.llama3_debugmodel,
        hardware="any: 0.4 M parameters, for tests on CPU",
    )
)

register_model(
    RegisteredModel(
        name="llama3",
        flavor="small",
        model_spec=_small_spec,
        base_config=tt_configs.llama3_debugmodel,
        hardware="any: ~60 M parameters (a 32k vocabulary), for benchmarks whose gradient must be large on CPU",
    )
)
