#!/usr/bin/env python3
"""Fault soak: under failure schedules drawn at random, does every step still equal the failure-free run, bit for bit?

One failure-free reference job, then ``--seeds`` jobs of the same config, each under its own schedule drawn by this
script's generator (the project only executes it: the chaos monkey fires what it is given, no recovery code chooses
a fault). A schedule is 1 to ``--max-faults`` faults on replicas chosen at random, replica 0 included, one replica
always spared (with none left the state is gone: a job restart from a checkpoint, not what is soaked here); each
fault a kind from ``--kinds`` (kill, hang, raise; ``stall`` with ``--progress-timeout-s``), a step, and a phase
among every phase of a step and ``transfer`` (in the middle of a state transfer to a restarted group, which fires
only where a transfer happens at that step). A second fault on the same replica hits its next start. Hit groups
are restarted (``max_restarts``) and receive the state from a peer's memory; the others hold the next step boundary
for them (``--rejoin-wait-s``, default 150 s, far above a restart here), so that every hit group comes back before
the job ends and later faults can hit it, its rejoin or the transfer. ``--coordinator`` adds a fault of the
coordinator to every schedule (its launcher restarts it and it resumes from the job's store): mid-step, or as it
forms or publishes an epoch after a replica fault. ``--nodes N --node-loss`` runs every job as N launchers (two
launchers on this machine are two nodes, docs/deploy.md "Running on many nodes") and loses one node a job: its
launcher SIGKILLed once a step drawn at random was committed (its groups die with it), a new launcher of the same
node rank started in its place 0-5 s later (its groups rejoin with a peer's state). Any node on an etcd store
(``--store etcd://...``), a node other than 0 on the embedded one (node 0 hosts it); never a node whose loss, with
the replica faults, could leave no replica alive (then the job has no node loss). ``--cut-hosts`` puts every node
on a host of its own (a network namespace, tests/netns.py; root) and loses a node by cutting its host from the
network instead: its launcher lives on and must end by itself (exit 1, saying its store was lost; the job fails
otherwise), and the replacement starts on a spare host.

Every job is in exact mode (float64 accumulation: a step's loss does not depend on which replica computed which
microbatch, docs/invariant.md), so "the same trajectory" is bitwise. A job passes when it exits 0, every step is
logged, every loss any replica logged equals the reference's loss of that step (``==``), and every rank's final
state it saved (parameter shards, optimizer state, learning-rate schedule; a restarted group admitted before the
end saves its own) equals the reference's rank's bit for bit (``compare.bitwise_equal``), and no group spent a
restart on anything but a fault that hit it (no start beyond the group's faults asked to join; a node's loss
counts as a fault of each of its groups).

    python benchmarks/fault_soak.py [--seeds 12] [--first-seed 0] [--replicas 3] [--ranks 1] [--steps 10]
                                    [--max-faults 3] [--kinds kill,hang,raise] [--coordinator] [--rejoin-wait-s 150]
                                    [--progress-timeout-s S] [--nodes N --node-loss [--cut-hosts]]
                                    [--store etcd://HOST:PORT]

Prints one line per job (its schedule, the faults that fired and where, the admissions, the verdict and what
differed) and, last, ``jobs=... passed=... faults=... fired=... admissions=... max_rel_loss_diff=...``. A job that
fails is kept (its folder is printed) and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.compare import bitwise_equal, LOSS  # noqa: E402
from titan_recover.recover.chaos.config import PROCESS_PHASES, STEP_PHASES  # noqa: E402
from titan_recover.recover.events import read_jsonl  # noqa: E402
from titan_recover.recover.nodes import node_groups  # noqa: E402

PHASES = (*STEP_PHASES, "transfer")
ALWAYS = tuple(p for p in STEP_PHASES if p != "rebuild")
"""The phases every step passes (``rebuild`` is passed only right after an epoch change)."""
REJOIN_STEPS = 2
"""Steps between two faults of one replica: its next start is admitted after the step after the fault at the
earliest (the others hold that boundary for it, ``--rejoin-wait-s``), so it trains from two steps after."""
KINDS = ("kill", "hang", "raise")
"""The kinds drawn by default."""
ALL_KINDS = (*KINDS, "stall")
"""``stall`` too (the main thread stuck, the heartbeat alive): found by ``[recover] progress_timeout_s`` only, so it
needs ``--progress-timeout-s`` (the default, 120 s, would make every stalled job last minutes)."""
COORDINATOR_PHASES = PROCESS_PHASES["coordinator"]
"""``step``: mid-step, once every member it watches is there; ``epoch``: about to form an epoch after a fault;
``publish``: between writing an epoch's state ahead and the members reading it (docs/replica_groups.md)."""


