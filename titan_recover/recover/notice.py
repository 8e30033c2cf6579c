"""A preemption notice sent to every process of a node at once (docs/deploy.md "Preemption").

With ``[recover] preemption_grace_s > 0`` the job's first process on a node (the launcher of replica groups, or the
torchrun of a job without them) takes its first ``SIGTERM`` as a preemption notice: the job stops with a checkpoint.
Kubernetes, ``docker stop`` and systemd signal that process only. SLURM (``proctrack/cgroup``) signals every process
of the job step at the same moment: the coordinator, each group's torchrun agent and every rank get the same
``SIGTERM``. By default each of them dies of it, and the checkpoint is never written.

So the first process writes the node's **notice file**, whose path every process it starts inherits
(:data:`NOTICE_FILE_ENV`), set only when a grace is. The file holds one word:

- ``notice`` (:data:`NOTICE`): the first process took a preemption notice. A ``SIGTERM`` that reaches another
  process now is that notice, reaching it as well: the process carries on, and the stop comes to it the way
  every stop does (the job's store, or its agent's stop file).
- ``ending`` (:data:`ENDING`): the first process ends the node's processes (the grace ran out, a second ``SIGTERM``,
  Ctrl-C). It writes this before it signals them, so that none takes that ``SIGTERM`` for the notice.

A process that gets ``SIGTERM`` while the file does not say ``notice`` waits for it up to :data:`NOTICE_WAIT_S`
(the signal may reach it before the first process wrote the file), then ends as ``SIGTERM`` ends it. Only its first
``SIGTERM``, and one less than :data:`REPEAT_S` after it, can be the notice: a scheduler that signals every process
of a job may also have the job's ``srun`` forward the same signal, which SLURM delivers to every process of the
step again, moments later. A later one always ends the process. Only the first process writes the file; so a
``SIGTERM`` that a torchrun agent sends its workers after one of them failed (the file absent) ends them
:data:`NOTICE_WAIT_S` later than it would without a grace (and, within :data:`REPEAT_S` of a notice, not at all:
the agent's SIGKILL after its shutdown timeout does).

A rank cannot decide on its main thread: Python runs a signal's handler there only between bytecodes, and a rank
blocked in a collective whose peer died would then never end (torchrun's agent would have to wait for its SIGKILL,
30 s later). :func:`guard_rank` decides on a thread of its own, woken by the signal itself (``set_wakeup_fd``), and
ends the process with ``os._exit``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable

from titan_recover.process_exit import remove_folders_of_dead_processes

NOTICE_FILE_ENV = "TITAN_RECOVER_NOTICE_FILE"
NOTICE, ENDING = "notice", "ending"
NOTICE_WAIT_S = 1.0
"""How long a process that got ``SIGTERM`` waits for the node's first process to write ``notice``: the scheduler
signals every process at once, and the first process writes the file when its own handler runs."""
REPEAT_S = 1.0
"""A ``SIGTERM`` this soon after a process's first is that one come again by another path, not a second one (the
first process's :class:`~titan_recover.recover.stop_request.PreemptionNotice` applies the same window)."""
_POLL_S = 0.02
_FOLDER_PREFIX = "titan_recover_notice."
"""A notice file's folder in the temp dir: ``<prefix><pid of its first process>.<random>``."""


