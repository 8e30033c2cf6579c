"""The model registry and the platform's model adaptations (no processes)."""

from __future__ import annotations

import pytest
import torch

from titan_recover import platform
from titan_recover.models import get_model, registered_models


def test_tiny_flavor_is_registered_next_to_torchtitans():
    flavors = {m.flavor for m in registered_models() if m.name == "llama3"}
    assert {"debugmodel", "8B", "70B", "tiny"} <= flavors
    spec = get_model("llama3", "tiny").model_spec()
    stock = get_model("llama3", "debugmodel").model_spec()
    assert spec.parallelize_fn is stock.parallelize_fn and spec.pipelining_fn is stock.pipelining_fn
    with torch.device("meta"):
        model = spec.model.build()
    assert sum(p.numel() for p in model.parameters()) == 368_960
    assert len(spec.model.layers) == 2 and spec.model.dim == 64


def test_unknown_model_lists_choices():
    with pytest.raises(ValueError, match=r"Flavors of llama3: .*tiny"):
        get_model("llama3", "huge")


def test_cpu_adaptation_swaps_attention_and_forces_sum_reductions():
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    spec = get_model("llama3", "tiny").model_spec()
    assert isinstance(spec.model.layers[0].attention.inner_attention, FlexAttention.Config)
    adapted = platform.adapt_model_spec(spec, platform.PlatformConfig(), "cpu")
    assert all(isinstance(l.attention.inner_attention, ScaledDotProductAttention.Config) for l in adapted.model.layers)
    assert adapted.parallelize_fn.__wrapped__ is spec.parallelize_fn
    on_gpu = platform.adapt_model_spec(get_model("llama3", "tiny").model_spec(), platform.PlatformConfig(), "cuda")
    assert isinstance(on_gpu.model.layers[0].attention.inner_attention, FlexAttention.Config)
    assert not hasattr(on_gpu.parallelize_fn, "__wrapped__")


def test_device_resolution(monkeypatch):
    """Both machines' answers on this one: CUDA is made to look present, then absent."""
    assert platform.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        platform.resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert platform.resolve_device("auto") == "cuda" and platform.resolve_device("cuda") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert platform.resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        platform.resolve_device("cuda")