def draw_schedule(rng: random.Random, *, replicas: int, ranks: int, steps: int, max_faults: int,
                  kinds: list[str]) -> list[dict]:
    """1 to ``max_faults`` faults on the replicas other than one spared at random; a replica's ``k``-th fault hits
    its ``k``-th start, at least :data:`REJOIN_STEPS` steps after the one before (a start hit at step ``s`` rejoins
    after committing ``s + 1`` at the earliest); a fault that would come after the last step but one is dropped.
    Steps 2 to ``steps - 1``: the first step has no peer state to lose, the last none to carry on with. The first
    fault hits a phase every step passes; later ones any phase, ``rebuild`` and ``transfer`` included, which fire
    only where a recovery is under way at that step."""
    spared = rng.randrange(replicas)
    victims = [r for r in range(replicas) if r != spared]
    drawn = sorted((rng.randint(2, steps - 1), rng.choice(victims), rng.randrange(ranks), rng.choice(kinds))
                   for _ in range(rng.randint(1, max_faults)))
    faults, last = [], {}
    for step, replica, rank, kind in drawn:
        if replica in last:
            step = max(step, last[replica]["step"] + REJOIN_STEPS)
            if step > steps - 1:
                continue
        phase = rng.choice(PHASES if faults else ALWAYS)
        last[replica] = {"kind": kind, "replica": replica, "rank": rank, "step": step, "phase": phase,
                         "incarnation": last[replica]["incarnation"] + 1 if replica in last else 0}
        faults.append(last[replica])
    return sorted(faults, key=lambda f: f["step"])


def draw_coordinator_fault(rng: random.Random, *, steps: int, replica_faults: int, kinds: list[str]) -> dict:
    """One fault of the coordinator's first start (its launcher restarts it, and it resumes from the store): a kind,
    and a phase: ``step`` at a step from 2 to ``steps - 1``, or ``epoch`` / ``publish`` at an epoch from 1 to twice
    the replica faults (each fault forms an epoch and each admission another; it fires only where the job forms one
    that late), so that it lands on the recoveries the replica faults start, mid-way included."""
    phase = rng.choice(COORDINATOR_PHASES)
    step = rng.randint(2, steps - 1) if phase == "step" else rng.randint(1, max(1, 2 * replica_faults))
    return {"kind": rng.choice(kinds), "process": "coordinator", "step": step, "phase": phase, "incarnation": 0}


def draw(seed: int, args) -> list[dict]:
    """The job's schedule for ``seed``: the replica faults (the same with or without ``--coordinator``), then the
    coordinator's fault if asked for."""
    rng = random.Random(seed)
    faults = draw_schedule(rng, replicas=args.replicas, ranks=args.ranks, steps=args.steps,
                           max_faults=args.max_faults, kinds=args.kinds)
    if args.coordinator:
        faults.append(draw_coordinator_fault(rng, steps=args.steps, replica_faults=len(faults), kinds=args.kinds))
    return faults


def draw_node_loss(seed: int, args, faults: list[dict]) -> dict | None:
    """The node a job loses (``--node-loss``), from a generator of its own (the faults stay as they were): a node
    (0 only on an etcd store) whose groups leave some replica that no fault hits on the other nodes; lost once step
    2 to ``steps - 2`` was committed, replaced 0-5 s later. None if no node qualifies."""
    if args.nodes < 2 or not args.node_loss:
        return None
    rng = random.Random(f"{seed}/node")
    unhit = set(range(args.replicas)) - {f["replica"] for f in faults if f.get("process", "trainer") == "trainer"}
    nodes = [n for n in range(0 if args.store else 1, args.nodes)
             if unhit - set(node_groups(args.replicas, args.nodes, n))]
    if not nodes:
        return None
    return {"node": rng.choice(nodes), "after_step": rng.randint(2, args.steps - 2),
            "replace_after_s": round(rng.uniform(0, 5), 1)}


def lost_groups(loss: dict | None, args) -> list[int]:
    return list(node_groups(args.replicas, args.nodes, loss["node"])) if loss else []


