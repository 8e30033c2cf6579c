"""The coordinator's process (started, and restarted, by the launcher; docs/replica_groups.md).

    python -m titan_recover.recover.coordinator_process --replicas R --ranks-per-replica W --run-dir DIR \
        --store URL [--recover-json JSON] [--chaos-json JSON] [--checkpoint-folder DIR [--load-verified]] \
        [--standby --identity NAME]

The coordinator itself (:mod:`titan_recover.recover.groups.coordinator`) shares only keys and pure decisions with
the ranks; this entry adds what a process of the job needs: the ``[recover]`` section, its own ``[chaos]`` faults,
its signals, and, with ``--standby`` (an etcd store; every node's launcher runs one), the leader election
(``recover/standby.py``): it coordinates only once it leads, resuming from the stored state exactly as a restarted
coordinator does, and exits at once (code 76) when its leadership is lost. Its writes to the job's store are
fenced by its term (``LeaderElection.fenced``): once another candidate leads, a write of this one is refused
(``NotLeader``) before it changes anything, and it exits the same way.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket

from titan_recover.recover.chaos.config import FaultSpec
from titan_recover.recover.chaos.process import ProcessFaults
from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.groups.coordinator import Coordinator
from titan_recover.recover.groups.keys import GroupKeys
from titan_recover.recover.groups.protocol import DurableState
from titan_recover.recover.notice import NoticeFile, SigtermTriage
from titan_recover.recover.scout.verified import complete_checkpoints, step_to_load
from titan_recover.recover.standby import lead, refused, took_office
from titan_recover.recover.stores import connect


def newest_checkpoint(folder: str, verified: bool) -> DurableState | None:
    """The checkpoint every group restarts from after losing every replica, chosen as the checkpoint manager
    chooses (``verified``: the newest verified one where any is recorded, else the newest complete one), or None
    when ``folder`` holds no complete checkpoint."""
    available = complete_checkpoints(folder) if folder else []
    if not available:
        return None
    chosen, why = step_to_load(folder) if verified else (None, "newest checkpoint")
    if chosen is None:
        chosen, why = available[-1], f"{why}, step {available[-1]}"
    return DurableState(chosen, f"{why} (complete checkpoints: steps {available})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--ranks-per-replica", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--store", required=True, help="URL of the job's store: HOST:PORT (the launcher's TCPStore) "
                        "or the etcd URL of the job's keys")
    parser.add_argument("--recover-json", default="{}", help="the [recover] section as JSON")
    parser.add_argument("--chaos-json", default="{}", help="the [chaos] section as JSON (faults of the coordinator)")
    parser.add_argument("--checkpoint-folder", default="",
                        help="the job's durable checkpoints ([checkpoint] enable): what a job that lost every replica "
                             "restarts from")
    parser.add_argument("--load-verified", action="store_true",
                        help="restart from the newest verified checkpoint ([checkpoint] load_verified)")
    parser.add_argument("--standby", action="store_true", help="coordinate only once elected leader (etcd store)")
    parser.add_argument("--identity", default=f"{socket.gethostname()}:{os.getpid()}",
                        help="this candidate's name in the leader election")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = RecoverConfig.from_dict(json.loads(args.recover_json))
    faults = [FaultSpec(**fault) for fault in json.loads(args.chaos_json).get("faults", [])]
    store = connect(args.store, config.agree_timeout_s)
    election = None
    if args.standby:
        election = lead(store, GroupKeys.COORDINATOR_LEADER, args.identity, over_key=GroupKeys.FINISHED)
    if args.standby and election is None:
        return 0  # the job finished while this one stood by
    from titan_recover.recover.stores.etcd import NotLeader  # etcd3gw stays unimported without an etcd store

    coordinator = None
    try:
        coordinator = Coordinator(config, store if election is None else election.fenced(),
                                  replicas=args.replicas, ranks_per_replica=args.ranks_per_replica,
                                  run_dir=args.run_dir,
                                  durable_state=lambda: newest_checkpoint(args.checkpoint_folder,
                                                                            args.load_verified))
        coordinator.chaos = ProcessFaults(faults, "coordinator", coordinator.start, coordinator.events)
        if election is not None:
            took_office(election, coordinator.events, "coordinator")
        notice = NoticeFile.inherited()  # a preemption grace: the node's notice reaches every process (SLURM)
        signal.signal(signal.SIGTERM, coordinator.request_stop if notice is None else
                      SigtermTriage(notice, coordinator.request_stop, "titan_recover coordinator"))
        signal.signal(signal.SIGINT, coordinator.request_stop)
        return coordinator.run()
    except NotLeader as error:  # another candidate leads: this one's write changed nothing
        return refused(election, coordinator.events if coordinator is not None else None, "coordinator", error)
    finally:
        if election is not None:
            election.resign()


if __name__ == "__main__":
    from titan_recover.process_exit import leave

    leave(main())
