"""torchrun (``torch.distributed.run``, TorchTitan's launcher) as the project starts it: the same agent, the same
arguments, ended through :func:`~titan_recover.process_exit.leave` once its ``main`` returns or raises.

An agent has imported torch; Python's own teardown then garbage-collects torch's module graph for about a second
of CPU after the workers are gone (``py-spy record --idle --native`` of an agent: ``gc_collect_main`` after
``SimpleElasticAgent.run`` returned). The job waits for that second at its end and at every restart of a replica
group (the launcher starts a group again once its torchrun has exited). Nothing the agent does is skipped: its
workers, rendezvous and error files are all closed inside ``main``.

Usage is torchrun's: ``python -m titan_recover.torchrun [torchrun options] -m MODULE ARGS``. An exception out of
torchrun (a failed worker's ``ChildFailedError``) is printed as Python would and ends the process with 1, as an
uncaught one does; a signal torchrun ended the workers on (its ``SignalException``) is said in one sentence and
ends it with 128 + the signal.

``SIGUSR1`` (a scheduler's warning before the time limit) would end torchrun's agent, which has no handler for it.
This process notes it instead in a node-local file whose path the workers inherit
(:mod:`~titan_recover.recover.stop_request`): they stop after a step they agree on, with a checkpoint of it, and
exit 0 (torchrun would restart workers that failed); this process then exits 128 + 10 (138: stopped by the signal,
as the replica-group launcher does) if they did stop, and 0 if they had trained the budget first. The file's
folder is removed at the end; an agent killed before it could (SIGKILL) leaves it behind, and the next agent that
starts on the node removes it (the folder is named after the agent's pid).

``--preemption-grace-s S`` (before torchrun's own options; the launcher passes ``[recover] preemption_grace_s``
when it is above 0) makes ``SIGTERM`` the same stop, named a preemption notice: torchrun's agent would end the
workers on it at once, so it is taken out of the signals torchrun handles, noted in the file, and the process
exits 143 (128 + 15) once the workers stopped. A second ``SIGTERM`` (not the first come again within a second:
``PreemptionNotice.repeats``), or none of them stopping within ``S`` seconds,
ends them as torchrun ends them on ``SIGTERM`` (its ``SignalException``, raised here), and the process exits 143
with a sentence saying which.

A scheduler may send that ``SIGTERM`` to the workers as well (SLURM signals every process of a job step). With a
grace this process is the node's first and writes the node's notice file, in its stop folder, for its workers
(:mod:`~titan_recover.recover.notice`): ``notice`` when it takes the notice, ``ending`` before it ends them. The
agent of a replica group has no grace of its own but inherits its launcher's notice file: it takes ``SIGTERM`` out
of torchrun's signals too, carries on at the node's notice, and ends its workers as torchrun does at any other.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import NoReturn

from titan_recover.process_exit import leave, remove_folders_of_dead_processes
from titan_recover.recover.notice import ENDING, NOTICE, NOTICE_FILE_ENV, NoticeFile, SigtermTriage
from titan_recover.recover.stop_request import (CHECKPOINT_SIGNAL, PREEMPTION_SIGNAL, PreemptionNotice,
                                                STOP_FILE_ENV, STOP_SIGNAL)


_STOP_FOLDER_PREFIX = "titan_recover_stop."
"""Each agent's folder in the temp dir: ``<prefix><agent pid>.<random>``."""