def job_args(folder: pathlib.Path, args, faults: list[dict]) -> list[str]:
    fault_toml = "[" + ", ".join("{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in f.items()) + "}"
                                 for f in faults) + "]"
    return [sys.executable, "-m", "titan_recover.launch", "train_configs/replicas.toml",
            "--model.flavor", "tiny", "--metrics.no_enable_wandb", "--training.steps", str(args.steps),
            "--recover.replicas", str(args.replicas), "--parallelism.data_parallel_shard_degree", str(args.ranks),
            "--recover.quota.exact", "--recover.save_final_parameters",
            "--recover.max_restarts", str(args.max_faults), "--recover.heartbeat_timeout_s", "2.0",
            "--recover.join_window_s", "0.3", "--recover.rejoin_wait_s", str(args.rejoin_wait_s),
            "--dump_folder", str(folder), "--chaos.faults", fault_toml,
            *(["--recover.progress_timeout_s", str(args.progress_timeout_s)] if args.progress_timeout_s else []),
            *(["--recover.store", args.store] if args.store else []),
            # a cut host's launcher ends once a request to the job's store went unanswered for its timeout
            *(["--recover.agree_timeout_s", "15", "--recover.collective_timeout_s", "10"] if args.cut_hosts else [])]


def run_job(folder: pathlib.Path, args, faults: list[dict]) -> tuple[int, float, str]:
    """Run one job; (exit code, wall seconds, the end of its output). A job past ``--timeout`` gets SIGTERM (its
    launcher ends its processes), then SIGKILL, and any process of the run left is killed."""
    from titan_recover.recover.children import kill_all, processes_of_run

    start = time.monotonic()
    proc = subprocess.Popen(job_args(folder, args, faults), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        kill_all(processes_of_run(str(folder)))
        return 124, time.monotonic() - start, f"no end after {args.timeout:.0f} s: {output[-2000:]}"
    return proc.returncode, time.monotonic() - start, output[-4000:]


def run_nodes(folder: pathlib.Path, args, faults: list[dict], loss: dict | None,
              hosts=None) -> tuple[int, float, str]:
    """Run one job as ``--nodes`` launchers, losing and replacing ``loss``'s node; (the largest exit code of the
    launchers that were not lost, wall seconds, the end of every launcher's output). Past ``--timeout`` every
    launcher and any process of the run left is killed. With ``hosts`` (``--cut-hosts``: node ``n`` on host ``n``),
    the loss is a cut of the node's host from the network, and the replacement runs on a spare host; the cut
    launcher must end by itself, exit 1, saying its store was lost (else the job's code is 3, saying why)."""
    from titan_recover.recover.children import kill_all, processes_of_run

    folder.mkdir(parents=True, exist_ok=True)
    start, procs, outputs, endpoint = time.monotonic(), {}, [], _endpoint(args, hosts)

    def launch(node: int, name: str, host: int) -> subprocess.Popen:
        outputs.append((name, tempfile.TemporaryFile("w+")))
        argv = [*job_args(folder, args, faults), "--nnodes", str(args.nodes), "--node-rank", str(node), *endpoint]
        return subprocess.Popen(hosts.command(host, argv) if hosts else argv, cwd=ROOT, stdout=outputs[-1][1],
                                stderr=subprocess.STDOUT, text=True)

    for node in range(args.nodes):
        procs[f"node {node}"] = launch(node, f"node {node}", node)
    deadline, cut = start + args.timeout, None
    if loss is not None and _committed(folder, loss["after_step"], procs.values(), deadline):
        cut = _lose(procs.pop(f"node {loss['node']}"), loss["node"], hosts)
        time.sleep(loss["replace_after_s"])
        name = f"node {loss['node']} (replacement)"
        procs[name] = launch(loss["node"], name, args.nodes)
    codes = [_wait(proc, deadline) for proc in procs.values()]
    cut_code = _wait(cut, deadline) if cut is not None else None
    if cut is not None:
        hosts.heal(loss["node"])  # for the next job
    if 124 in codes or cut_code == 124:
        for proc in [*procs.values(), *([cut] if cut is not None else [])]:
            proc.kill()
        kill_all(processes_of_run(str(folder)))
    text = ""
    for name, out in outputs:
        out.seek(0)
        said = out.read()
        if cut_code is not None and name == f"node {loss['node']}" and (cut_code != 1 or "was lost" not in said):
            codes.append(3)
            text += f"--- the cut launcher ended with exit {cut_code}, not 1 saying its store was lost\n"
        text += f"--- {name}\n{said[-1500:]}"
        out.close()
    return max(codes), time.monotonic() - start, text


def _endpoint(args, hosts) -> list[str]:
    """``--rdzv-endpoint`` of the embedded store (node 0's host's address with ``--cut-hosts``), or none (etcd)."""
    if args.store:
        return []
    if hosts is not None:
        return ["--rdzv-endpoint", f"{hosts.address(0)}:29500"]  # a fresh network namespace: every port is free
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return ["--rdzv-endpoint", f"127.0.0.1:{s.getsockname()[1]}"]


def _lose(proc: subprocess.Popen, node: int, hosts) -> subprocess.Popen | None:
    """Lose a node: cut its host from the network (its launcher lives on, to end by itself: returned), or SIGKILL
    its launcher (None)."""
    if hosts is not None:
        hosts.cut(node)
        return proc
    proc.kill()
    proc.wait()
    return None


def _wait(proc: subprocess.Popen, deadline: float) -> int:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return 124


def _committed(folder: pathlib.Path, step: int, procs, deadline: float) -> bool:
    """Wait until ``step`` was committed (True), or a launcher ended or the deadline passed first (False)."""
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if any(e["event"] == "step_committed" and e["step"] >= step for e in read_jsonl(folder / "events.jsonl")):
            return True
        time.sleep(0.1)
    return False


def losses(folder: pathlib.Path) -> list[tuple[int, int, float]]:
    """(replica, step, loss) of every metrics line that has a loss."""
    return [(r["replica"], int(r["step"]), float(r[LOSS])) for r in read_jsonl(folder / "metrics.jsonl")
            if LOSS in r]


def final_state(folder: pathlib.Path) -> dict[str, dict]:
    """Each rank's saved final state by file name (``replica<i>_rank<k>.pt``): its parameter shards
    (``final_parameters/``) and its optimizer and learning-rate schedule state (``final_optimizer/``)."""
    import torch

    return {f.name: {"parameters": torch.load(f), "optimizer": torch.load(folder / "final_optimizer" / f.name)}
            for f in sorted((folder / "final_parameters").glob("*.pt"))}


def judge(folder: pathlib.Path, reference: dict[int, float], reference_state: dict[str, dict],
          steps: int) -> tuple[list[str], float, int]:
    """What differs from the reference (empty: the job kept the trajectory bitwise), the largest relative loss
    difference, and how many ranks' final states were compared."""
    problems = []
    logged = losses(folder)
    if sorted({step for _, step, _ in logged}) != list(range(1, steps + 1)):
        problems.append(f"steps logged {sorted({step for _, step, _ in logged})}")
    wrong = [(r, s, v) for r, s, v in logged if v != reference.get(s)]
    max_rel = max((abs(v - reference[s]) / abs(reference[s]) for _, s, v in wrong if s in reference), default=0.0)
    if wrong:
        problems.append(f"{len(wrong)} losses differ (first: replica {wrong[0][0]} step {wrong[0][1]})")
    state = final_state(folder)
    for name, saved in state.items():
        for part in ("parameters", "optimizer"):
            if not bitwise_equal(saved[part], reference_state.get(name, {}).get(part)):
                problems.append(f"{name}: {part} differ")
    if not state:
        problems.append("no final state saved")
    return problems, max_rel, len(state)


def restarts_beyond_faults(events: list[dict], lost: list[int] = ()) -> list[str]:
    """A group's start that asked to join beyond the faults that hit the group (each fault ends one start, which
    its launcher restarts once; the groups of a lost node, ``lost``, had one more, started by the node's
    replacement): a restart spent on something else, which a job with fewer restarts left would have lost the
    group to. Empty when every start that asked to join followed a fault of its group."""
    fired: dict[int, int] = {replica: 1 for replica in lost}
    for e in events:
        if e["event"] == "fault_injected" and e.get("process", "trainer") == "trainer":
            fired[e["replica"]] = fired.get(e["replica"], 0) + 1
    problems = []
    for replica in sorted({e["replica"] for e in events if e["event"] == "join_requested"}):
        start = max(e["incarnation"] for e in events if e["event"] == "join_requested" and e["replica"] == replica)
        if start > fired.get(replica, 0):
            problems.append(f"replica {replica}: start {start} asked to join after {fired.get(replica, 0)} "
                            f"fault(s) of its group")
    return problems


def describe(faults: list[dict]) -> str:
    return ", ".join(f"{f['kind']} {_where(f)}#{f['incarnation']} s{f['step']} {f['phase']}" for f in faults)


def describe_fired(fired: list[dict]) -> str:
    """The ``fault_injected`` events: what fired where, as the replica (or the coordinator) logged it."""
    return ", ".join(f"{e['kind']} {_where(e)} s{e['step']} {e['phase']}" for e in fired)


def _where(fault: dict) -> str:
    """``r<replica>.<rank>``, or the process a fault of a process that trains nothing hit."""
    process = fault.get("process", "trainer")
    return f"r{fault.get('replica')}.{fault.get('rank')}" if process == "trainer" else process


def summarise(text: str) -> str:
    """The faults that fired in a soak's printed output (its ``fired N [...]`` lists), counted by kind, phase and
    rank, and how often replica 0 was hit and in how many jobs: the figures docs/benchmarks.md quotes."""
    counts: dict[str, dict[str, int]] = {"kind": {}, "phase": {}, "rank": {}}
    replica0 = jobs_with_replica0 = 0
    for line in text.splitlines():
        match = re.search(r"fired \d+ \[(.*?)\], admitted", line)
        if not match:
            continue
        fired = [item.split() for item in match.group(1).split(", ") if item]
        for kind, where, _step, phase in fired:
            for key, value in (("kind", kind), ("phase", phase), ("rank", where.split(".")[-1])):
                counts[key][value] = counts[key].get(value, 0) + 1
        hits = sum(where.startswith("r0.") for _, where, _, _ in fired)
        replica0 += hits
        jobs_with_replica0 += hits > 0
    parts = [" ".join(f"{key}_{value}={n}" for value, n in sorted(counts[key].items())) for key in counts]
    return " ".join(parts) + f" replica0_hits={replica0} jobs_with_replica0_hit={jobs_with_replica0}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="processes per replica group (FSDP2 over them)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-faults", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"fault kinds to draw from, comma-separated, of {', '.join(ALL_KINDS)}")
    parser.add_argument("--progress-timeout-s", type=float, default=None,
                        help="[recover] progress_timeout_s of every job (needed with stall, which only it finds)")
    parser.add_argument("--coordinator", action="store_true",
                        help="also one fault of the coordinator a job (kind from --kinds; after the replica faults "
                             "are drawn, so a seed's replica faults stay the same)")
    parser.add_argument("--rejoin-wait-s", type=float, default=150.0,
                        help="[recover] rejoin_wait_s: the others hold a step boundary this long for a restarted "
                             "group, so that it rejoins (and can be hit again) however slowly this machine starts it")
    parser.add_argument("--nodes", type=int, default=1, help="launchers a job (two on this machine are two nodes)")
    parser.add_argument("--node-loss", action="store_true",
                        help="with --nodes >= 2: lose one node a job (its launcher SIGKILLed) and start a new one")
    parser.add_argument("--store", default="", help="[recover] store (etcd://HOST:PORT): node 0 may be lost too")
    parser.add_argument("--cut-hosts", action="store_true",
                        help="with --node-loss on the embedded store: every node on a host of its own (a network "
                             "namespace, tests/netns.py; needs root); a loss cuts the host from the network instead "
                             "of killing its launcher, which must end by itself; the replacement runs on a spare host")
    parser.add_argument("--summarise", metavar="FILE", help="count what fired in an earlier output; runs nothing")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one job may take")
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    if args.summarise:
        print(summarise(pathlib.Path(args.summarise).read_text()))
        return 0
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(args.kinds) - set(ALL_KINDS))
    if unknown or not args.kinds:
        parser.error(f"--kinds takes some of {', '.join(ALL_KINDS)}, got {args.kinds}")
    if "stall" in args.kinds and not args.progress_timeout_s:
        parser.error("--kinds stall needs --progress-timeout-s (a stalled main thread is found by the progress "
                     "timeout only; the default, 120 s, would make every stalled job last minutes), e.g. 20")
    if args.node_loss and args.nodes < 2:
        parser.error("--node-loss needs --nodes >= 2")
    if args.cut_hosts and (not args.node_loss or args.store):
        parser.error("--cut-hosts needs --node-loss and the embedded store (no --store: etcd would have to listen "
                     "on the hosts' bridge)")
    if args.nodes > args.replicas:
        parser.error(f"--nodes {args.nodes} is more than --replicas {args.replicas}: each group runs on one node")
    if args.replicas < 2 or args.ranks < 1 or args.steps < 3 or args.max_faults < 1 or args.seeds < 1:
        parser.error("need --replicas >= 2 (one is spared), --ranks >= 1, --steps >= 3, --max-faults >= 1 and "
                     "--seeds >= 1")
    with recorded(__file__, argv, args.out):
        if not args.cut_hosts:
            return soak(args)
        sys.path.insert(0, str(ROOT / "tests"))
        from netns import hosts, unavailable  # the tests' hosts on one machine

        why = unavailable()
        if why is not None:
            parser.error(f"--cut-hosts: no network namespaces here: {why}")
        with hosts(args.nodes + 1) as made:  # one host a node, and a spare
            return soak(args, made)


