"""Running replica-group jobs in tests and checking what they did (shared by the multi-process test modules)."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import tempfile
import time

import torch

from conftest import launch, launcher_command, read_metrics, ROOT
from titan_recover.compare import bitwise_equal
from titan_recover.recover.events import read_events
from titan_recover.recover.children import processes_of_run

# join window short to keep tests fast; heartbeat timeout at its default (2 s): shorter ones can misjudge a live
# process that the 2-core machine did not schedule for a second while 5+ processes compete.
FAST_DETECTION = ("--recover.heartbeat_timeout_s", "2.0", "--recover.join_window_s", "0.3")
LOSS = "loss_metrics/global_avg_loss"


def replica_job_args(folder: pathlib.Path, *, replicas: int, ranks: int, steps: int, faults: list[dict],
                     extra: tuple[str, ...] = (), parallelism: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The launcher's arguments for one job of the tiny model: ``replicas`` groups of ``ranks`` processes (FSDP2
    over them unless ``parallelism`` says otherwise), the given chaos faults, every rank's final parameters saved."""
    fault_toml = "[" + ", ".join(
        "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in f.items()) + "}" for f in faults
    ) + "]"
    if parallelism is None:
        parallelism = ("--parallelism.data_parallel_shard_degree", str(ranks))
    return ("train_configs/replicas.toml",
            "--model.flavor", "tiny", "--metrics.no_enable_wandb",
            "--training.steps", str(steps),
            "--recover.replicas", str(replicas),
            *parallelism,
            "--dump_folder", str(folder),
            "--recover.save_final_parameters",
            "--chaos.faults", fault_toml,
            *FAST_DETECTION, *extra)


def run_replicas(folder: pathlib.Path, *, replicas: int, ranks: int, steps: int, faults: list[dict],
                 extra: tuple[str, ...] = (), parallelism: tuple[str, ...] | None = None):
    """One job of the tiny model on one node (:func:`replica_job_args`); returns (the launcher's result, events)."""
    proc = launch(*replica_job_args(folder, replicas=replicas, ranks=ranks, steps=steps, faults=faults, extra=extra,
                                    parallelism=parallelism), timeout=280)
    return proc, read_events(folder / "events.jsonl")


def metrics_by_replica(folder: pathlib.Path) -> dict[int, dict[int, dict]]:
    by_replica: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    for record in read_metrics(folder):
        by_replica[record["replica"]][record["step"]] = record
    return by_replica


def assert_survived(folder, proc, events, *, replicas: int, ranks: int, steps: int, lost: dict[int, int]):
    """The job finished; every fault fired; survivors trained every step with the replicas expected, logged the
    same loss and ended bitwise identical; nothing is left running. ``lost``: replica -> first step it no longer
    contributes to. Returns the injected-fault events."""
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    injected = [e for e in events if e["event"] == "fault_injected"]
    assert len(injected) == len(lost), injected  # every scheduled fault fired
    survivors = sorted(set(range(replicas)) - set(lost))
    by_replica = metrics_by_replica(folder)
    for replica in survivors:
        assert sorted(by_replica[replica]) == list(range(1, steps + 1)), f"replica {replica} missed steps"
        for step, record in by_replica[replica].items():
            alive = sum(1 for r in range(replicas) if r not in lost or step < lost[r])
            assert record["recover/replicas"] == alive, (replica, step, record["recover/replicas"])
        for step in by_replica[replica]:  # every survivor logged the same (cross-replica) loss
            assert by_replica[replica][step][LOSS] == by_replica[survivors[0]][step][LOSS]
    finals = [e for e in events if e["event"] == "final_parameters"]
    assert sorted((e["replica"], e["rank"]) for e in finals) == [(r, k) for r in survivors for k in range(ranks)]
    for rank in range(ranks):
        digests = {e["sha256"] for e in finals if e["rank"] == rank}
        assert len(digests) == 1, f"rank {rank}: replicas differ"  # bitwise identical parameters
    removed = [r for e in events if e["event"] == "epoch_formed" for r in e["removed"]]
    assert sorted(removed) == sorted(lost)
    assert processes_of_run(str(folder)) == []  # nothing left behind
    return injected


