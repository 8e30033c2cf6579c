"""Device selection and the CPU adaptations TorchTitan 0.3.0 needs, applied without editing TorchTitan.

One config runs on both platforms. ``device = "auto"`` resolves to CUDA + NCCL where a GPU is visible and to
CPU + gloo elsewhere. On CPU four things change, all automatically and all overridable:

1. TorchTitan's device globals (``torchtitan.tools.utils.device_type`` / ``device_module``) are resolved once at
   import time and fall back to ``"cuda"``; other modules copy them at import. :func:`activate` sets them to
   CPU after ``torchtitan.tools.utils`` is imported and before the trainer, metrics, parallel-dims and
   distributed-utils modules are. Everything else (gloo backend, CPU device mesh) follows.
2. FlexAttention has no CPU backward: the layers' inner attention becomes causal SDPA
   (:func:`adapt_model_spec`, ``[platform] attention``).
3. gloo has no ``PREMUL_SUM``: FSDP2 modules are switched to sum-only reductions (same maths, since TorchTitan
   sets the gradient divide factor to 1) by wrapping the model spec's ``parallelize_fn``
   (``[platform] sum_only_reductions``).
4. bf16 parameters are ~10x slower on CPU: ``training.mixed_precision_param`` defaults to ``float32``
   (:func:`platform_defaults`; a TOML value wins).

This module must not import ``torchtitan.trainer`` (or anything that imports it) at module level.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

DEVICE_ENV = "TITAN_RECOVER_DEVICE"
"""Environment variable through which the launcher tells worker processes the resolved device."""

# Modules that copy TorchTitan's device globals at import time; they must be imported after activate().
_COPIES_DEVICE_GLOBALS = (
    "torchtitan.trainer",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
)


@dataclass(kw_only=True, slots=True)
class PlatformConfig:
    """``[platform]``: where the run executes and which CPU adaptations apply."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA + NCCL when a GPU is visible, else CPU + gloo."""

    attention: Literal["auto", "sdpa", "model"] = "auto"
    """Inner attention of the model's layers. ``auto``: causal SDPA on CPU (FlexAttention has no CPU backward),
    the model's own backend on CUDA. ``sdpa`` forces SDPA; ``model`` keeps the model's backend."""

    sum_only_reductions: Literal["auto", "on", "off"] = "auto"
    """Force FSDP2 reduce-scatters to plain SUM (gloo rejects PREMUL_SUM). ``auto``: on for CPU."""


def resolve_device(requested: str | None = None) -> str:
    """Return ``"cpu"`` or ``"cuda"`` for a requested ``auto`` / ``cpu`` / ``cuda``."""
    requested = requested or os.environ.get(DEVICE_ENV, "auto")
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"[platform] device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("[platform] device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return requested


_active_device: str | None = None


def active_device() -> str:
    """The device :func:`activate` set up (activating with the environment's choice if not done yet)."""
    return _active_device or activate()


def activate(device: str | None = None) -> str:
    """Resolve the device and point TorchTitan's device globals at it. Idempotent; returns the device.

    Must run before TorchTitan's trainer / metrics / parallel-dims / distributed-utils modules are imported
    when the device is CPU; raises ``RuntimeError`` naming the offending modules otherwise.
    """
    global _active_device
    resolved = resolve_device(device)
    if _active_device is not None:
        if resolved != _active_device:
            raise RuntimeError(
                f"platform already activated for {_active_device!r}; cannot switch to {resolved!r} in one process"
            )
        return resolved

    import torchtitan.tools.utils as tt_utils

    if resolved == "cpu" and tt_utils.device_type != "cpu":
        too_late = [name for name in _COPIES_DEVICE_GLOBALS if name in sys.modules]
        if too_late:
            raise RuntimeError(
                "titan_recover.platform.activate() ran after TorchTitan modules that copy the device globals "
                f"were imported ({', '.join(too_late)}); import titan_recover.trainer (which activates first) "
                "before any of them."
            )
        tt_utils.device_type = "cpu"
        tt_utils.device_module = _cpu_device_module()
    os.environ[DEVICE_ENV] = resolved  # child processes (and re-imports) agree
    _active_device = resolved
    return resolved


