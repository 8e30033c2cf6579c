"""A node's snapshot keeper: host memory for its buddy node's snapshots (docs/phoenix.md "Buddy snapshots").

The keeper is a c10d ``TCPStore`` server and nothing else; the ranks' side (take, restore) is
:mod:`titan_recover.recover.phoenix.snapshots`. ``./run_train.sh`` starts one on its node around the job
(:func:`run_with_keeper`) and passes its address in ``TITAN_RECOVER_SNAPSHOT_KEEPERS``; a multi-node job starts
``python -m titan_recover.recover.phoenix.keeper --port P`` on every node and lists them in
``[recover.snapshot] keepers``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta

from titan_recover.process_exit import die_with_parent
from titan_recover.recover.phoenix.snapshots import KEEPERS_ENV
from titan_recover.recover.servers import announce_port, wait_for_port

logger = logging.getLogger(__name__)

MODULE = "titan_recover.recover.phoenix.keeper"
"""``python -m`` this module to start a keeper."""


def run_with_keeper(cmd: list[str], env: dict, run_dir: str) -> int:
    """Start this node's keeper, run ``cmd`` (torchrun) with its address, end the keeper when ``cmd`` ends."""
    os.makedirs(run_dir, exist_ok=True)
    address_file = os.path.join(run_dir, "snapshot_keeper.port")
    if os.path.exists(address_file):
        os.remove(address_file)
    keeper = subprocess.Popen([sys.executable, "-m", MODULE, "--address-file", address_file], env=env,
                              start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL))
    try:
        port = wait_for_port(address_file, keeper, "snapshot keeper")
        if port is None:
            return 1
        return _run_forwarding_signals(cmd, dict(env, **{KEEPERS_ENV: f"127.0.0.1:{port}"}))
    finally:
        keeper.terminate()
        try:
            keeper.wait(10)
        except subprocess.TimeoutExpired:
            keeper.kill()


def _run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """Run ``cmd`` to its end, passing Ctrl-C / SIGTERM on to it."""
    job = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent(signal.SIGTERM))  # torchrun ends its workers
    previous = {s: signal.signal(s, lambda signum, _f: job.send_signal(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
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
