"""Metrics: TorchTitan's ``MetricsProcessor`` plus a per-step JSONL file and wandb settings from the TOML.

``[metrics]`` keeps TorchTitan's keys (``log_freq``, ``enable_wandb``, ``enable_tensorboard``, ...) and adds
``wandb_project`` / ``wandb_run_name`` / ``wandb_group`` / ``wandb_mode`` (``offline`` unless the user asks) and
``jsonl_file``: every logged step becomes one JSON line ``{"step": ..., "loss_metrics/global_avg_loss": ...}`` in
the run folder, written by the rank that holds the loss (rank 0, or the first rank of the last pipeline stage).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from titan_recover import platform
from titan_recover.recover.events import append_line, node_path

platform.activate()  # before TorchTitan's metrics module, which copies the device globals

from torchtitan.components.metrics import _get_metrics_rank, BaseLogger, LoggerContainer, MetricsProcessor  # noqa: E402

logger = logging.getLogger(__name__)


class JsonlLogger(BaseLogger):
    """Appends ``{"step": step, "time": wall time, **metrics}`` per call to this node's file of the run-wide
    ``path`` (:func:`~titan_recover.recover.events.node_path`), one write per line: the replicas of a node share
    it, and a crash loses nothing logged."""

    def __init__(self, path: str, tags: dict[str, Any] | None = None):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = node_path(path)
        self.tags = tags or {}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **self.tags, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        append_line(self.path, json.dumps(record))


class _PeakLookupLogs(logging.Filter):
    """Drops TorchTitan's log lines about its peak-FLOPS lookup and notes whether it fell back to an assumed
    peak (``Peak flops undefined for: cpu, fallback to A100``)."""

    _LINES = ("Peak flops undefined", "Error running lspci", "Peak FLOPS used for computing MFU")

    def __init__(self):
        super().__init__()
        self.fell_back = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "fallback to A100" in message:
            self.fell_back = True
        return not message.startswith(self._LINES)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


class RunMetrics(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        log_freq: int = 1
        """Log every N steps (1: every step, which the JSONL loss curves need)."""

        jsonl_file: str | None = "metrics.jsonl"
        """Per-step metrics file, relative to the run folder (``dump_folder``); empty or None to disable."""

        wandb_project: str = "titan_recover"
        """wandb project (``WANDB_PROJECT`` in the environment wins)."""

        wandb_run_name: str | None = None
        """wandb run name; default: with replica groups the TOML file's name and the start time
        (``rejoin-20260101-120000``), else wandb's own."""

        wandb_group: str | None = None
        """wandb group; default: the TOML file's name, so that a config's runs (its ``--reference`` included) and
        a diloco job's syncer run group together."""

        wandb_mode: Literal["offline", "online", "disabled"] = "offline"
        """``offline`` writes runs under the run folder for ``wandb sync`` later; ``WANDB_MODE`` wins."""

        def __post_init__(self) -> None:
            if self.log_freq < 1:
                raise ValueError(f"metrics.log_freq must be >= 1 (log every N steps), got {self.log_freq}")
            if self.enable_wandb and not self.wandb_project.strip():
                raise ValueError("metrics.wandb_project is empty: name the wandb project (default 'titan_recover') "
                                 "or set metrics.enable_wandb = false")

    def __init__(self, config: Config, **kwargs):
        """TorchTitan's processor; where TorchTitan knows no peak FLOPS for the device (CPU, an unlisted GPU: it
        would divide by an A100's peak) MFU is not computed, through TorchTitan's own switch for an MFU without
        meaning (``has_quantization``, under which its log shows ``mfu: N/A`` and no ``mfu(%)``), and its
        fallback warnings are said once, here, instead of by each lookup (this processor's and the trainer's)."""
        quiet = _PeakLookupLogs()
        root = logging.getLogger()  # TorchTitan logs on the root logger
        root.addFilter(quiet)
        super().__init__(config, **kwargs)
        self.peak_known = not quiet.fell_back
        """Whether TorchTitan knows the device's peak FLOPS (MFU is computed only then)."""
        if self.peak_known:
            root.removeFilter(quiet)
            return
        self._quiet = quiet  # the trainer looks the peak up again after this processor is built
        self.has_quantization = True
        logger.info("no peak FLOPS is known for %r: MFU is not computed", self.device_memory_monitor.device_name)

    _quiet: logging.Filter | None = None

    def close(self) -> None:
        if self._quiet is not None:
            logging.getLogger().removeFilter(self._quiet)
            self._quiet = None
        super().close()

    def _build_metric_logger(self, *, config: Config, parallel_dims, dump_folder: str, pp_schedule: str, **kwargs):
        if config.enable_wandb:
            os.environ.setdefault("WANDB_MODE", config.wandb_mode)
            os.environ.setdefault("WANDB_PROJECT", config.wandb_project)
            for key, value in (("WANDB_RUN_NAME", config.wandb_run_name), ("WANDB_RUN_GROUP", config.wandb_group)):
                if value:
                    os.environ.setdefault(key, value)
        base = super()._build_metric_logger(
            config=config, parallel_dims=parallel_dims, dump_folder=dump_folder, pp_schedule=pp_schedule, **kwargs
        )
        if not config.jsonl_file:
            return base
        if torch.distributed.get_rank() != _get_metrics_rank(parallel_dims=parallel_dims, pp_schedule=pp_schedule):
            return base
        container = base if isinstance(base, LoggerContainer) else LoggerContainer()
        replica = os.environ.get("TITAN_RECOVER_REPLICA")
        tags = {"replica": int(replica)} if replica is not None else {}
        container.add_logger(JsonlLogger(os.path.join(dump_folder, config.jsonl_file), tags))
        return container

    _pending: dict[str, Any] | None = None

    def record_batch(self, tokens: int, load_s: float) -> None:
        """A batch of ``tokens`` was loaded in ``load_s`` seconds (what TorchTitan's own ``batch_generator`` counts
        for the throughput and data-loading figures of the next log)."""
        self.ntokens_since_last_log += tokens
        self.data_loading_times.append(load_s)

    def add_step_metrics(self, metrics: dict[str, Any]) -> None:
        """Extra metrics for the next logged step (a training mode's own, such as ``recover/*``)."""
        if self._pending is None:
            self._pending = {}
        self._pending.update(metrics)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self._pending:
            extra_metrics = {**(extra_metrics or {}), **self._pending}
            self._pending = {}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
