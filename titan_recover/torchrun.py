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
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

from titan_recover.process_exit import leave


def exit_code(stop: SystemExit) -> int:
    """The status Python gives a process ended by ``stop``: its code, 0 for None, 1 (after printing it) for any
    other object."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> NoReturn:
    from torch.distributed import run

    try:
        run.main(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as stop:
        leave(exit_code(stop))
    except BaseException:  # noqa: BLE001 - printed and turned into the exit status Python would give it
        traceback.print_exc()
        leave(1)
    leave(0)


if __name__ == "__main__":
    main()