def trajectory_deviation(reference: pathlib.Path, run: pathlib.Path, *, replica: int) -> float:
    """Largest relative difference of the logged loss over the steps of ``replica`` in ``run``."""
    ref, got = metrics_by_replica(reference)[0], metrics_by_replica(run)[replica]
    assert sorted(got) == sorted(ref), "the runs did not log the same steps"
    return max(abs(got[s][LOSS] - ref[s][LOSS]) / abs(ref[s][LOSS]) for s in ref)


def final_parameters(folder: pathlib.Path, replica: int, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(folder / "final_parameters" / f"replica{replica}_rank{rank}.pt")


def final_optimizer_state(folder: pathlib.Path, replica: int, rank: int) -> dict:
    """What the rank saved with ``--recover.save_final_parameters`` besides its parameters (final_parameters.py's
    ``optimizer_state``)."""
    return torch.load(folder / "final_optimizer" / f"replica{replica}_rank{rank}.pt")


def assert_same_optimizer_state(reference: pathlib.Path, run: pathlib.Path, *, replica: int, rank: int,
                                steps: int) -> None:
    """The rank's final optimizer state (AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step`` of every parameter,
    every param group's hyperparameters and ``lr``) and learning-rate schedule state (position, base and last
    rates) equal bitwise the reference's replica 0 at the same rank; both took ``steps`` optimizer steps (so
    neither state is empty or stale)."""
    expected, actual = final_optimizer_state(reference, 0, rank), final_optimizer_state(run, replica, rank)
    for state in (expected, actual):
        assert state["optimizer"] and all(float(s["step"]) == steps for s in state["optimizer"].values())
        assert all(s["last_epoch"] == steps for s in state["lr_schedulers"])
    assert expected["optimizer"].keys() == actual["optimizer"].keys()
    for name, value in expected["optimizer"].items():
        assert value.keys() == actual["optimizer"][name].keys(), (replica, rank, name)
        for key in value:
            assert bitwise_equal(actual["optimizer"][name][key], value[key]), (replica, rank, name, key)
    assert bitwise_equal(actual["param_groups"], expected["param_groups"]), (replica, rank, actual["param_groups"])
    assert bitwise_equal(actual["lr_schedulers"], expected["lr_schedulers"]), (replica, rank, actual["lr_schedulers"])


def assert_same_trajectory(reference: pathlib.Path, run: pathlib.Path, *, survivors: list[int], ranks: int,
                           bitwise: bool, rtol: float = 1e-5) -> None:
    """The failure run equals the failure-free reference: the loss at every step and every final parameter, within
    ``rtol`` relative (or bitwise, and then the final optimizer and schedule state too), and the same tokens
    committed at every step."""
    ref = metrics_by_replica(reference)[0]
    for replica in survivors:
        got = metrics_by_replica(run)[replica]
        for step in ref:
            assert got[step]["recover/tokens"] == ref[step]["recover/tokens"], (replica, step)
            assert got[step]["recover/microbatches"] == ref[step]["recover/microbatches"], (replica, step)
            if bitwise:
                assert got[step][LOSS] == ref[step][LOSS], (replica, step, got[step][LOSS], ref[step][LOSS])
        deviation = trajectory_deviation(reference, run, replica=replica)
        assert deviation <= rtol, f"replica {replica}: loss deviates from the reference by {deviation:.3e}"
        for rank in range(ranks):
            expected, actual = final_parameters(reference, 0, rank), final_parameters(run, replica, rank)
            assert expected.keys() == actual.keys()
            for name, value in expected.items():
                if bitwise:
                    assert torch.equal(actual[name], value), (replica, rank, name)
                else:
                    scale = value.abs().max().clamp_min(1e-12)
                    error = float((actual[name] - value).abs().max() / scale)
                    assert error <= rtol, f"replica {replica} rank {rank} {name}: relative error {error:.3e}"
            if bitwise:
                assert_same_optimizer_state(reference, run, replica=replica, rank=rank, steps=len(ref))


def of(events, name, **where):
    return [e for e in events if e["event"] == name and all(e.get(k) == v for k, v in where.items())]


def assert_all_equal_reference(reference, folder, events, replicas):
    """Every replica ended bitwise identical to the reference (1 rank per replica): parameters, optimizer and
    schedule state; every logged loss, token count and running token total equals the reference's at that step (a
    replica that rejoined logged only the steps it trained: its total came with the state it received)."""
    finals = of(events, "final_parameters")
    assert sorted(e["replica"] for e in finals) == list(replicas)
    assert len({e["sha256"] for e in finals}) == 1, "replicas ended with different parameters"
    ref = metrics_by_replica(reference)[0]
    for replica in replicas:
        expected, actual = final_parameters(reference, 0, 0), final_parameters(folder, replica, 0)
        assert expected.keys() == actual.keys()
        assert all(torch.equal(actual[name], value) for name, value in expected.items()), replica
        assert_same_optimizer_state(reference, folder, replica=replica, rank=0, steps=len(ref))
    for replica, logged in metrics_by_replica(folder).items():
        for step, record in logged.items():
            assert record[LOSS] == ref[step][LOSS], (replica, step)
            assert record["recover/tokens"] == ref[step]["recover/tokens"], (replica, step)
            assert record["n_tokens_seen"] == ref[step]["n_tokens_seen"], (replica, step)


def launch_nodes(folder, node_args: list[tuple[str, ...]], timeout: float = 280, while_running=None,
                 command=None) -> list[subprocess.CompletedProcess]:
    """Start one launcher per node (``node_args[i]``: node ``i``'s arguments) at once and wait for all of them; on
    timeout every launcher gets SIGTERM, then SIGKILL, and every process of the run is killed. Their output goes to
    files, not pipes: nothing blocks on a full pipe while another launcher is waited for. ``while_running(procs,
    start)``, if given, is called once they all started (to signal one, say); ``start(args)`` starts one more
    launcher (a node's replacement), appended to ``procs`` and waited for as well. ``command(i, args)``, if given,
    is the command that runs the ``i``-th launcher started (default: :func:`~conftest.launcher_command`)."""
    launcher_command()  # starts the launcher server (named in os.environ) before the environment is copied
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as the one-node reference: bitwise results need equal threads
    deadline = time.monotonic() + timeout
    launched: list[tuple[str, ...]] = []
    outputs: list[tuple] = []
    procs: list[subprocess.Popen] = []

    def read(i: int) -> tuple[str, str]:
        texts = []
        for f in outputs[i]:
            f.seek(0)
            texts.append(f.read())
        return texts[0], texts[1]

    def start(args: tuple[str, ...]) -> subprocess.Popen:
        outputs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
        launched.append(args)
        argv = command(len(procs), args) if command is not None else launcher_command(*args)
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=outputs[-1][0], stderr=outputs[-1][1], text=True))
        return procs[-1]

    try:
        for args in node_args:
            start(args)
        if while_running is not None:
            while_running(procs, start)
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in processes_of_run(str(folder)):
            os.kill(pid, signal.SIGKILL)
        texts = [read(i) for i in range(len(procs))]
        raise AssertionError("launchers timed out:\n" +
                             "\n".join(out[-2000:] + err[-2000:] for out, err in texts)) from None
    results = [subprocess.CompletedProcess(args, proc.returncode, *read(i))
               for i, (args, proc) in enumerate(zip(launched, procs))]
    for out, err in outputs:
        out.close()
        err.close()
    return results


def node_options(nnodes: int, endpoint: str | None = None) -> list[tuple[str, ...]]:
    return [("--nnodes", str(nnodes), "--node-rank", str(rank), *(("--rdzv-endpoint", endpoint) if endpoint else ()))
            for rank in range(nnodes)]
