"""The syncer process (docs/diloco.md), started and restarted by the launcher:

    python -m titan_recover.recover.diloco.syncer --coordinator HOST:PORT --run-dir DIR --ranks W [--start N]
        [--host HOST] [--nodes N] [CONFIG.toml] [--section.key value ...]

The config file and overrides are the run's own, as the launcher received them.
"""

from __future__ import annotations

import argparse
import logging

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The diloco syncer: global parameters, outer optimizer, merges.")
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator's store")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--ranks", type=int, required=True, help="ranks per learner")
    parser.add_argument("--start", type=int, default=0, help="how many times the syncer was started before")
    parser.add_argument("--host", default="127.0.0.1", help="address the learners reach this node at")
    parser.add_argument("--nodes", type=int, default=1, help="launchers that run learners")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[syncer] %(asctime)s %(message)s")
    from titan_recover import platform

    platform.activate()
    # The run's whole config is rebuilt here, in the process entry point only (it loads TorchTitan): the validation
    # loss evaluates the global model with the run's model, tokenizer and data settings, which a handful of
    # command-line values could not carry. The syncer's own code takes the built config.
    from titan_recover.job_config import build_config
    from titan_recover.recover.diloco.syncer.service import Syncer

    toml_path = rest.pop(0) if rest and not rest[0].startswith("--") else None
    config = build_config(toml_path, rest)
    torch.set_num_threads(1)
    syncer = Syncer(config, coordinator_address=args.coordinator, run_dir=args.run_dir, ranks=args.ranks,
                    start=args.start, host=args.host, port=config.recover.diloco.syncer_port if args.start == 0 else 0,
                    nodes=args.nodes)
    return syncer.run()


if __name__ == "__main__":
    from titan_recover.process_exit import leave

    leave(main())
