"""Shared fixtures. Tests run on CPU with gloo; multi-process tests start real torchrun process trees."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from titan_recover.recover.events import read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]

os.environ.setdefault("TITAN_RECOVER_DEVICE", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
# c10d looks up the name of every peer a TCPStore client or server connects to (a reverse DNS query for
# ::ffff:127.0.0.1, which /etc/hosts does not list), the server on the thread that serves every request. This host's
# DNS server drops about one query in 50 (benchmarks/reverse_lookups.py), and glibc waits 5 s by default: a client's
# connect, or the store, stalls meanwhile. The tests and every process they start ask over TCP: a DNS server that
# answers over TCP drops nothing; this host's does not answer over TCP, the first lookup of a process fails at once,
# and c10d then logs addresses instead of names for the rest of that process (its warning "The hostname of the client
# socket cannot be retrieved", once per process). At most 1 s for a lookup otherwise. docs/deploy.md "Network
# interfaces".
os.environ.setdefault("RES_OPTIONS", "use-vc timeout:1 attempts:1")


@pytest.fixture(scope="session")
def default_data() -> pathlib.Path:
    """The default prepared dataset (built once; ./run_train.sh builds the same folder on first use)."""
    from titan_recover.data.prepare import DEFAULT_DATA_DIR, prepare

    return prepare(str(ROOT / DEFAULT_DATA_DIR))


@pytest.fixture
def launcher(monkeypatch, capsys):
    """``python -m titan_recover.launch ARGS`` in this process: (exit code, stdout, stderr). Starting any process
    (torchrun by exec, or a child) fails the test. Import torch in the test module first: its first import may run
    ldconfig."""
    from titan_recover import launch as launch_module

    def no_process(*args, **kwargs):
        raise AssertionError(f"the launcher started a process: {args[:2]}")

    monkeypatch.setattr(launch_module.os, "execve", no_process)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.chdir(ROOT)

    def run(*argv: str) -> tuple[int, str, str]:
        code = launch_module.main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def read_metrics(folder: pathlib.Path) -> list[dict]:
    """Every record of the run's ``metrics.jsonl``, every node's file of it (node 0's first)."""
    path = folder / "metrics.jsonl"
    assert path.exists(), f"no metrics written to {path}"
    return read_jsonl(path)


def check_layout(output: str, folder, layout: tuple[int, ...], steps: int) -> None:
    """The mesh really had this shape, every step was logged, losses are finite and start near log(vocab)."""
    world, replicate, shard, tp, pp = layout
    expected = f"Layout(world_size={world}, dp_replicate={replicate}, dp_shard={shard}, cp=1, tp={tp}, pp={pp})"
    assert expected in output
    records = read_metrics(folder)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    losses = [r["loss_metrics/global_avg_loss"] for r in records]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(2048)) < 1.5  # an untrained model over a 2048-token vocabulary
    assert all(r["grad_norm"] > 0 for r in records)


def rank_logs(folder: pathlib.Path, tail: int = 3000) -> str:
    """The end of every rank's stderr that a one-node job without replica groups kept off the console
    (launch.rank_log_dir), for a failing test's message."""
    return "".join(f"\n--- {path.relative_to(folder)}:\n{path.read_text(errors='replace')[-tail:]}"
                   for path in sorted(folder.glob("logs/ranks/*/attempt_*/*/stderr.log")))


_zygote: dict = {}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children (Linux /proc): what SLURM's cgroup signals at
    a preemption, whatever session each process runs in (torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop(0))
        todo += children.get(found[-1], [])
    return found


