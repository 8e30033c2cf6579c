"""Replica groups surviving each other: real coordinator + one torchrun per replica, faults injected exactly.

Hangs, stuck main threads, Ctrl-C and the too-few-replicas stop. Crashes at every phase of a step, with FSDP or TP
inside, are in test_invariant.py, which also compares every run with the failure-free one. Every test asserts
that the fault fired, that the survivors trained every step, that their parameters are bitwise identical across
replicas, and that no process of the run is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import launcher_command, ROOT
from replica_runs import assert_survived, FAST_DETECTION, run_replicas
from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.groups.coordinator import MAX_LOOK_GAP_S
from titan_recover.recover.groups.keys import fault_time_and_reason
from titan_recover.recover.events import read_events
from titan_recover.recover.children import processes_of_run

pytestmark = pytest.mark.multiprocess


def test_hung_process_and_stuck_main_thread_are_dropped_after_their_timeouts(tmp_path, default_data):
    """Replica 2 stops whole (SIGSTOP) in step 2's reduction: no heartbeat, dropped after the heartbeat timeout.
    Replica 1's main thread gets stuck in step 3's forward while its heartbeat thread beats on: dropped after the
    progress timeout.

    Each verdict is checked on the coordinator's own watched time, which its stalls on a busy machine do not
    shorten or lengthen: the silence (or stillness) it watched reached the timeout and exceeds it by at most one
    look; and the verdict was the first fault of its epoch (the flag it raised is its own), so the survivors were
    released by it, not by their collective timeout. A verdict before the timeout, a watch that let a timeout pass
    by more than a look, or a hang found only by the collective timeout fails this."""
    progress_timeout_s = 5.0
    proc, events = run_replicas(tmp_path, replicas=3, ranks=1, steps=4,
                                faults=[{"kind": "hang", "replica": 2, "rank": 0, "step": 2, "phase": "reduction"},
                                        {"kind": "stall", "replica": 1, "rank": 0, "step": 3, "phase": "forward"}],
                                extra=("--recover.progress_timeout_s", str(progress_timeout_s)))
    assert_survived(tmp_path, proc, events, replicas=3, ranks=1, steps=4, lost={2: 2, 1: 3})
    injected = {e["replica"]: e["time"] for e in events if e["event"] == "fault_injected"}
    detected = {e["replica"]: e for e in events if e["event"] == "failure_detected" and e["by"] == "coordinator"}
    defaults = RecoverConfig()
    heartbeat_timeout_s = float(FAST_DETECTION[FAST_DETECTION.index("--recover.heartbeat_timeout_s") + 1])
    look_s = max(MAX_LOOK_GAP_S, 2 * defaults.heartbeat_interval_s) + 0.001  # one look's counted time (+ rounding)
    assert detected[2]["dead_ranks"] == [0]
    assert heartbeat_timeout_s <= detected[2]["beats"]["0"]["quiet_s"] <= heartbeat_timeout_s + look_s
    assert detected[1]["hung_ranks"] == [0]
    assert detected[1]["beats"]["0"]["quiet_s"] < heartbeat_timeout_s < progress_timeout_s
    assert progress_timeout_s <= detected[1]["beats"]["0"]["still_s"] <= progress_timeout_s + look_s
    for replica in (2, 1):
        assert injected[replica] < detected[replica]["time"] < injected[replica] + defaults.collective_timeout_s
        assert fault_time_and_reason(detected[replica]["flag"])[1] == detected[replica]["reason"], detected[replica]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl_c", "launcher_killed"])
def test_ctrl_c_or_a_killed_launcher_leaves_no_process_behind(tmp_path, default_data, sig):
    """Ctrl-C: the launcher forwards it and cleans up. SIGKILL of the launcher: it cleans up nothing, and every
    child still ends (PR_SET_PDEATHSIG; torchrun ends its workers)."""
    cmd = [sys.executable, "-m", "titan_recover.launch", "train_configs/replicas.toml", "--model.flavor", "tiny",
           "--metrics.no_enable_wandb", "--training.steps", "1000", "--recover.replicas", "2",
           "--parallelism.data_parallel_shard_degree", "1", "--dump_folder", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not any(e["event"] == "step_committed" for e in read_events(tmp_path / "events.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
            time.sleep(0.5)
        assert len(processes_of_run(str(tmp_path))) >= 5  # coordinator, 2 torchruns, 2 workers
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30  # torchrun gives its workers a grace period after SIGTERM
        while processes_of_run(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = processes_of_run(str(tmp_path))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert left == []


@pytest.mark.parametrize("sig,to_every_process", [(signal.SIGUSR1, False), (signal.SIGTERM, False),
                                                  (signal.SIGTERM, True)],
                         ids=["time_limit", "preemption", "preemption_to_every_process"])
def test_a_stop_request_to_the_launcher_ends_the_job_with_a_checkpoint_of_the_last_committed_step(
        tmp_path, default_data, sig, to_every_process):
    """SIGUSR1 to the launcher (what SLURM's ``--signal=B:USR1@SECONDS`` sends before the time limit), or SIGTERM
    with ``[recover] preemption_grace_s`` (what Kubernetes sends a container's first process), or that SIGTERM to
    every process of the job at once, the launcher last, and then all of them again (what SLURM sends at a
    preemption: the coordinator, both groups' agents and ranks too, and srun may forward it to the step): the job
    stops at once with a durable checkpoint of its last committed step, written once, and the launcher exits 128 +
    the signal (stopped, not trained), naming the request; nothing is left running. Before that (the time-limit case), SIGUSR2 asks for a checkpoint while the job trains on: the next
    committed step's is written, whatever the interval."""
    from replica_runs import replica_job_args

    def first_step(event: str, since: int = 0) -> int:
        deadline = time.monotonic() + 180
        while True:
            found = [e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == event
                     and e["step"] >= since]
            if found:
                return found[0]
            assert time.monotonic() < deadline and proc.poll() is None, f"no {event} from step {since} on"
            time.sleep(0.2)

    def written(step: int) -> None:
        """The checkpoint of ``step`` completes (its event comes before the trainer writes it), the job running."""
        deadline = time.monotonic() + 120
        while not (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").is_file():
            assert time.monotonic() < deadline and proc.poll() is None, f"the checkpoint of step {step} never completed"
            time.sleep(0.2)

    extra = ("--checkpoint.enable", "--checkpoint.interval", "1000")
    if sig == signal.SIGTERM:
        extra += ("--recover.preemption_grace_s", "120")
    args = replica_job_args(tmp_path, replicas=2, ranks=1, steps=1000, faults=[], extra=extra)
    proc = subprocess.Popen(launcher_command(*args), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        asked_at = first_step("step_committed", since=3)
        if sig == signal.SIGUSR1:
            proc.send_signal(signal.SIGUSR2)
            written(first_step("checkpoint_on_request", since=asked_at))
        children = processes_of_run(str(tmp_path)) if to_every_process else []
        for pid in children:  # before the launcher: they wait for it to write the node's notice
            os.kill(pid, sig)
        proc.send_signal(sig)
        if to_every_process:  # and again at once, as srun may forward the scheduler's (SLURM sends it to the step)
            for pid in [proc.pid, *children]:
                os.kill(pid, sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, output[-3000:]
    assert f"stop requested ({signal.Signals(sig).name} to the launcher of node 0" in output, output[-3000:]
    if sig == signal.SIGUSR1:
        assert "SIGUSR2 to the launcher of node 0: a durable checkpoint of the next committed step asked for" in output
    events = read_events(tmp_path / "events.jsonl")
    committed = max(e["step"] for e in events if e["event"] == "step_committed")
    stopped = [e for e in events if e["event"] == "stopped"]
    assert stopped and {e["step"] for e in stopped} == {committed}
    assert any(e["checkpoint_saved"] for e in stopped)
    assert (tmp_path / "checkpoint" / f"step-{committed}" / ".metadata").is_file()
    assert processes_of_run(str(tmp_path)) == []
    if to_every_process:  # the coordinator, both agents and both ranks took the SIGTERM for the notice
        assert len(children) == 5, children
        logs = "".join(log.read_text() for log in (tmp_path / "logs").glob("*.log"))
        assert logs.count("SIGTERM, the node's preemption notice") == 5, logs[-4000:]
        # none ended at the repeat, both ranks stopped with the job (two signals that come before a process runs
        # may reach it as one: how many say "again" varies)
        assert "ending this rank now" not in logs and {e["source"] for e in stopped} == {"0/0", "1/0"}, stopped
        assert "coordinator exited" not in output, output[-3000:]  # not restarted: it carried on


def test_too_few_replicas_stop_with_a_durable_checkpoint_written_in_turn(tmp_path, default_data):
    """Replica 1 dies in step 3: 2 of 3 replicas left, fewer than min_replicas = 3, so the job stops with the
    checkpoint of step 2. Its first writer, replica 0 (the lowest candidate), dies right before its save, a case no
    liveness check before the stop can see; the coordinator names it lost, and replica 2, which waited, writes the
    checkpoint instead (docs/replica_groups.md "Checkpoints")."""
    proc, events = run_replicas(
        tmp_path, replicas=3, ranks=1, steps=5,
        faults=[{"kind": "kill", "replica": 1, "rank": 0, "step": 3, "phase": "forward"},
                {"kind": "kill", "replica": 0, "rank": 0, "step": 2, "phase": "stop_save"}],
        extra=("--recover.min_replicas", "3", "--checkpoint.enable", "--checkpoint.interval", "100"),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "fewer than recover.min_replicas = 3: stopping" in output, output[-3000:]
    injected = [e for e in events if e["event"] == "fault_injected" and e["phase"] == "stop_save"]
    assert [e["source"] for e in injected] == ["0/0"], injected
    handover = [e for e in events if e["event"] == "stop_checkpoint_handover"]
    assert [(e["source"], e["step"], e["handovers"]) for e in handover] == [("2/0", 2, [[0, "lost"]])], handover
    log = (tmp_path / "logs" / "replica_2.log").read_text()
    assert "the checkpoint of step 2 passes to replica 2 (replica 0 lost)" in log, log[-3000:]
    stopped = {e["source"]: e for e in events if e["event"] == "stopped"}
    assert set(stopped) == {"2/0"} and stopped["2/0"]["step"] == 2 and stopped["2/0"]["checkpoint_saved"]
    # written once, by the survivor, into the run's checkpoint folder (docs/replica_groups.md "Checkpoints")
    assert (tmp_path / "checkpoint" / "step-2" / ".metadata").is_file()
    assert not list(tmp_path.glob("replica_*/checkpoint"))
    assert processes_of_run(str(tmp_path)) == []
