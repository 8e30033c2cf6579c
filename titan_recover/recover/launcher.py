"""Start a replica-group job on one node: the coordinator, then one torchrun per replica group (and, in diloco
mode, the syncer).

Each child runs in its own session; the launcher forwards Ctrl-C / SIGTERM to all of them, kills what is left
after a grace period, and finally kills any process that still carries this run's marker in its environment, so
nothing outlives the job. Output of every replica is prefixed with ``[replica i]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

from titan_recover.recover.groups.member import (
    connect,
    COORDINATOR_ENV,
    INCARNATION_ENV,
    REPLICA_ENV,
    RUN_DIR_ENV,
)
from titan_recover.recover.chaos.monkey import JOB_START_ENV
from titan_recover.recover.diloco.rules import DilocoKeys
from titan_recover.recover.groups.keys import GroupKeys, read_dropped

GRACE_S = 10.0


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.write(prefix + line.decode(errors="replace"))
        sink.flush()


def _spawn(cmd: list[str], env: dict, prefix: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    threading.Thread(target=_pump, args=(proc.stdout, prefix, sys.stdout), daemon=True).start()
    return proc


def processes_of_run(run_dir: str, replica: int | None = None, incarnation: int | None = None) -> list[int]:
    """PIDs whose environment carries this run's marker (and the replica's and incarnation's, if given); Linux
    /proc."""
    markers = {f"{RUN_DIR_ENV}={run_dir}".encode()}
    if replica is not None:
        markers.add(f"{REPLICA_ENV}={replica}".encode())
    if incarnation is not None:
        markers.add(f"{INCARNATION_ENV}={incarnation}".encode())
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if markers <= set(fh.read().split(b"\0")):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _dropped_incarnation(store, replica: int) -> int | None:
    """The incarnation of ``replica`` the coordinator last removed from an epoch (it may be stopped or hung and
    unable to exit by itself), or None."""
    dropped = read_dropped(store, replica)
    return dropped[0] if dropped else None


@dataclass
class ReplicaSlot:
    """One replica group of the job and its current start (incarnation)."""

    index: int
    restarts_left: int
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    ended_incarnation: int = -1  # the incarnation this launcher already ended after it was dropped
    observer: subprocess.Popen | None = None  # its hang observer ([recover.localize] hang_threshold_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_for_port(address_file: str, proc: subprocess.Popen, name: str, timeout_s: float = 60) -> int | None:
    """The port a child server (coordinator, snapshot keeper) writes to ``address_file`` once it listens; None,
    with a message, if it exited or did not listen within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(address_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            print(f"titan_recover: the {name} did not start", file=sys.stderr)
            return None
        time.sleep(0.05)
    with open(address_file) as fh:
        return int(fh.read())


def cpu_threads_per_process(processes: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, processes))


