"""The coordinator's process (started, and restarted, by the launcher; docs/replica_groups.md).

    python -m titan_recover.recover.coordinator_process --replicas R --ranks-per-replica W --run-dir DIR \
        --store HOST:PORT [--recover-json JSON] [--chaos-json JSON]

The coordinator itself (:mod:`titan_recover.recover.groups.coordinator`) shares only keys and pure decisions with
the ranks; this entry adds what a process of the job needs: the ``[recover]`` section, its own ``[chaos]`` faults,
its signals.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from titan_recover.recover.chaos.config import FaultSpec
from titan_recover.recover.chaos.process import ProcessFaults
from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.groups.coordinator import Coordinator
from titan_recover.recover.stores import connect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--ranks-per-replica", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of the job's store")
    parser.add_argument("--recover-json", default="{}", help="the [recover] section as JSON")
    parser.add_argument("--chaos-json", default="{}", help="the [chaos] section as JSON (faults of the coordinator)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = RecoverConfig.from_dict(json.loads(args.recover_json))
    faults = [FaultSpec(**fault) for fault in json.loads(args.chaos_json).get("faults", [])]
    coordinator = Coordinator(config, connect(args.store, config.agree_timeout_s), replicas=args.replicas,
                              ranks_per_replica=args.ranks_per_replica, run_dir=args.run_dir)
    coordinator.chaos = ProcessFaults(faults, "coordinator", coordinator.start, coordinator.events)
    signal.signal(signal.SIGTERM, coordinator.request_stop)
    signal.signal(signal.SIGINT, coordinator.request_stop)
    return coordinator.run()


if __name__ == "__main__":
    sys.exit(main())
