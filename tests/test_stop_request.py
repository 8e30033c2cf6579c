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

from conftest import read_metrics, ROOT
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

    monkeypatch.delenv(STOP_FILE_ENV, raising=False)  # restored after the test
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


@pytest.mark.multiprocess
def test_sigusr1_to_the_launcher_stops_every_rank_after_one_step_with_a_checkpoint_of_it(tmp_path, default_data):
    """FSDP2 over 2 ranks, 400 steps asked for, checkpoints every 1000 (none would be written): SIGUSR1 to the
    launcher (what SLURM's ``--signal=B:USR1@SECONDS`` sends) once a step was logged. Both ranks stop after the same
    step, a checkpoint of its full training state is written, and the launcher exits 138 (stopped by the signal)."""
    command = [sys.executable, "-m", "titan_recover.launch", "train_configs/debug_model.toml", "--model.flavor", "tiny",
               "--metrics.no_enable_wandb", "--training.steps", "400", "--checkpoint.enable",
               "--checkpoint.interval", "1000", "--dump_folder", str(tmp_path)]
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path):
            assert job.poll() is None and time.monotonic() < deadline, "the job logged no step"
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGUSR1, output[-4000:]
    stopped = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "stopped"]
    assert sorted(e["rank"] for e in stopped) == [0, 1] and len({e["step"] for e in stopped}) == 1, stopped
    step = stopped[0]["step"]
    assert all(e["checkpoint_saved"] for e in stopped) and 1 < step < 400, stopped
    assert (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    assert max(r["step"] for r in read_metrics(tmp_path)) == step
    assert f"stopping after step {step}" in output

    # the full training state a later start resumes from (TorchTitan loads it whole for any step but 0), not a
    # model-only export; resuming from it is TorchTitan's load, tested in tests/test_checkpoint_restart.py
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "checkpoint" / f"step-{step}")).read_metadata().state_dict_metadata
    assert {"optimizer", "lr_scheduler", "dataloader", "train_state"} <= {key.split(".")[0] for key in saved}


def test_an_agent_removes_the_stop_folders_of_agents_killed_before_they_could(tmp_path):
    """An agent killed by SIGKILL cannot remove its folder; the next agent on the node removes it, and never the
    folder of an agent still running (the pid in the name) or anything else in the temp dir."""
    from titan_recover.torchrun import _remove_folders_of_dead_agents

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"titan_recover_stop.{dead.pid}.abc", f"titan_recover_stop.{os.getpid()}.def",
                 "titan_recover_stop.notapid", f"other.{dead.pid}.x"):
        (tmp_path / name).mkdir()
    (tmp_path / f"titan_recover_stop.{dead.pid}.abc" / "requested").touch()
    assert _remove_folders_of_dead_agents(str(tmp_path)) == [f"titan_recover_stop.{dead.pid}.abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"titan_recover_stop.{os.getpid()}.def", "titan_recover_stop.notapid", f"other.{dead.pid}.x"])


def test_sigusr1_is_taken_out_of_the_signals_torchrun_would_end_the_workers_on():
    """``--signals-to-handle`` (or ``PET_SIGNALS_TO_HANDLE``) with SIGUSR1 would replace the agent's stop handler
    with torchrun's, which ends the workers without a checkpoint: the agent passes torchrun the list without it."""
    from titan_recover.torchrun import _without_stop_signal

    job = ["--nproc-per-node", "2", "-m", "titan_recover.train", "--signals-to-handle", "SIGUSR1"]
    assert _without_stop_signal(job, {}) == (job, False)  # torchrun's default list; the module's own args untouched
    assert _without_stop_signal(job, {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1"}) == (
        ["--signals-to-handle=SIGTERM", *job], True)
    assert _without_stop_signal(["--signals_to_handle", "SIGUSR1, SIGINT", *job], {}) == (
        ["--signals-to-handle=SIGINT", *job], True)
    assert _without_stop_signal(["--signals-to-handle=SIGUSR2,SIGUSR1", *job], {}) == (
        ["--signals-to-handle=SIGUSR2", *job], True)
