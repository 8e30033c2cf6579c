"""The syncer process (docs/diloco.md), started and restarted by the launcher:

    python -m titan_recover.recover.diloco.syncer --coordinator URL --run-dir DIR --ranks W [--start N]
        [--host HOST] [--port P] [--nodes N] [--standby --identity NAME] [CONFIG.toml] [--section.key value ...]

The config file and overrides are the run's own, as the launcher received them. With ``--standby`` (an etcd store:
every node's launcher runs one, docs/diloco.md "Standby syncers") it builds the config, then waits to lead
``diloco/syncer_leader`` and serves only once it does, writing to the job's store through the election's fenced
store; it exits at once (code 76) when its leadership is lost, and with 0 when the job ended while it stood by.
"""

from __future__ import annotations

import argparse
import logging
import socket

import torch

logger = logging.getLogger("titan_recover.syncer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The diloco syncer: global parameters, outer optimizer, merges.")
    parser.add_argument("--coordinator", required=True, help="URL of the job's store (HOST:PORT or etcd)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--ranks", type=int, required=True, help="ranks per learner")
    parser.add_argument("--start", type=int, default=0, help="how many times this node started the syncer before")
    parser.add_argument("--host", default="127.0.0.1", help="address the learners reach this node at")
    parser.add_argument("--port", type=int, default=0, help="port of the syncer's store (0: a free one)")
    parser.add_argument("--nodes", type=int, default=1, help="launchers that run learners")
    parser.add_argument("--standby", action="store_true", help="serve only once elected leader (etcd store)")
    parser.add_argument("--identity", default=f"{socket.gethostname()}/syncer", help="name in the leader election")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[syncer] %(asctime)s %(message)s")
    from titan_recover import platform

    platform.activate()
    # The run's whole config is rebuilt here, in the process entry point only (it loads TorchTitan): the validation
    # loss evaluates the global model with the run's model, tokenizer and data settings, which a handful of
    # command-line values could not carry. The syncer's own code takes the built config.
    from titan_recover.job_config import build_config

    toml_path = rest.pop(0) if rest and not rest[0].startswith("--") else None
    config = build_config(toml_path, rest)
    torch.set_num_threads(1)
    return serve(config, args)


def serve(config, args) -> int:
    """Serve as the job's syncer: at once, or (``--standby``) once elected; the exit code."""
    from titan_recover.recover.diloco.rules import DilocoKeys
    from titan_recover.recover.diloco.syncer.service import MissingCheckpoint, Syncer
    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.standby import lead, refused, took_office
    from titan_recover.recover.stores import connect

    store = connect(args.coordinator, config.recover.agree_timeout_s)
    election = None
    if args.standby:
        election = lead(store, DilocoKeys.SYNCER_LEADER, args.identity, over_key=GroupKeys.FINISHED)
        if election is None:
            return 0  # the job ended while this one stood by
        store = election.fenced()
    from titan_recover.recover.stores.etcd import NotLeader  # etcd3gw stays unimported without an etcd store

    syncer = None
    try:
        syncer = Syncer(config, coordinator=store, run_dir=args.run_dir, ranks=args.ranks, start=args.start,
                        host=args.host, port=args.port, nodes=args.nodes,
                        identity=args.identity if election is not None else "")
        if election is not None:
            took_office(election, syncer.events, "syncer")
        return syncer.run()
    except NotLeader as error:  # another candidate leads: this one's write changed nothing
        return refused(election, syncer.events if syncer is not None else None, "syncer", error)
    except MissingCheckpoint as missing:
        logger.error("%s", missing)
        return 1
    finally:
        if election is not None:
            election.resign()


if __name__ == "__main__":
    from titan_recover.process_exit import leave

    leave(main())