def launcher_command(*args: str) -> list[str]:
    """The command that runs the launcher with ``args``: a client of the session's launcher server, which forks
    a launcher that imported TorchTitan once for the session (tests/launcher_zygote.py: the same ``main``, exit
    code and signals), or ``python -m titan_recover.launch`` with ``TITAN_RECOVER_TEST_ZYGOTE=0``."""
    from launcher_zygote import SOCKET_ENV

    if os.environ.get("TITAN_RECOVER_TEST_ZYGOTE", "1") == "0":
        return [sys.executable, "-m", "titan_recover.launch", *args]
    if not _zygote:
        _start_zygote(SOCKET_ENV)
    if _zygote["server"].poll() is not None:
        _zygote["log"].seek(0)
        raise RuntimeError(f"the tests' launcher server ended (exit {_zygote['server'].poll()}):\n"
                           f"{_zygote['log'].read()[-3000:]}")
    return [sys.executable, str(ROOT / "tests" / "launcher_zygote.py"), "client", *args]


def _start_zygote(socket_env: str) -> None:
    import atexit
    import tempfile

    from titan_recover.process_exit import die_with_parent

    folder = tempfile.mkdtemp(prefix="titan_recover_launcher.")
    path, log = os.path.join(folder, "server.sock"), open(os.path.join(folder, "server.log"), "w+")
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "launcher_zygote.py"), "serve", path], cwd=ROOT,
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                              preexec_fn=die_with_parent(signal.SIGKILL))  # never outlives the session

    def stop() -> None:
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    deadline = time.monotonic() + 180
    while not os.path.exists(path):
        if server.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise RuntimeError(f"the tests' launcher server did not start (exit {server.poll()}):\n"
                               f"{log.read()[-3000:]}")
        time.sleep(0.05)
    os.environ[socket_env] = path  # every client finds it (the tests' environment is theirs)
    _zygote.update(server=server, log=log)