def synchronize(device: torch.device | str) -> None:
    """Wait until ``device`` has finished the work this thread's current stream holds (the compute, and what it
    was made to wait for, e.g. FSDP2's reduce-scatter at the end of a backward): an accelerator runs kernels after
    they are launched, so a clock read without this measures launches, not work. Not the whole device: a
    cross-replica collective queued on its own stream (NCCL's, overlapping the backward) may wait for a dead peer
    until the fault flag aborts it, and waiting for it here would wait for that peer. A no-op on CPU (work runs when
    issued)."""
    device = torch.device(device)
    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()


def bind_thread(device: torch.device | str) -> None:
    """Make ``device`` the calling thread's current CUDA device (any other device: nothing). A new thread starts on
    device 0 whatever its process trains on, and its first CUDA call there (a stream context's exit restoring
    device 0's stream, an event waited for) creates a CUDA context on GPU 0: hundreds of MB of GPU 0's memory in
    every rank's process of the node. Called first by every thread of the project that touches a device, as torch's
    own pin-memory thread does."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_device_module() -> types.ModuleType:
    """A stand-in for ``torch.cuda`` exposing what TorchTitan calls; memory figures report process RSS."""

    class _Properties:
        name = "cpu"
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    module = types.ModuleType("titan_recover_cpu_device")
    module.set_device = lambda device=None: None
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module.synchronize = lambda device=None: None
    module.is_available = lambda: True
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: _Properties()
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    module.memory_stats = lambda device=None: {
        "active_bytes.all.peak": _rss_bytes(),
        "reserved_bytes.all.peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    return module


def platform_defaults(device: str) -> dict[str, dict[str, Any]]:
    """Config values that differ per platform, as TOML-shaped overrides applied *before* the user's TOML."""
    if device == "cpu":
        # the cross-replica reduction overlapped with the backward competes for the same cores on a CPU host, where
        # it measured no gain and a loss with the backup (docs/benchmarks.md): it starts after the backward there.
        # The backup's copy of every piece is memory traffic on those cores too, a third of the reduction's time
        # (benchmarks/reduction_path.py): an aborted reduction computes the replica's microbatches again instead
        return {"training": {"mixed_precision_param": "float32", "disable_cuda_graphs": True},
                "recover": {"step": {"overlap_reduction": False, "abort_recovery": "recompute"}}}
    return {}


def _sum_only(parallelize_fn: Callable) -> Callable:
    def parallelize_with_sum_only_reductions(model, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    parallelize_with_sum_only_reductions.__wrapped__ = parallelize_fn
    return parallelize_with_sum_only_reductions


def takes_document_masks(spec) -> bool:
    """Whether the model's attention consumes per-document positions as masks (FlexAttention, varlen)."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    return any(True for _ in spec.model.traverse((FlexAttention.Config, VarlenAttention.Config)))


def adapt_model_spec(spec, platform: PlatformConfig, device: str):
    """Return the model spec with the platform's attention backend and reduction mode applied."""
    use_sdpa = platform.attention == "sdpa" or (platform.attention == "auto" and device == "cpu")
    sum_only = platform.sum_only_reductions == "on" or (
        platform.sum_only_reductions == "auto" and device == "cpu"
    )
    if use_sdpa:
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

        for _, _, parent, attr in list(spec.model.traverse((FlexAttention.Config, VarlenAttention.Config))):
            if parent is not None:
                setattr(parent, attr, ScaledDotProductAttention.Config())
    if sum_only and not hasattr(spec.parallelize_fn, "__wrapped__"):
        spec = dataclasses.replace(spec, parallelize_fn=_sum_only(spec.parallelize_fn))
    return spec