def launch_replicas(config, toml_path: str | None, overrides: list[str], ranks_per_replica: int,
                    metrics_rank: int) -> int:
    recover = config.recover
    run_dir = os.path.abspath(config.dump_folder)
    os.makedirs(run_dir, exist_ok=True)
    address_file = os.path.join(run_dir, "coordinator.port")
    if os.path.exists(address_file):
        os.remove(address_file)
    base_env = dict(os.environ, **{RUN_DIR_ENV: run_dir, "TORCH_GLOO_LAZY_INIT": "1", "PYTHONUNBUFFERED": "1"})
    base_env.setdefault(JOB_START_ENV, repr(time.time()))  # time-triggered faults count from here
    # torchrun caps a worker's CPU threads only when it starts several; R single-process replicas on one node
    # would each take every core and thrash. Share the cores unless the user chose.
    base_env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_process(recover.groups * ranks_per_replica)))
    coordinator = _spawn(
        [sys.executable, "-m", "titan_recover.recover.groups.coordinator", "--replicas", str(recover.groups),
         "--ranks-per-replica", str(ranks_per_replica), "--run-dir", run_dir, "--host", "127.0.0.1",
         "--port", str(recover.coordinator_port), "--recover-json", json.dumps(asdict(recover)),
         "--address-file", address_file],
        base_env, "[coordinator] ",
    )
    children: list[subprocess.Popen] = [coordinator]
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
        for child in children:
            _signal_group(child, signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        port = wait_for_port(address_file, coordinator, "coordinator")
        if port is None:
            return 1
        address = f"127.0.0.1:{port}"
        groups = recover.groups

        def spawn(slot: ReplicaSlot) -> None:
            env = dict(base_env, **{REPLICA_ENV: str(slot.index), INCARNATION_ENV: str(slot.incarnation),
                                    COORDINATOR_ENV: address, "LOG_RANK": str(metrics_rank)})
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=0",
                   f"--nproc-per-node={ranks_per_replica}", f"--local-ranks-filter={metrics_rank}",
                   "-m", "titan_recover.train", *([toml_path] if toml_path else []), *overrides]
            slot.proc = _spawn(cmd, env, f"[replica {slot.index}] ")
            children.append(slot.proc)
            threshold = recover.localize.hang_threshold_s
            if threshold > 0:  # the replica's hang observer, a process of its own (docs/scout.md)
                if slot.observer is not None and slot.observer.poll() is None:
                    _signal_group(slot.observer, signal.SIGTERM)
                slot.observer = _spawn(
                    [sys.executable, "-m", "titan_recover.recover.scout.observer", "--run-dir", run_dir, "--replica",
                     str(slot.index), "--incarnation", str(slot.incarnation), "--ranks", str(ranks_per_replica),
                     "--threshold-s", str(threshold), *(["--end-hung"] if recover.localize.end_hung else [])],
                    base_env, f"[observer {slot.index}] ")
                children.append(slot.observer)

        store = connect(address, timeout_s=30)
        syncer = None
        if recover.diloco_mode:  # docs/diloco.md: the syncer, restarted from its checkpoint if it crashes
            syncer = ReplicaSlot(-1, recover.diloco.syncer_max_restarts)

            def spawn_syncer() -> None:
                syncer.proc = _spawn(
                    [sys.executable, "-m", "titan_recover.recover.diloco.syncer", "--coordinator", address, "--run-dir",
                     run_dir, "--positions", str(ranks_per_replica), "--start", str(syncer.incarnation),
                     *([toml_path] if toml_path else []), *overrides],
                    dict(base_env, OMP_NUM_THREADS="1"), "[syncer] ")
                children.append(syncer.proc)

            def restart_syncer_if_crashed() -> None:
                if syncer.proc.poll() not in (None, 0) and syncer.restarts_left > 0 and stopping["signal"] is None:
                    syncer.restarts_left -= 1
                    syncer.incarnation += 1
                    print(f"[titan_recover] the syncer exited with {syncer.proc.returncode}: restarting it from its "
                          f"checkpoint (start {syncer.incarnation}, {syncer.restarts_left} restart(s) left)",
                          file=sys.stderr, flush=True)
                    spawn_syncer()

            spawn_syncer()
        slots = [ReplicaSlot(i, recover.max_restarts) for i in range(groups)]
        for slot in slots:
            spawn(slot)
        watching = True  # the coordinator's store can be asked (it lives and has not finished)
        coordinator_ended = None
        while any(slot.running for slot in slots):
            time.sleep(0.1)
            if syncer is not None:
                if syncer.proc.poll() == 0:  # the budget is trained: learners still restarting are not needed
                    break
                restart_syncer_if_crashed()
            if coordinator.poll() is not None:
                # the job is over: members exit by themselves; a restarted group still waiting for admission
                # (or anything stuck) is ended after the grace period
                coordinator_ended = coordinator_ended or time.monotonic()
                if time.monotonic() - coordinator_ended > GRACE_S:
                    break
            if watching and coordinator.poll() is None:
                try:
                    if store.check([GroupKeys.FINISHED]):
                        watching = False  # its store closes soon: stop asking before it does
                    over = not watching or store.check([GroupKeys.STOP])
                    dropped = {slot.index: _dropped_incarnation(store, slot.index) for slot in slots}
                except Exception:
                    watching, over, dropped = False, True, {}
            else:
                watching, over, dropped = False, True, {}
            for slot in slots:
                if slot.running and dropped.get(slot.index) == slot.incarnation != slot.ended_incarnation:
                    # a replica dropped from the job is ended, even if stopped or hung
                    slot.ended_incarnation = slot.incarnation
                    print(f"[titan_recover] replica {slot.index} (start {slot.incarnation}) was dropped from the "
                          "job: ending its processes", file=sys.stderr, flush=True)
                    _signal_group(slot.proc, signal.SIGKILL)
                    _kill_all(processes_of_run(run_dir, replica=slot.index, incarnation=slot.incarnation))
                if (slot.proc.poll() not in (None, 0) and slot.restarts_left > 0 and not over
                        and stopping["signal"] is None):
                    _kill_all(processes_of_run(run_dir, replica=slot.index, incarnation=slot.incarnation))
                    slot.restarts_left -= 1
                    slot.incarnation += 1
                    print(f"[titan_recover] replica {slot.index} exited with {slot.proc.returncode}: restarting it "
                          f"(start {slot.incarnation}, {slot.restarts_left} restart(s) left)", file=sys.stderr,
                          flush=True)
                    spawn(slot)
        codes = [slot.proc.returncode for slot in slots]
        finished = sum(1 for c in codes if c == 0)
        print(f"[titan_recover] replica exit codes {codes}; {finished} of {groups} finished training",
              file=sys.stderr, flush=True)
        if stopping["signal"] is not None:
            return 128 + stopping["signal"]
        if syncer is not None:  # the learners are over: the syncer merges what is left and saves the global model
            if syncer.proc.poll() is None:
                store.set(DilocoKeys.LEARNERS_OVER, "1")
            deadline = time.monotonic() + recover.agree_timeout_s
            while syncer.proc.poll() != 0 and time.monotonic() < deadline:
                restart_syncer_if_crashed()
                if syncer.proc.poll() not in (None, 0) and syncer.restarts_left == 0:
                    break
                time.sleep(0.1)
            print(f"[titan_recover] syncer exit code {syncer.proc.poll()}", file=sys.stderr, flush=True)
            if syncer.proc.poll() != 0:
                return 1
        return 0 if finished >= recover.min_replicas else 1
    finally:
        for child in children:
            if child.poll() is None:
                _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while any(c.poll() is None for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in children:
            _signal_group(child, signal.SIGKILL)
        _kill_all(processes_of_run(run_dir))
        for s, handler in previous.items():
            signal.signal(s, handler)
