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

``SIGUSR1`` (a scheduler's warning before the time limit) would end torchrun's agent, which has no handler for it:
it is passed on to the workers instead, which stop with a checkpoint (:mod:`~titan_recover.recover.stop_request`)
and exit 0, and this process then exits 128 + 10 (138: stopped by the signal, not finished), as the replica-group
launcher does. A job that finished its budget as the signal came exits 138 too (a scheduler that requeues it
starts a run that loads the last step and ends at once).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import NoReturn

from titan_recover.process_exit import leave
from titan_recover.recover.stop_request import STOP_SIGNAL


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``): a torchrun agent's workers."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue  # ended meanwhile
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state: the parent's pid
            found.append(int(entry))
    return found


class _PassOn:
    """Passes ``STOP_SIGNAL`` on to this process's children and remembers that it came."""

    def __init__(self):
        self.came = False
        signal.signal(STOP_SIGNAL, self)

    def __call__(self, signum, _frame) -> None:
        self.came = True
        for child in children(os.getpid()):
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass


def exit_code(stop: SystemExit) -> int:
    """The status Python gives a process ended by ``stop``: its code, 0 for None, 1 (after printing it) for any
    other object."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> NoReturn:
    from torch.distributed import run

    stop = _PassOn()
    try:
        run.main(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as ended:
        code = exit_code(ended)
        leave(128 + STOP_SIGNAL if stop.came and code == 0 else code)
    except BaseException:  # noqa: BLE001 - printed and turned into the exit status Python would give it
        traceback.print_exc()
        leave(1)
    leave(128 + STOP_SIGNAL if stop.came else 0)


if __name__ == "__main__":
    main()