class _StopFile:
    """The node-local file the workers look for, created when ``STOP_SIGNAL`` (or, with a grace,
    ``PREEMPTION_SIGNAL``) comes to this process; it holds the name of the first signal that asked."""

    def __init__(self, grace_s: float = 0.0):
        remove_folders_of_dead_processes(tempfile.gettempdir(), _STOP_FOLDER_PREFIX)
        self.folder = tempfile.mkdtemp(prefix=f"{_STOP_FOLDER_PREFIX}{os.getpid()}.")
        self.file = os.path.join(self.folder, "requested")
        os.environ[STOP_FILE_ENV] = self.file  # the workers torchrun starts inherit it
        self.requested_by: int | None = None
        self.notice = PreemptionNotice(grace_s)
        self.ended_why = ""
        """Why :meth:`_preempted` ended the workers, once it did."""
        self._grace_timer: threading.Timer | None = None
        self._over = False
        """torchrun returned: a late signal (the grace's timer, one from outside) has nothing left to end."""
        signal.signal(STOP_SIGNAL, self._note)
        signal.signal(CHECKPOINT_SIGNAL, self._checkpoint_asked)  # its default action would end the agent
        self.node_notice = NoticeFile.inherited()
        """The notice file of the node's first process: a replica-group launcher's when it names one, else this
        process's own with a grace (it is the first process), else None (recover/notice.py)."""
        self._own_notice = grace_s > 0 and self.node_notice is None
        """This process writes the node's notice file (only the first process does)."""
        if grace_s > 0:
            if self._own_notice:  # in this agent's folder: removed with it, even after a SIGKILL
                self.node_notice = NoticeFile(os.path.join(self.folder, "notice"))
                os.environ[NOTICE_FILE_ENV] = self.node_notice.path  # the workers inherit it
            signal.signal(PREEMPTION_SIGNAL, self._preempted)
        elif self.node_notice is not None:  # an agent of a replica group: the node's notice is not its end
            signal.signal(PREEMPTION_SIGNAL, SigtermTriage(self.node_notice, self._ended, "titan_recover.torchrun"))

    @staticmethod
    def _ended(signum, _frame) -> NoReturn:
        """What torchrun's own handler does: its agent ends the workers and this process exits 128 + ``signum``."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    @staticmethod
    def _checkpoint_asked(signum, _frame) -> None:
        print(f"titan_recover.torchrun: {signal.Signals(signum).name} asks for a checkpoint while the job trains on, "
              "which needs replica groups (recover.replicas > 1); ignored: a job of one replica writes its checkpoints "
              "by [checkpoint] interval, and SIGUSR1 stops it with one", file=sys.stderr, flush=True)

    def _note(self, signum, _frame) -> None:
        if self.requested_by is None:
            self.requested_by = signum
            with open(self.file, "w") as noted:
                noted.write(signal.Signals(signum).name)

    def _preempted(self, signum, _frame) -> None:
        """``PREEMPTION_SIGNAL``: the first asks the workers to stop, and comes again from a timer when the grace
        is over; that one, or a second from outside, ends them (torchrun's ``SignalException``)."""
        now, grace = time.monotonic(), self.notice.grace_s
        if self._over or self.notice.repeats(now):  # a repeat: the notice taken a moment ago, come by another path
            return
        if self.notice.take(now):
            self._mark_notice(NOTICE)  # the same SIGTERM, if it reached the workers too, is this notice
            self._note(signum, None)
            print(f"titan_recover.torchrun: {signal.Signals(signum).name}, a preemption notice: the workers stop "
                  "after a step they agree on, with a checkpoint of it; they are ended if they have not within "
                  f"recover.preemption_grace_s = {grace} s", file=sys.stderr, flush=True)
            self._grace_timer = threading.Timer(grace, os.kill, (os.getpid(), signum))
            self._grace_timer.daemon = True
            self._grace_timer.start()
            return
        self.ended_why = (f"not stopped within recover.preemption_grace_s = {grace} s"
                          if self.notice.expired(now) else f"a second {signal.Signals(signum).name} came")
        self._mark_notice(ENDING)  # the agent's SIGTERM to the workers ends them
        self._ended(signum, _frame)

    def _mark_notice(self, state: str) -> None:
        if self._own_notice:
            self.node_notice.mark(state)

    def exit_code(self, code: int) -> int:
        """The process's exit code: 128 + the signal that asked if the workers stopped on it and exited 0."""
        self._over = True
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        stopped = code == 0 and os.path.exists(os.path.join(self.folder, "stopped"))
        shutil.rmtree(self.folder, ignore_errors=True)
        return 128 + (self.requested_by or STOP_SIGNAL) if stopped else code


_SIGNALS_OPTIONS = ("--signals-to-handle", "--signals_to_handle")
_SIGNALS_DEST = "signals_to_handle"
"""torchrun's option for the signals its agent ends the workers on; its parser's default for it is
``PET_SIGNALS_TO_HANDLE`` (torchrun's ``PET_`` form of its options) or torchrun's own list."""
_GRACE_OPTION = "--preemption-grace-s"


def _grace(argv: list[str]) -> tuple[float, list[str]]:
    """This process's own option, ``--preemption-grace-s S`` (or ``=S``) before the training module, and ``argv``
    without it: torchrun's arguments."""
    end = argv.index("-m") if "-m" in argv else len(argv)
    for i, arg in enumerate(argv[:end]):
        name, eq, inline = arg.partition("=")
        if name == _GRACE_OPTION:
            value = inline if eq else (argv[i + 1] if i + 1 < end else "")
            try:
                grace = float(value)
            except ValueError:
                raise SystemExit(f"titan_recover.torchrun: {_GRACE_OPTION} takes seconds, got {value!r}") from None
            return grace, argv[:i] + argv[i + (1 if eq else 2):]
    return 0.0, argv


def _without_signals(argv: list[str], default: str, taken: set[str]) -> tuple[list[str], list[str]]:
    """``argv`` with the signals named in ``taken`` out of the signals torchrun's agent would handle (its option in
    ``argv`` before the training module, else ``default``: what torchrun's parser would use), since torchrun would
    install its own handler for them, which ends the workers without a checkpoint, over this process's. Returns
    (argv, the names taken out)."""
    end = argv.index("-m") if "-m" in argv else len(argv)
    value, at = default, None
    for i, arg in enumerate(argv[:end]):
        name, _, inline = arg.partition("=")
        if name in _SIGNALS_OPTIONS:
            at, value = i, inline if inline or i + 1 >= end else argv[i + 1]
    names = [n.strip() for n in value.split(",") if n.strip()]
    kept = [n for n in names if n not in taken]
    if len(kept) == len(names):
        return argv, []
    option = [f"{_SIGNALS_OPTIONS[0]}={','.join(kept)}"]
    dropped = [n for n in names if n in taken]
    if at is None:
        return option + argv, dropped
    width = 1 if "=" in argv[at] else 2
    return argv[:at] + option + argv[at + width:], dropped


def exit_code(stop: SystemExit) -> int:
    """The status Python gives a process ended by ``stop``: its code, 0 for None, 1 (after printing it) for any
    other object."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> NoReturn:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    grace, argv = _grace(list(sys.argv[1:] if argv is None else argv))
    stop = _StopFile(grace)
    taken = {STOP_SIGNAL.name} | ({PREEMPTION_SIGNAL.name} if stop.node_notice is not None else set())
    argv, dropped = _without_signals(argv, run.get_args_parser().get_default(_SIGNALS_DEST), taken)
    dropped = [name for name in dropped if name != PREEMPTION_SIGNAL.name]  # asked for with the grace: no news
    if dropped:
        print(f"titan_recover.torchrun: {', '.join(dropped)}: a stop with a checkpoint here, not a signal torchrun "
              "ends the workers on: taken out of PET_SIGNALS_TO_HANDLE / --signals-to-handle", file=sys.stderr)
    try:
        run.main(argv)
    except SystemExit as ended:
        leave(stop.exit_code(exit_code(ended)))
    except SignalException as ended:  # torchrun ended the workers on it (after its shutdown timeout at most)
        why = f"{stop.ended_why}: " if stop.ended_why else ""
        print(f"titan_recover.torchrun: {signal.Signals(ended.sigval).name}: {why}the workers were ended without a "
              "checkpoint", file=sys.stderr, flush=True)
        leave(stop.exit_code(128 + ended.sigval))
    except BaseException:  # noqa: BLE001 - printed and turned into the exit status Python would give it
        traceback.print_exc()
        leave(stop.exit_code(1))
    leave(stop.exit_code(0))


if __name__ == "__main__":
    main()
