"""A node's snapshot keeper: host memory for its buddy node's snapshots (docs/phoenix.md "Buddy snapshots").

The keeper is a c10d ``TCPStore`` server and nothing else; the ranks' side (take, restore) is
:mod:`titan_recover.recover.phoenix.snapshots`. ``./run_train.sh`` starts one on its node around the job
(:func:`run_with_keeper`) and passes its address to the ranks, on every node of a multi-node job too (the ranks
learn every node's); keepers started by hand (``python -m titan_recover.recover.phoenix.keeper --port P`` on every
node) are listed in ``[recover.snapshot] keepers`` instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from datetime import timedelta

from titan_recover.process_exit import die_with_parent
from titan_recover.recover.nodes import node_address, unreachable
from titan_recover.recover.phoenix.snapshots import KEEPERS_ENV, NODE_KEEPER_ENV
from titan_recover.recover.servers import announce_port, wait_for_port
from titan_recover.recover.stores import host_port

logger = logging.getLogger(__name__)

MODULE = "titan_recover.recover.phoenix.keeper"
"""``python -m`` this module to start a keeper."""


def run_with_keeper(cmd: list[str], env: dict, *, many_nodes: bool = False) -> int:
    """Start this node's keeper, run ``cmd`` (torchrun) with its address, end the keeper when ``cmd`` ends.

    On one node the ranks get the job's only keeper (``KEEPERS_ENV``, 127.0.0.1). On many nodes they get this node's
    keeper as the other nodes reach it (``NODE_KEEPER_ENV``: the node's fully qualified name, which torchrun also
    gives the other nodes for its own store, and the keeper's port); the ranks put the nodes' keepers in order
    themselves (:func:`~titan_recover.recover.phoenix.snapshots.keeper_addresses`)."""
    folder = tempfile.mkdtemp(prefix="titan_recover_keeper.")  # this node's own: a run folder may be shared
    address_file = os.path.join(folder, "port")
    keeper = subprocess.Popen([sys.executable, "-m", MODULE, "--address-file", address_file], env=env,
                              start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL))
    try:
        port = wait_for_port(address_file, keeper, "snapshot keeper")
        if port is None:
            return 1
        if many_nodes:
            host = node_address(socket.getfqdn)
            address = host_port(host, port)
            print(f"[titan_recover] this node's snapshot keeper: {address}", file=sys.stderr, flush=True)
            warning = unreachable("this node's snapshot keeper", host)
            if warning:
                print(f"[titan_recover] warning: {warning}", file=sys.stderr, flush=True)
            return _run_forwarding_signals(cmd, dict(env, **{NODE_KEEPER_ENV: address}))
        return _run_forwarding_signals(cmd, dict(env, **{KEEPERS_ENV: f"127.0.0.1:{port}"}))
    finally:
        keeper.terminate()
        try:
            keeper.wait(10)
        except subprocess.TimeoutExpired:
            keeper.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """Run ``cmd`` to its end, passing Ctrl-C / SIGTERM / SIGUSR1 (a stop with a checkpoint) on to it. It runs in a
    session of its own, so that it gets each signal once, from here, however the signal was sent (to this process,
    or to its process group: a terminal's Ctrl-C, ``kill -- -PGID``): with a preemption grace a second SIGTERM ends
    the job (titan_recover/torchrun.py)."""
    job = subprocess.Popen(cmd, env=env, start_new_session=True,
                           preexec_fn=die_with_parent(signal.SIGTERM))  # torchrun ends its workers
    previous = {s: signal.signal(s, lambda signum, _f: job.send_signal(signum))
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        return job.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve(port: int, address_file: str | None) -> int:
    """Hold a store on ``port`` (0: a free one, announced in ``address_file``) until SIGTERM / SIGINT."""
    from torch.distributed import TCPStore

    store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    if address_file:
        announce_port(address_file, store.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.info("snapshot keeper on port %d", store.port)
    while not stop.wait(1.0):
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A node's snapshot keeper: host memory for its buddy's snapshots.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--address-file", help="write the port here once listening")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[snapshot keeper] %(asctime)s %(message)s")
    return serve(args.port, args.address_file)


if __name__ == "__main__":
    sys.exit(main())
