"""A stop with a checkpoint asked for by SIGUSR1 in a job without replica groups (titan_recover/recover/stop_request.py,
titan_recover/torchrun.py): the ranks' agreement on the step, and the whole path through the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import descendants, launcher_command, read_metrics, ROOT
from titan_recover.recover.events import read_events
from titan_recover.recover.stop_request import StopAgreement


class Ranks:
    """The all-reduce (max) of several ranks' flags, as the ranks' agreements see it: each rank's ``poll`` of
    step ``s`` contributes to the reduction of step ``s``; the value is there once every rank contributed (the
    caller polls the ranks of a step in turn, as their collective completes)."""

    def __init__(self, ranks: int):
        self.ranks, self.contributed = ranks, {}

    def agreement(self, rank: int) -> StopAgreement:
        step = [0]

        def reduce(flag: torch.Tensor):
            step[0] += 1
            values = self.contributed.setdefault(step[0], [])
            values.append(flag)
            if len(values) == self.ranks:
                top = max(int(v.item()) for v in values)
                for v in values:
                    v.fill_(top)
            return type("Work", (), {"wait": lambda _self: None})()

        return StopAgreement("cpu", all_reduce_max=reduce, lag=2)


def test_the_ranks_agree_on_one_step_whichever_step_each_saw_the_signal_at():
    """Rank 1 sees the signal at step 3, rank 0 only at step 5: both answer True first at step 5 (the reduction
    of step 3, read two steps later), never before, and on every step after."""
    ranks = Ranks(2)
    agreements = [ranks.agreement(0), ranks.agreement(1)]
    answers = {0: [], 1: []}
    for step in range(1, 9):
        for rank in (0, 1):
            saw = (rank == 1 and step >= 3) or (rank == 0 and step >= 5)
            answers[rank].append(agreements[rank].poll(saw))
    assert answers[0] == answers[1] == [False] * 4 + [True] * 4
    # no step allocates: each rank's flags are a ring of lag + 1 tensors, each reused only after it was read
    for rank in (0, 1):
        used = {id(flags[rank]) for flags in ranks.contributed.values()}
        assert len(used) == 3, used
    with pytest.raises(ValueError, match="lag must be at least 1"):
        StopAgreement("cpu", lag=0)


def test_the_agent_notes_the_signal_for_its_workers_and_exits_138_only_if_they_stopped(tmp_path, monkeypatch):
    """``titan_recover.torchrun`` turns SIGUSR1 into a file its workers (started before or after) look for; it
    exits 128 + 10 only if the workers wrote that they stopped and exited 0, else with their code (0: the budget was
    trained before the request took effect)."""
    from titan_recover.recover.stop_request import STOP_FILE_ENV, StopSignal, stopped_marker
    from titan_recover.torchrun import _StopFile

    monkeypatch.setenv(STOP_FILE_ENV, "")  # restored after the test (the agent sets it for its workers)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        agent = _StopFile()
        worker = StopSignal()  # inherits the file's path
        assert not worker.requested and worker.file == agent.file
        os.kill(os.getpid(), signal.SIGUSR1)  # to the agent (this process's handler is now the worker's)
        assert worker.signalled and worker.requested
        worker.signalled = False
        assert not worker.requested  # the agent's file is not there: only this process was signalled
        agent._note(signal.SIGUSR1, None)
        assert worker.requested
        assert agent.exit_code(0) == 0 and not os.path.exists(agent.folder)  # no worker stopped: the budget trained
        agent = _StopFile()
        open(stopped_marker(), "a").close()
        assert agent.exit_code(1) == 1  # a failure stays one
        agent = _StopFile()
        open(stopped_marker(), "a").close()
        assert agent.exit_code(0) == 128 + signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_agent_of_a_job_without_replica_groups_ignores_sigusr2_saying_why(tmp_path, monkeypatch, capfd):
    """SIGUSR2 asks a launcher of replica groups for a checkpoint while training on (docs/deploy.md); to torchrun's
    agent of a job without them, its default action would end the job: the agent says why it is ignored instead."""
    from titan_recover.recover.stop_request import STOP_FILE_ENV
    from titan_recover.torchrun import _StopFile

    monkeypatch.setenv(STOP_FILE_ENV, "")
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        agent = _StopFile()
        os.kill(os.getpid(), signal.SIGUSR2)  # the default action would end this process
        assert "SIGUSR2 asks for a checkpoint while the job trains on, which needs replica groups" in \
            capfd.readouterr().err
        assert agent.requested_by is None and agent.exit_code(0) == 0  # no stop either
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@pytest.mark.multiprocess
@pytest.mark.parametrize("sig,to_every_process", [(signal.SIGUSR1, False), (signal.SIGTERM, False),
                                                  (signal.SIGTERM, True)],
                         ids=["time_limit", "preemption", "preemption_to_every_process"])
def test_a_stop_signal_to_the_launcher_stops_every_rank_after_one_step_with_a_checkpoint_of_it(tmp_path, default_data,
                                                                                               sig, to_every_process):
    """FSDP2 over 2 ranks, 400 steps asked for, checkpoints every 1000 (none would be written): once a step was
    logged, SIGUSR1 to the launcher (what SLURM's ``--signal=B:USR1@SECONDS`` sends), or SIGTERM with
    ``[recover] preemption_grace_s`` (what Kubernetes sends a container's first process), or that SIGTERM to every
    process of the job at once, twice (what SLURM sends at a preemption: the agent and both ranks, and again if the
    job's srun forwards it). Both ranks stop after
    the same step, a checkpoint of its full training state is written, and the launcher exits 128 + the signal."""
    args = ["train_configs/debug_model.toml", "--model.flavor", "tiny", "--metrics.no_enable_wandb", "--training.steps",
            "400", "--checkpoint.enable", "--checkpoint.interval", "1000", "--dump_folder", str(tmp_path)]
    if sig == signal.SIGTERM:
        args += ["--recover.preemption_grace_s", "120"]
    # the launcher execs torchrun's agent: the signal goes to the agent; to every process, the job runs without the
    # tests' launcher server in between, so that its processes are the agent's
    command = [sys.executable, "-m", "titan_recover.launch", *args] if to_every_process else launcher_command(*args)
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path):
            assert job.poll() is None and time.monotonic() < deadline, "the job logged no step"
            time.sleep(0.2)
        others = descendants(job.pid)[::-1] if to_every_process else []  # the ranks first, then the agent's
        for pid in others:
            os.kill(pid, sig)
        job.send_signal(sig)
        for pid in [*others, job.pid] if to_every_process else []:  # all again, as srun's forward of it would come
            os.kill(pid, sig)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + sig, output[-4000:]
    stopped = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "stopped"]
    assert sorted(e["rank"] for e in stopped) == [0, 1] and len({e["step"] for e in stopped}) == 1, stopped
    step = stopped[0]["step"]
    assert all(e["checkpoint_saved"] for e in stopped) and 1 < step < 400, stopped
    assert (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    assert max(r["step"] for r in read_metrics(tmp_path)) == step
    assert f"stop requested ({signal.Signals(sig).name}" in output and f"stopping after step {step}" in output
    if to_every_process:  # each rank took the same SIGTERM for the notice and stopped with the others
        took = "SIGTERM, the node's preemption notice: this rank stops with the job"
        assert f"titan_recover rank 0: {took}" in output, output[-4000:]  # rank 1 writes to its file
        [rank_1] = (tmp_path / "logs" / "ranks").rglob("1/stderr.log")
        assert f"titan_recover rank 1: {took}" in rank_1.read_text()
        # and none ended at the repeat (two signals that come before a process runs may reach it as one)
        assert "ending this rank now" not in output + rank_1.read_text(), output[-4000:]

    # the full training state a later start resumes from (TorchTitan loads it whole for any step but 0), not a
    # model-only export; resuming from it is TorchTitan's load, tested in tests/test_checkpoint_restart.py
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "checkpoint" / f"step-{step}")).read_metadata().state_dict_metadata
    assert {"optimizer", "lr_scheduler", "dataloader", "train_state"} <= {key.split(".")[0] for key in saved}


def test_an_agent_removes_the_stop_folders_of_agents_killed_before_they_could(tmp_path):
    """An agent killed by SIGKILL cannot remove its folder; the next agent on the node removes it, and never the
    folder of an agent still running (the pid in the name) or anything else in the temp dir."""
    from titan_recover.process_exit import remove_folders_of_dead_processes

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"titan_recover_stop.{dead.pid}.abc", f"titan_recover_stop.{os.getpid()}.def",
                 "titan_recover_stop.notapid", f"other.{dead.pid}.x"):
        (tmp_path / name).mkdir()
    (tmp_path / f"titan_recover_stop.{dead.pid}.abc" / "requested").touch()
    assert remove_folders_of_dead_processes(str(tmp_path), "titan_recover_stop.") == [f"titan_recover_stop.{dead.pid}.abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"titan_recover_stop.{os.getpid()}.def", "titan_recover_stop.notapid", f"other.{dead.pid}.x"])


def test_the_stop_signals_are_taken_out_of_the_signals_torchrun_would_end_the_workers_on():
    """``--signals-to-handle`` (or ``PET_SIGNALS_TO_HANDLE``, torchrun parser's default) with SIGUSR1, or with
    SIGTERM under a preemption grace, would replace the agent's stop handler with torchrun's, which ends the workers
    without a checkpoint: the agent passes torchrun the list without them."""
    from titan_recover.torchrun import _grace, _without_signals

    torchruns = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    usr1 = {"SIGUSR1"}
    job = ["--nproc-per-node", "2", "-m", "titan_recover.train", "--signals-to-handle", "SIGUSR1"]
    assert _without_signals(job, torchruns, usr1) == (job, [])  # the module's own args untouched
    assert _without_signals(job, "SIGTERM,SIGUSR1", usr1) == (["--signals-to-handle=SIGTERM", *job], ["SIGUSR1"])
    assert _without_signals(["--signals_to_handle", "SIGUSR1, SIGINT", *job], torchruns, usr1) == (
        ["--signals-to-handle=SIGINT", *job], ["SIGUSR1"])
    assert _without_signals(["--signals-to-handle=SIGUSR2,SIGUSR1", *job], torchruns, usr1) == (
        ["--signals-to-handle=SIGUSR2", *job], ["SIGUSR1"])
    assert _without_signals(job, torchruns, usr1 | {"SIGTERM"}) == (
        ["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", *job], ["SIGTERM"])
    # the agent's own option, before the training module only
    assert _grace(["--preemption-grace-s=25", *job]) == (25.0, job)
    assert _grace(["--nproc-per-node", "2", "--preemption-grace-s", "7.5", "-m", "x", "--preemption-grace-s=1"]) == (
        7.5, ["--nproc-per-node", "2", "-m", "x", "--preemption-grace-s=1"])
    assert _grace(job) == (0.0, job)
    with pytest.raises(SystemExit, match="--preemption-grace-s takes seconds, got 'soon'"):
        _grace(["--preemption-grace-s=soon", *job])


def test_a_preemption_notice_asks_once_and_ends_the_job_after_its_grace():
    from titan_recover.recover.stop_request import describe, PreemptionNotice

    none = PreemptionNotice(0.0)
    assert not none.take(5.0) and not none.expired(1e9)  # no grace: SIGTERM ends the job at once
    notice = PreemptionNotice(30.0)
    assert not notice.expired(10.0)
    assert notice.take(10.0) and not notice.take(11.0)  # the first asks; a second ends the job
    assert notice.repeats(10.9) and not notice.repeats(11.0)  # unless it is the first come again, moments later
    short = PreemptionNotice(0.5)
    assert short.take(0.0) and short.repeats(0.4) and not short.repeats(0.5)  # never past the grace
    assert not PreemptionNotice(30.0).repeats(0.0)  # nothing taken: nothing repeats
    assert not notice.expired(39.9) and notice.expired(40.0)
    assert describe("SIGTERM") == "SIGTERM: a preemption notice"
    assert describe("SIGUSR1") == "SIGUSR1, e.g. a scheduler's warning before the job's time limit"


def test_an_agent_with_a_grace_notes_sigterm_for_its_workers_and_ends_them_when_the_grace_is_over(monkeypatch):
    """The first SIGTERM is noted in the stop file (its name in it, which the workers' stop reason quotes); the agent
    exits 143 if the workers stopped on it. When the grace is over, the agent raises torchrun's SignalException
    (torchrun then ends the workers), saying why; so does a second SIGTERM."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from titan_recover.recover.notice import NOTICE_FILE_ENV
    from titan_recover.recover.stop_request import STOP_FILE_ENV, StopSignal, stopped_marker
    from titan_recover.torchrun import _StopFile

    monkeypatch.setenv(STOP_FILE_ENV, "")  # restored at the end: the agent sets them for its workers
    monkeypatch.setenv(NOTICE_FILE_ENV, "")
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        agent = _StopFile(grace_s=0.3)
        worker = StopSignal()
        assert worker.cause == "SIGUSR1"  # nothing noted: a worker signalled itself names SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        assert worker.requested and worker.cause == "SIGTERM" and agent.requested_by == signal.SIGTERM
        agent._note(signal.SIGUSR1, None)  # a later SIGUSR1 changes nothing: the first asked
        assert worker.cause == "SIGTERM"
        with pytest.raises(SignalException) as ended:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the grace's timer sends SIGTERM again
                time.sleep(0.01)
        assert ended.value.sigval == signal.SIGTERM
        assert agent.ended_why == "not stopped within recover.preemption_grace_s = 0.3 s"
        open(stopped_marker(), "a").close()
        assert agent.exit_code(0) == 128 + signal.SIGTERM

        agent = _StopFile(grace_s=60)
        agent._preempted(signal.SIGTERM, None)
        agent._preempted(signal.SIGTERM, None)  # at once: the same notice by a second path (srun forwarding it)
        agent.notice.since -= agent.notice.repeat_s
        with pytest.raises(SignalException):
            agent._preempted(signal.SIGTERM, None)
        assert agent.ended_why == "a second SIGTERM came"
        assert agent.exit_code(0) == 0  # no worker stopped: the budget was trained first
        agent._grace_timer.join(timeout=10)  # torchrun returned: the grace's timer was cancelled (60 s were left)
        assert not agent._grace_timer.is_alive()
        agent._preempted(signal.SIGTERM, None)  # and a late SIGTERM has nothing left to end: no exception
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_the_agent_beside_a_keeper_runs_in_a_session_of_its_own():
    """A job without replica groups that runs a snapshot keeper starts torchrun's agent as a child of the launcher,
    which passes signals on: in the launcher's process group the agent would get a group's SIGTERM twice (a
    terminal's, ``kill -- -PGID``), and with a preemption grace the second ends the job without a checkpoint."""
    from titan_recover.recover.phoenix.keeper import _run_forwarding_signals

    leader = "import os, sys; sys.exit(0 if os.getsid(0) == os.getpid() else 3)"
    assert _run_forwarding_signals([sys.executable, "-c", leader], dict(os.environ)) == 0