class NoticeFile:
    """The node's notice file at ``path``: written by the first process only, read by the others."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def create(cls) -> "NoticeFile":
        """A new file, in a folder of its own in the node's temp dir that the first :meth:`mark` makes (a process
        that never writes leaves nothing behind) and :meth:`remove` removes."""
        remove_folders_of_dead_processes(tempfile.gettempdir(), _FOLDER_PREFIX)  # left by a launcher SIGKILLed
        folder = f"{_FOLDER_PREFIX}{os.getpid()}.{uuid.uuid4().hex[:12]}"
        return cls(os.path.join(tempfile.gettempdir(), folder, "notice"))

    @classmethod
    def inherited(cls) -> "NoticeFile | None":
        """The file the first process named for this one, or None (no grace: ``SIGTERM`` ends it, as ever)."""
        path = os.environ.get(NOTICE_FILE_ENV, "")
        return cls(path) if path else None

    def mark(self, state: str) -> None:
        """Write ``state`` (:data:`NOTICE` or :data:`ENDING`) whole: a reader sees the old word or the new one."""
        if state not in (NOTICE, ENDING):
            raise ValueError(f"a notice file holds {NOTICE!r} or {ENDING!r}, not {state!r}")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        partial = f"{self.path}.{os.getpid()}.partial"
        with open(partial, "w") as out:
            out.write(state)
        os.replace(partial, self.path)

    def read(self) -> str | None:
        try:
            with open(self.path) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def remove(self) -> None:
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def is_notice(read: Callable[[], str | None], early: bool, wait_s: float = NOTICE_WAIT_S,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """A ``SIGTERM`` came to a process that is not the node's first: True if it is the node's preemption notice
    (carry on), False if it ends the process. Only an ``early`` one (the process's first ``SIGTERM``, or one within
    :data:`REPEAT_S` of it) can be the notice; it is when the file says ``notice`` within ``wait_s``, and not when
    it says ``ending`` or still nothing by then."""
    if not early:
        return False
    deadline = clock() + wait_s
    while True:
        state = read()
        if state == NOTICE:
            return True
        if state == ENDING or clock() >= deadline:
            return False
        sleep(_POLL_S)


class SigtermTriage:
    """A ``SIGTERM`` handler for a process whose main thread returns to Python promptly (a coordinator, an agent):
    the node's notice (its first ``SIGTERM``, and one within :data:`REPEAT_S` of it, while the file says
    ``notice``) is noted and the process carries on; any other ``SIGTERM`` goes to ``on_end``."""

    def __init__(self, notice: NoticeFile, on_end: Callable, who: str, then: str = "carrying on until the job stops",
                 clock: Callable[[], float] = time.monotonic):
        self.notice, self.on_end, self.who, self.then, self.clock = notice, on_end, who, then, clock
        self.first_at: float | None = None
        """When this process's first ``SIGTERM`` came (``clock`` seconds)."""

    def __call__(self, signum, frame):
        # A second SIGTERM may come while the first is still being judged: Python runs this handler again inside
        # the first's wait, and on a rank's thread it waits in the pipe. Judged alike, they end alike.
        now, first = self.clock(), self.first_at is None
        if first:
            self.first_at = now
        if not is_notice(self.notice.read, now - self.first_at < REPEAT_S):
            return self.on_end(signum, frame)
        if first:
            print(f"{self.who}: SIGTERM, the node's preemption notice: {self.then}", file=sys.stderr, flush=True)
        else:
            print(f"{self.who}: SIGTERM again, {now - self.first_at:.2f} s after the first: the same notice come by "
                  "another path", file=sys.stderr, flush=True)
        return None


def guard_rank(notice: NoticeFile | None, who: str = "titan_recover") -> bool:
    """Install the rank's ``SIGTERM`` decision (module docstring) when the node has a notice file; call it from the
    main thread, first thing. Returns whether it was installed. Not installed, ``SIGTERM`` ends the rank at once, as
    without a grace: no notice file, or a wakeup fd that someone else set already (this would replace it)."""
    if notice is None or threading.current_thread() is not threading.main_thread():
        return False
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # another part of this process listens to its signals this way: leave it theirs
        signal.set_wakeup_fd(previous)
        os.close(read_end), os.close(write_end)
        print(f"{who}: a signal wakeup fd is set already: SIGTERM ends this rank at once, even as a preemption "
              "notice", file=sys.stderr, flush=True)
        return False
    signal.signal(signal.SIGTERM, lambda *_: None)  # decided on the thread below, not on the main thread

    def end(signum, _frame) -> None:
        print(f"{who}: SIGTERM: ending this rank now (exit {128 + signum})", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    triage = SigtermTriage(notice, end, who, then="this rank stops with the job")

    def decide() -> None:
        while True:
            if signal.SIGTERM in os.read(read_end, 64):
                triage(signal.SIGTERM, None)

    threading.Thread(target=decide, daemon=True, name="titan-recover-sigterm").start()
    return True
