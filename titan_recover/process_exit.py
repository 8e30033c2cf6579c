"""How the project's processes end: without the interpreter's own teardown.

A process that imported torch and TorchTitan spends about 2 s after its last line in Python's finalisation
(garbage-collecting the module graph of torch, Inductor and sympy; 0.8 s for torch alone), measured on the CPU test
host. Nothing a job needs happens there, and in a replica group it can do harm: the current epoch's gloo group may
still hold an operation with a dead peer, whose destructor waits for gloo's timeout, and a failed gloo group still
alive at teardown can end the process with ``std::terminate`` (seen in a two-member scratch run). Every entry point
(a rank, the launcher, the coordinator, the DiLoCo syncer) therefore ends through :func:`leave` once its own work is
closed.
:func:`pid_alive` tells whether another process is still there (an agent's or a rank's, named by its pid in a file
it left).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import sys
from typing import Callable, NoReturn

PR_SET_PDEATHSIG = 1


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_folders_of_dead_processes(temp_dir: str, prefix: str) -> list[str]:
    """Remove the folders ``<prefix><pid>.<anything>`` in ``temp_dir`` whose process is gone without removing its own
    (SIGKILL): a folder is removed only when the pid in its name runs no process, so a live one's stays. Returns
    what was removed."""
    removed = []
    for name in os.listdir(temp_dir):
        pid = name.removeprefix(prefix).split(".")[0]
        if name.startswith(prefix) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(temp_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def leave(code: int) -> NoReturn:
    """End this process with ``code`` now: wandb's runs (if wandb was used here) are waited for as its ``atexit``
    hook would, the logs and the standard streams are flushed, and nothing else runs."""
    if "wandb" in sys.modules:  # its service writes a finished run's last records after finish() returned
        import wandb

        wandb.teardown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(sig: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when the process starting it dies (Linux ``PR_SET_PDEATHSIG``), so
    killing a launcher, even with SIGKILL, leaves no orphan. The launchers give torchrun SIGTERM (it then ends its
    workers) and their other children SIGKILL."""
    parent = os.getpid()

    def arm() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm
