"""torchrun (``torch.distributed.run``, TorchTitan's launcher) as the project starts it: the same agent, the same
arguments, ended through :func:`~titan_recover.process_exit.leave` once its ``main`` returns or raises.

An agent has imported torch; Python's own teardown then garbage-collects torch's module graph for about a second
of CPU after the workers are gone (``py-spy record --idle --native`` of an agent: ``gc_collect_main`` after
``SimpleElasticAgent.run`` returned). The job waits for that second at its end and at every restart of a replica
group (the launcher starts a group again once its torchrun has exited). Nothing the agent does is skipped: its
workers, rendezvous and error files are all closed inside ``main``.

Usage is torchrun's: ``python -m titan_recover.torchrun [torchrun options] -m MODULE ARGS``. An exception out of
torchrun (a failed worker's ``ChildFailedError``, a signal's ``SignalException``) is printed as Python would and
ends the process with 1, as an uncaught one does.

``SIGUSR1`` (a scheduler's warning before the time limit) would end torchrun's agent, which has no handler for it.
This process notes it instead in a node-local file whose path the workers inherit
(:mod:`~titan_recover.recover.stop_request`): they stop after a step they agree on, with a checkpoint of it, and
exit 0 (torchrun would restart workers that failed); this process then exits 128 + 10 (138: stopped by the signal,
as the replica-group launcher does) if they did stop, and 0 if they had trained the budget first. The file's
folder is removed at the end; an agent killed before it could (SIGKILL) leaves it behind, and the next agent that
starts on the node removes it (the folder is named after the agent's pid).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import traceback
from typing import NoReturn

from titan_recover.process_exit import leave, pid_alive
from titan_recover.recover.stop_request import STOP_FILE_ENV, STOP_SIGNAL


_STOP_FOLDER_PREFIX = "titan_recover_stop."
"""Each agent's folder in the temp dir: ``<prefix><agent pid>.<random>``."""


def _remove_folders_of_dead_agents(temp_dir: str) -> list[str]:
    """Remove the stop folders of agents that are gone without removing them (SIGKILL): a folder is removed only
    when the pid in its name runs no process, so a live agent's folder stays. Returns what was removed."""
    removed = []
    for name in os.listdir(temp_dir):
        pid = name.removeprefix(_STOP_FOLDER_PREFIX).split(".")[0]
        if name.startswith(_STOP_FOLDER_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(temp_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


class _StopFile:
    """The node-local file the workers look for, created when ``STOP_SIGNAL`` comes to this process."""

    def __init__(self):
        _remove_folders_of_dead_agents(tempfile.gettempdir())
        self.folder = tempfile.mkdtemp(prefix=f"{_STOP_FOLDER_PREFIX}{os.getpid()}.")
        self.file = os.path.join(self.folder, "requested")
        os.environ[STOP_FILE_ENV] = self.file  # the workers torchrun starts inherit it
        signal.signal(STOP_SIGNAL, self._note)

    def _note(self, _signum, _frame) -> None:
        open(self.file, "a").close()

    def exit_code(self, code: int) -> int:
        """The process's exit code: 128 + the signal if the workers stopped on it and exited 0."""
        stopped = code == 0 and os.path.exists(os.path.join(self.folder, "stopped"))
        shutil.rmtree(self.folder, ignore_errors=True)
        return 128 + STOP_SIGNAL if stopped else code


_SIGNALS_OPTIONS = ("--signals-to-handle", "--signals_to_handle")
_SIGNALS_ENV = "PET_SIGNALS_TO_HANDLE"
"""torchrun's option for the signals its agent ends the workers on, and the variable that sets it (torchrun's
``PET_`` form of its options). Its default list has no ``STOP_SIGNAL``."""


def _without_stop_signal(argv: list[str], environ) -> tuple[list[str], bool]:
    """``argv`` with ``STOP_SIGNAL`` taken out of the signals torchrun's agent would handle (its option in
    ``argv`` before the training module, else ``PET_SIGNALS_TO_HANDLE``): torchrun would install its own handler
    for it, which ends the workers without a checkpoint, over this process's. Returns (argv, whether it was
    listed)."""
    end = argv.index("-m") if "-m" in argv else len(argv)
    value, at = environ.get(_SIGNALS_ENV, ""), None
    for i, arg in enumerate(argv[:end]):
        name, _, inline = arg.partition("=")
        if name in _SIGNALS_OPTIONS:
            at, value = i, inline if inline or i + 1 >= end else argv[i + 1]
    names = [n.strip() for n in value.split(",") if n.strip()]
    kept = [n for n in names if n != STOP_SIGNAL.name]
    if len(kept) == len(names):
        return argv, False
    option = [f"{_SIGNALS_OPTIONS[0]}={','.join(kept)}"]
    if at is None:
        return option + argv, True
    width = 1 if "=" in argv[at] else 2
    return argv[:at] + option + argv[at + width:], True


def exit_code(stop: SystemExit) -> int:
    """The status Python gives a process ended by ``stop``: its code, 0 for None, 1 (after printing it) for any
    other object."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> NoReturn:
    from torch.distributed import run

    stop = _StopFile()
    argv, dropped = _without_stop_signal(list(sys.argv[1:] if argv is None else argv), os.environ)
    if dropped:
        print(f"titan_recover.torchrun: {STOP_SIGNAL.name} is a stop with a checkpoint here, not one of the signals "
              f"torchrun ends the workers on: taken out of {_SIGNALS_ENV} / --signals-to-handle", file=sys.stderr)
    try:
        run.main(argv)
    except SystemExit as ended:
        leave(stop.exit_code(exit_code(ended)))
    except BaseException:  # noqa: BLE001 - printed and turned into the exit status Python would give it
        traceback.print_exc()
        leave(stop.exit_code(1))
    leave(stop.exit_code(0))


if __name__ == "__main__":
    main()
