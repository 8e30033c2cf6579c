"""A preemption notice sent to every process of a node at once (titan_recover/recover/notice.py): which SIGTERM is
the notice, and what a rank, an agent and a coordinator do with each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from conftest import ROOT
from titan_recover.recover.notice import (ENDING, is_notice, NOTICE, NOTICE_FILE_ENV, NOTICE_WAIT_S, NoticeFile,
                                         REPEAT_S, SigtermTriage)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_only_a_processs_first_sigterm_can_be_the_notice_and_only_once_the_first_process_wrote_it():
    def judge(states: list, early: bool = True, wait_s: float = 1.0) -> tuple[bool, float]:
        clock, seen = Clock(), iter(states)
        return is_notice(lambda: next(seen, states[-1]), early, wait_s, clock, clock.sleep), clock.now

    assert judge([NOTICE]) == (True, 0.0)
    assert judge([None, None, NOTICE]) == (True, pytest.approx(0.04))  # the first process wrote it a little later
    assert judge([ENDING]) == (False, 0.0)  # the first process ends the node's processes
    assert judge([None]) == (False, pytest.approx(1.0, abs=0.03))  # nobody took a notice: a SIGTERM of its own
    assert judge([NOTICE], early=False) == (False, 0.0)  # a second SIGTERM, not the first come again, ends it


def test_a_sigterm_within_a_second_of_the_first_is_the_same_notice_and_a_later_one_ends_the_process():
    """What SLURM may deliver at a preemption: its SIGTERM to every process of the step, then the same signal again
    when the job's srun forwards it (delivered to the whole step once more). A repeat within REPEAT_S carries on
    while the file says ``notice``, even one that comes while the first is still waiting for the file; a later one,
    or one after the first process wrote ``ending``, ends the process."""
    clock, states, ended = Clock(), {"now": NOTICE}, []

    def triage(read=lambda: states["now"]) -> SigtermTriage:
        return SigtermTriage(types.SimpleNamespace(read=read), lambda *_: ended.append(clock.now), "test", clock=clock)

    repeated = triage()
    assert repeated(signal.SIGTERM, None) is None and repeated.first_at == 0.0
    clock.now = REPEAT_S / 2
    assert repeated(signal.SIGTERM, None) is None and not ended
    clock.now = REPEAT_S
    repeated(signal.SIGTERM, None)
    assert ended == [REPEAT_S]

    ended.clear()
    ending = triage()
    ending(signal.SIGTERM, None)
    states["now"] = ENDING
    ending(signal.SIGTERM, None)  # the first process ends the node's processes, a moment after the notice
    assert ended == [clock.now]

    # the repeat comes while the first waits for the first process to write the file (a handler run inside another)
    ended.clear()
    states["now"], reads = None, []

    def read() -> str | None:
        reads.append(states["now"])
        if len(reads) == 2:
            states["now"] = NOTICE
            assert nested(signal.SIGTERM, None) is None
        return states["now"]

    nested = triage(read)
    assert nested(signal.SIGTERM, None) is None and not ended and len(reads) == 3  # the inner judged on read 3


def test_a_notice_file_holds_one_word_whole_and_its_folder_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv(NOTICE_FILE_ENV, "")
    assert NoticeFile.inherited() is None  # no grace: no file
    notice = NoticeFile.create()
    assert not os.path.exists(os.path.dirname(notice.path))  # made by the first word written
    monkeypatch.setenv(NOTICE_FILE_ENV, notice.path)
    assert NoticeFile.inherited().path == notice.path and notice.read() is None
    notice.mark(NOTICE)
    assert notice.read() == NOTICE
    notice.mark(ENDING)
    assert notice.read() == ENDING and os.listdir(os.path.dirname(notice.path)) == ["notice"]  # no partial left
    with pytest.raises(ValueError, match="holds 'notice' or 'ending'"):
        notice.mark("stop")
    notice.remove()
    assert not os.path.exists(os.path.dirname(notice.path))


RANK = textwrap.dedent("""
    import os, sys, threading
    sys.path.insert(0, {root!r})
    from titan_recover.recover.notice import guard_rank, NoticeFile
    assert guard_rank(NoticeFile({path!r}), who="rank")
    print("guarded", flush=True)
    read_end, _ = os.pipe()
    os.read(read_end, 1)  # stuck in a call that never returns, as a rank in a collective whose peer died