def launch(config: str, *overrides: str, timeout: float = 240, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    """Run the launcher (config checks, then torchrun) as a user would, with a hard timeout.

    On timeout the launcher gets SIGTERM (it ends its children), then SIGKILL; processes of the run that are
    still alive after that are killed too, so a failing test leaves nothing behind.
    """
    cmd = launcher_command(config, *overrides)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        if "--dump_folder" in overrides:
            from titan_recover.recover.children import processes_of_run

            run_dir = os.path.abspath(overrides[list(overrides).index("--dump_folder") + 1])
            for pid in processes_of_run(run_dir):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"launch timed out after {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


EXACT_REFERENCE = {"replicas": 3, "steps": 8}


@pytest.fixture(scope="session")
def exact_reference(tmp_path_factory, default_data) -> pathlib.Path:
    """The failure-free run that several modules compare with, run once: the tiny model, 3 replicas of 1 process,
    8 steps, exact mode, every rank's final parameters, optimizer and schedule state saved."""
    from replica_runs import run_replicas

    folder = tmp_path_factory.mktemp("exact_reference")
    proc, _ = run_replicas(folder, replicas=EXACT_REFERENCE["replicas"], ranks=1, steps=EXACT_REFERENCE["steps"],
                           faults=[], extra=("--recover.quota.exact",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


LAYOUT_STEPS = 6
"""Steps of every layout run compared with the FSDP reference: the same step count, since the learning rate's
decay after the warm-up is spread over ``training.steps``."""
GLOBAL_BATCH = 4
"""Sequences in the global batch of every layout run: debug_model.toml's (FSDP2 over 2 ranks x local batch 2)."""


def same_training(seed_checkpoint: pathlib.Path, data_parallel: int) -> tuple[str, ...]:
    """Overrides that make a layout with ``data_parallel`` data-parallel ranks train what the FSDP reference
    trains: the tiny model, ``LAYOUT_STEPS`` steps, and :func:`same_batches_and_weights`."""
    return ("--model.flavor", "tiny", "--metrics.no_enable_wandb", "--training.steps", str(LAYOUT_STEPS),
            *same_batches_and_weights(seed_checkpoint, data_parallel))


def same_batches_and_weights(seed_checkpoint: pathlib.Path, data_parallel: int) -> tuple[str, ...]:
    """The seed checkpoint's weights and the same global batch (local batch ``GLOBAL_BATCH / data_parallel``; a
    pipeline cuts it into microbatches of 1). Data rank ``r`` of ``d`` reads rows ``[(c * d + r) * b, ... + b)`` at
    its ``c``-th batch (data/loader.py), so every layout's step reads the same rows."""
    if GLOBAL_BATCH % data_parallel:
        raise ValueError(f"{data_parallel} data-parallel ranks cannot share a global batch of {GLOBAL_BATCH}")
    return ("--training.local_batch_size", str(GLOBAL_BATCH // data_parallel),
            "--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path", str(seed_checkpoint))


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory, default_data) -> pathlib.Path:
    """The tiny model initialised once, unsharded, in one process, as TorchTitan's step-0 seed checkpoint
    (``[checkpoint] create_seed_checkpoint``): the weights every layout run starts from. Each layout initialises
    its shards with its own random streams (FSDP2 over 2 and TP over 2 start from different weights), so without
    it the losses of two layouts differ from the first step."""
    folder = tmp_path_factory.mktemp("seed_checkpoint")
    proc = launch("train_configs/debug_model.toml", "--model.flavor", "tiny", "--metrics.no_enable_wandb",
                  "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.enable",
                  "--checkpoint.create_seed_checkpoint", "--dump_folder", str(folder), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step0 = folder / "checkpoint" / "step-0"
    assert (step0 / ".metadata").is_file(), sorted(p.name for p in folder.rglob("*"))
    return step0


def layout_run(tmp_path_factory, seed_checkpoint: pathlib.Path, config: str, data_parallel: int):
    """``train_configs/<config>.toml`` trained as the FSDP reference is (:func:`same_training`), failure-free.
    Returns (folder, console output)."""
    folder = tmp_path_factory.mktemp(f"{config}_run")
    proc = launch(f"train_configs/{config}.toml", *same_training(seed_checkpoint, data_parallel),
                  "--dump_folder", str(folder), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + rank_logs(folder)
    return folder, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory, seed_checkpoint):
    """debug_model.toml (FSDP2 over 2) from the seed checkpoint: the run every layout's losses are compared with.
    Returns (folder, console output)."""
    return layout_run(tmp_path_factory, seed_checkpoint, "debug_model", 2)


@pytest.fixture(scope="session")
def hsdp_reference(tmp_path_factory, seed_checkpoint):
    """train_configs/hsdp.toml (TorchTitan's native HSDP: 2 replicas x FSDP2 over 2) trained as the FSDP reference
    is: the layout test of HSDP and the reference of what replica groups log. Returns (folder, console output)."""
    return layout_run(tmp_path_factory, seed_checkpoint, "hsdp", 4)


@pytest.fixture(scope="session")
def tp_reference(tmp_path_factory, seed_checkpoint):
    """train_configs/tp.toml (TP 2) trained as the FSDP reference is: the layout test of TP and the reference of
    the snapshot refill test. Returns (folder, console output)."""
    return layout_run(tmp_path_factory, seed_checkpoint, "tp", 1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """A one-member etcd cluster for the session (the ``etcd`` binary on PATH: Debian's etcd-server, which
    scripts/test.sh installs where it can), on free ports with a throwaway data dir: yields its ``HOST:PORT``.
    Skips, naming the binary, where there is none."""
    with running_etcd(tmp_path_factory.mktemp("etcd"), "127.0.0.1") as endpoint:
        yield endpoint


@contextlib.contextmanager
def running_etcd(folder: pathlib.Path, host: str):
    """A one-member etcd cluster listening on ``host`` (free ports), its data and log in ``folder``: yields its
    ``HOST:PORT`` once it answers; skips where there is no ``etcd`` binary."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd binary on PATH (Debian: apt-get install etcd-server; scripts/test.sh installs it as root)")
    client, peer = f"http://{host}:{free_port(host)}", f"http://{host}:{free_port(host)}"
    cmd = [binary, "--name", "test", "--data-dir", str(folder / "data"), "--listen-client-urls", client,
           "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
           "--initial-cluster", f"test={peer}", "--logger", "zap", "--log-level", "warn"]
    log = folder / "etcd.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{client}/version", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"etcd did not answer at {client}:\n{log.read_text()[-3000:]}")
                time.sleep(0.05)
        yield client.removeprefix("http://")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
