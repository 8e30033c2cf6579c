"""Child server processes (the coordinator, a snapshot keeper) and the port they announce once they listen.

A server started with port 0 picks a free one and writes it to an address file (written to a temporary file and
renamed: never read half-written); the process that started it waits for that file with :func:`wait_for_port`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def announce_port(address_file: str, port: int) -> None:
    """Write ``port`` to ``address_file`` in one rename, so a reader sees it whole or not at all."""
    with open(address_file + ".tmp", "w") as fh:
        fh.write(f"{port}\n")
    os.replace(address_file + ".tmp", address_file)


def wait_for_port(address_file: str, proc: subprocess.Popen, name: str, timeout_s: float = 60) -> int | None:
    """The port a child server (coordinator, snapshot keeper) writes to ``address_file`` once it listens; None,
    with a message, if it exited or did not listen within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(address_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            print(f"titan_recover: the {name} did not start", file=sys.stderr)
            return None
        time.sleep(0.05)
    with open(address_file) as fh:
        return int(fh.read())
