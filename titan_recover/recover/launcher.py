"""Start a replica-group job on one node: the coordinator, then one torchrun per replica group.

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
from dataclasses import asdict

from titan_recover.recover.member import connect, COORDINATOR_ENV, REPLICA_ENV
from titan_recover.recover.protocol import decode_members, Keys
from titan_recover.recover.member import RUN_DIR_ENV

GRACE_S = 10.0


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.write(prefix + line.decode(errors="replace"))
        sink.flush()


def _spawn(cmd: list[str], env: dict, prefix: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    threading.Thread(target=_pump, args=(proc.stdout, prefix, sys.stdout), daemon=True).start()
    return proc


def processes_of_run(run_dir: str, replica: int | None = None) -> list[int]:
    """PIDs whose environment carries this run's marker (and the replica's, if given); Linux /proc."""
    markers = {f"{RUN_DIR_ENV}={run_dir}".encode()}
    if replica is not None:
        markers.add(f"{REPLICA_ENV}={replica}".encode())
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


def _removed_replicas(store) -> set[int]:
    """Replicas left out of the current epoch (they may be stopped or hung and unable to exit by themselves)."""
    if not store.check([Keys.EPOCH]):
        return set()
    epoch = int(store.get(Keys.EPOCH))
    members, _ = decode_members(store.get(Keys.members(epoch)))
    first, _ = decode_members(store.get(Keys.members(0)))
    return set(first) - set(members)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


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
    # torchrun caps a worker's CPU threads only when it starts several; R single-process replicas on one node
    # would each take every core and thrash. Share the cores unless the user chose.
    base_env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_process(recover.replicas * ranks_per_replica)))
    coordinator = _spawn(
        [sys.executable, "-m", "titan_recover.recover.coordinator", "--replicas", str(recover.replicas),
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
        deadline = time.monotonic() + 60
        while not os.path.exists(address_file):
            if coordinator.poll() is not None or time.monotonic() > deadline:
                print("titan_recover: the coordinator did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        with open(address_file) as fh:
            address = f"127.0.0.1:{int(fh.read())}"
        replicas = []
        for i in range(recover.replicas):
            env = dict(base_env, **{REPLICA_ENV: str(i), COORDINATOR_ENV: address, "LOG_RANK": str(metrics_rank)})
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={ranks_per_replica}", f"--local-ranks-filter={metrics_rank}",
                   "-m", "titan_recover.train", *([toml_path] if toml_path else []), *overrides]
            replicas.append(_spawn(cmd, env, f"[replica {i}] "))
        children.extend(replicas)
        store = connect(address, timeout_s=30)
        ended: set[int] = set()
        watching = True
        while any(r.poll() is None for r in replicas):
            time.sleep(0.1)
            if not watching or coordinator.poll() is not None:
                continue  # the coordinator is gone or done: nothing more to learn from it
            try:
                if store.check([Keys.FINISHED]):
                    watching = False  # its store closes soon: stop asking before it does
                    continue
                removed = _removed_replicas(store) - ended
            except Exception:
                removed = set()
            for i in removed:  # a replica dropped from the job is ended, even if stopped or hung
                ended.add(i)
                if replicas[i].poll() is None:
                    print(f"[titan_recover] replica {i} was dropped from the job: ending its processes",
                          file=sys.stderr, flush=True)
                    _signal_group(replicas[i], signal.SIGKILL)
                    _kill_all(processes_of_run(run_dir, replica=i))
        codes = [r.returncode for r in replicas]
        finished = sum(1 for c in codes if c == 0)
        print(f"[titan_recover] replica exit codes {codes}; {finished} of {recover.replicas} finished training",
              file=sys.stderr, flush=True)
        if stopping["signal"] is not None:
            return 128 + stopping["signal"]
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