def soak(args, hosts=None) -> int:
    """Run the reference and the jobs (on ``hosts``, with ``--cut-hosts``); print a line each and the headline; 1
    if any job failed."""
    keep = pathlib.Path(tempfile.mkdtemp(prefix="fault_soak."))
    code, wall, output = (run_nodes(keep / "reference", args, [], None, hosts) if args.nodes > 1 else
                          run_job(keep / "reference", args, []))
    if code != 0:
        raise RuntimeError(f"the failure-free reference failed (exit {code}):\n{output}")
    reference = {step: loss for replica, step, loss in losses(keep / "reference") if replica == 0}
    reference_state = final_state(keep / "reference")
    nodes = f" on {args.nodes} nodes" + (" (embedded store)" if not args.store else " (etcd)") if args.nodes > 1 else ""
    nodes += ", each on a host of its own, a loss a cut host" if hosts is not None else ""
    print(f"{args.replicas} replicas x {args.ranks} rank(s){nodes}, tiny, {args.steps} steps, exact mode, max_restarts "
          f"{args.max_faults}; reference {wall:.0f} s, {len(reference_state)} ranks' final states", flush=True)
    totals = {"passed": 0, "faults": 0, "fired": 0, "admissions": 0, "node_losses": 0}
    worst = 0.0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        faults = draw(seed, args)
        loss = draw_node_loss(seed, args, faults)
        folder = keep / f"seed{seed}"
        code, wall, output = (run_nodes(folder, args, faults, loss, hosts) if args.nodes > 1 else
                              run_job(folder, args, faults))
        events = read_jsonl(folder / "events.jsonl") if (folder / "events.jsonl").exists() else []
        fired = [e for e in events if e["event"] == "fault_injected"]
        admitted = [e for e in events if e["event"] == "replica_admitted"]
        problems, max_rel, files = judge(folder, reference, reference_state, args.steps) if code == 0 else (
            [f"exit {code}: {output[-600:]!r}"], float("nan"), 0)
        problems += restarts_beyond_faults(events, lost_groups(loss, args))
        worst = max(worst, max_rel) if max_rel == max_rel else worst
        totals["faults"] += len(faults)
        totals["node_losses"] += loss is not None
        totals["fired"] += len(fired)
        totals["admissions"] += len(admitted)
        totals["passed"] += not problems
        lost = (f", node {loss['node']} {'cut off' if hosts else 'lost'} after s{loss['after_step']} and replaced "
                f"{loss['replace_after_s']} s later" if loss else "")
        print(f"seed {seed:3d} [{describe(faults)}]{lost}: fired {len(fired)} [{describe_fired(fired)}], admitted "
              f"{[(e['replica'], e['after_step']) for e in admitted]}, {files} final states, {wall:.0f} s: "
              + ("bitwise equal" if not problems else "FAILED: " + "; ".join(problems) + f" (kept in {folder})"),
              flush=True)
        if not problems:
            shutil.rmtree(folder, ignore_errors=True)
    jobs = args.seeds
    print(f"jobs={jobs} passed={totals['passed']} faults={totals['faults']} fired={totals['fired']} "
          f"admissions={totals['admissions']} max_rel_loss_diff={worst:.3e}"
          + (f" node_losses={totals['node_losses']}" if args.node_loss else ""))
    if totals["passed"] == jobs:
        shutil.rmtree(keep, ignore_errors=True)
    return 0 if totals["passed"] == jobs else 1


if __name__ == "__main__":
    sys.exit(main())