""")


def guarded_rank(path: str) -> subprocess.Popen:
    rank = subprocess.Popen([sys.executable, "-c", RANK.format(root=str(ROOT), path=path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert rank.stdout.readline().strip() == "guarded"
    return rank


def test_a_stuck_rank_carries_on_at_the_nodes_notice_and_ends_at_any_other_sigterm(tmp_path):
    """A rank whose main thread never returns to Python: the node's notice (the first SIGTERM, the file saying
    ``notice``) leaves it running; the SIGTERM that ends the node's processes (the file saying ``ending``) ends it
    at once with 143, and a SIGTERM with no notice taken by anyone ends it after NOTICE_WAIT_S."""
    notice = NoticeFile(str(tmp_path / "notice"))
    notice.mark(NOTICE)
    rank = guarded_rank(notice.path)
    try:
        rank.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        rank.send_signal(signal.SIGTERM)  # the same notice again, as srun's forward of it would come
        time.sleep(0.5)
        assert rank.poll() is None
        notice.mark(ENDING)
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=10) == 128 + signal.SIGTERM
        assert "SIGTERM, the node's preemption notice" in rank.stderr.read()

        alone = guarded_rank(str(tmp_path / "never-written"))
        sent = time.monotonic()
        alone.send_signal(signal.SIGTERM)
        assert alone.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - sent >= NOTICE_WAIT_S
        assert "SIGTERM: ending this rank now (exit 143)" in alone.stderr.read()
    finally:
        for proc in (rank, locals().get("alone")):
            if proc is not None and proc.poll() is None:
                proc.kill()


def test_a_group_agent_ends_its_workers_at_a_sigterm_that_is_not_the_nodes_notice(tmp_path, monkeypatch):
    """The torchrun of a replica group (no grace of its own, the launcher's notice file inherited): SIGTERM is out
    of the signals torchrun handles; at the node's notice it carries on, at any other SIGTERM it raises torchrun's
    SignalException (torchrun then ends the workers, as it does without a grace)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from titan_recover.recover.stop_request import STOP_FILE_ENV
    from titan_recover.torchrun import _StopFile

    notice = NoticeFile(str(tmp_path / "notice"))
    monkeypatch.setenv(NOTICE_FILE_ENV, notice.path)
    monkeypatch.setenv(STOP_FILE_ENV, "")
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        notice.mark(NOTICE)
        agent = _StopFile(grace_s=0.0)
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)  # the notice: nothing happens here
        handler(signal.SIGTERM, None)  # and again at once: the same notice by another path
        assert agent.requested_by is None
        handler.first_at -= REPEAT_S
        with pytest.raises(SignalException) as ended:
            handler(signal.SIGTERM, None)  # a second
        assert ended.value.sigval == signal.SIGTERM
        notice.mark(ENDING)
        _StopFile(grace_s=0.0)
        with pytest.raises(SignalException):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert notice.read() == ENDING  # an agent of a group never writes the node's file
        agent.exit_code(0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_the_agent_of_a_job_without_replica_groups_writes_the_nodes_notice_for_its_workers(monkeypatch):
    """With a grace the agent is the node's first process: it names a notice file for its workers, writes
    ``notice`` at the first SIGTERM and ``ending`` before it ends them, and removes the file at its end."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from titan_recover.recover.stop_request import STOP_FILE_ENV
    from titan_recover.torchrun import _StopFile

    monkeypatch.setenv(NOTICE_FILE_ENV, "")
    monkeypatch.setenv(STOP_FILE_ENV, "")
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        agent = _StopFile(grace_s=60)
        notice = NoticeFile.inherited()
        assert notice is not None and notice.read() is None
        agent._preempted(signal.SIGTERM, None)
        assert notice.read() == NOTICE
        agent.notice.since -= agent.notice.repeat_s  # a second SIGTERM, not the first come again
        with pytest.raises(SignalException):
            agent._preempted(signal.SIGTERM, None)
        assert notice.read() == ENDING
        agent.exit_code(0)
        assert not os.path.exists(notice.path)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_new_notice_file_clears_those_left_by_launchers_killed_before_they_could(tmp_path, monkeypatch):
    import tempfile

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / f"titan_recover_notice.{dead.pid}.abc").mkdir()
    (tmp_path / f"titan_recover_notice.{os.getpid()}.def").mkdir()  # a live launcher's stays
    notice = NoticeFile.create()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"titan_recover_notice.{os.getpid()}.def"]
    notice.mark(NOTICE)
    assert os.path.dirname(notice.path).startswith(str(tmp_path / f"titan_recover_notice.{os.getpid()}."))
