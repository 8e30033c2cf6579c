"""Worker entry point, one per rank under torchrun: ``python -m titan_recover.train CONFIG.toml [overrides]``.

``./run_train.sh`` (through :mod:`titan_recover.launch`) starts these; on a multi-node cluster, run them with
torchrun yourself (see README). The config is rebuilt here from the same file and overrides, identically on every
rank, and checked against this job's world size before TorchTitan starts.
"""

from __future__ import annotations

import logging
import os
import sys


def place_replica_outputs(config) -> None:
    """A replica group's own outputs go under ``<run>/replica_<i>/``; the per-step metrics of all replicas go to
    ``<run>/metrics.jsonl`` (tagged with the replica) and the events to ``<run>/events.jsonl``."""
    from titan_recover.recover.member import REPLICA_ENV
    from titan_recover.recover.member import RUN_DIR_ENV

    replica = int(os.environ[REPLICA_ENV])
    run_dir = os.path.abspath(os.environ.setdefault(RUN_DIR_ENV, os.path.abspath(config.dump_folder)))
    config.dump_folder = os.path.join(run_dir, f"replica_{replica}")
    if config.metrics.jsonl_file:
        config.metrics.jsonl_file = os.path.join(run_dir, config.metrics.jsonl_file)
    run_name = config.metrics.wandb_run_name or os.path.basename(run_dir)
    config.metrics.wandb_run_name = f"{run_name}-replica{replica}"
    config.metrics.wandb_group = config.metrics.wandb_group or run_name


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    toml_path = argv.pop(0) if argv and not argv[0].startswith("--") else None

    from titan_recover.config.loader import build_config
    from titan_recover.config.validate import check_batch, resolve_layout

    config = build_config(toml_path, argv)
    layout = resolve_layout(config.parallelism, int(os.environ.get("WORLD_SIZE", "1")))
    check_batch(config.training, config.parallelism, layout)
    if config.recover.enabled:
        place_replica_outputs(config)

    import torch
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    logger.info(f"titan_recover: {config.model_spec.name}/{config.model_spec.flavor}, {layout}")
    trainer = None
    exit_code = 0
    try:
        trainer = config.build()
        trainer.train()
    except SystemExit as stop:  # the replica protocol's orderly stop (too few replicas left)
        exit_code = stop.code if isinstance(stop.code, int) else 1
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if config.recover.enabled:
        # Groups of past epochs may still hold a collective (or a lazy connection) to a dead peer; their
        # destructors would wait for gloo's timeout and can abort the process. Training is over: leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    if exit_code:
        raise SystemExit(exit_code)


if __name__ == "__main__":
    main()
