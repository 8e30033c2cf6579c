"""Start a replica-group job's processes on one node: the job's store, the coordinator, then one torchrun per
replica group of this node (and, in diloco mode, the syncer).

One launcher per node (docs/deploy.md "Running on many nodes"; ``recover/nodes.py``: which groups a node runs). The
job's store is a TCPStore that node 0's launcher hosts in its own process, or an etcd cluster
(``[recover] store``; ``recover/job_store.py``). Every decision of the protocol lives there, so the coordinator is
a replaceable client that the launcher restarts when it dies or stops beating (``[recover] coordinator_restarts``),
and it resumes from the stored state (docs/replica_groups.md "Coordinator restarts"); node 0 runs it, and with etcd
every node runs one as a standby that takes over when the leading one's lease lapses. Each child runs in its own
session and dies with the launcher (``PR_SET_PDEATHSIG``: a killed launcher leaves no orphan); the launcher
forwards Ctrl-C / SIGTERM / SIGHUP to all of them, kills what is left after a grace period, and finally kills any
process of its node that still carries this run's marker in its environment, so nothing outlives the job (SIGUSR1,
and with ``[recover] preemption_grace_s`` a first SIGTERM, stop the job with a checkpoint instead: docs/deploy.md).
Each child's output goes to its own file under ``<run>/logs/`` (``--verbose``: to the console, prefixed with
``[replica i]``), and node 0's launcher writes the job's one wandb run and a readable console from what the members
log (``job_log.py``). The exit code is the job's verdict, on every node: 0 only when the coordinator saw the
training budget committed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

from torch.distributed import DistError, Store

from titan_recover.process_exit import die_with_parent
from titan_recover.recover.groups.member import (COORDINATOR_ENV, FOUNDING_STEP_ENV, INCARNATION_ENV, REPLICA_ENV,
                                                 RUN_DIR_ENV)
from titan_recover.recover.chaos.config import JOB_START_ENV
from titan_recover.recover.diloco.rules import DilocoKeys, warming
from titan_recover.recover.events import NODE_ENV
from titan_recover.recover.groups.keys import (GroupKeys, newest_published, parse_dropped, raise_fault_flag,
                                             request_checkpoint)
from titan_recover.recover.groups.protocol import CoordinatorState, decode_members, encode_members
from titan_recover.recover.job_store import (agree_config, announce_job, announced_job, await_acks, ConfigMismatch,
                                             host_embedded, join_embedded, new_job_name, NoJobStore, publish_config,
                                             run_segment)
from titan_recover.recover.nodes import (address_towards, agreed_text, groups_outside, is_loopback, node_address,
                                        node_groups, NodeKeys, NodePlan, single_node, unreachable)
from titan_recover.recover.notice import ENDING, NOTICE, NOTICE_FILE_ENV, NoticeFile
from titan_recover.recover.placement import VISIBLE_ENV
from titan_recover.recover.standby import LEADER_TTL_S
from titan_recover.recover.stop_request import CHECKPOINT_SIGNAL, PREEMPTION_SIGNAL, PreemptionNotice
from titan_recover.recover.stores import connect, job_url, parse_store_url, read_keys

GRACE_S = 10.0
NCCL_MONITORING_ENV = "TORCH_NCCL_ENABLE_MONITORING"
"""Off in every process of a replica-group job (:meth:`ReplicaJob._base_env`)."""
NCCL_NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
"""How long NCCL lets a non-blocking communicator's init or abort take: ``collective_timeout_s`` in every process
of a replica-group job unless the user set it. torch reads it once per process, at the first non-blocking call of
any communicator, so it is set before the process starts."""


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.write(prefix + line.decode(errors="replace"))
        sink.flush()
    if sink is not sys.stdout:
        sink.close()


def _spawn(cmd: list[str], env: dict, prefix: str, death_signal: int = signal.SIGKILL,
           log: str | None = None) -> subprocess.Popen:
    """Start a child; its output goes to the console with ``prefix``, or appended to the file ``log``."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent(death_signal))
    sink = sys.stdout
    if log is not None:
        sink = open(log, "a", encoding="utf-8")
        sink.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {proc.pid}: {' '.join(cmd[:6])} ...\n")
        prefix = ""
    threading.Thread(target=_pump, args=(proc.stdout, prefix, sink), daemon=True).start()
    return proc


def processes_of_run(run_dir: str, replica: int | None = None, incarnation: int | None = None,
                     node: int | None = None) -> list[int]:
    """PIDs whose environment carries this run's marker (and the replica's, incarnation's and node's, if given);
    Linux /proc."""
    markers = {f"{RUN_DIR_ENV}={run_dir}".encode()}
    if node is not None:
        markers.add(f"{NODE_ENV}={node}".encode())
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


@dataclass
class ReplicaSlot:
    """One process the launcher starts and restarts (a replica group, the syncer, the coordinator) and its current
    start (incarnation)."""

    index: int
    restarts_left: int
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    ended_incarnation: int = -1  # the incarnation this launcher already ended after it was dropped
    observer: subprocess.Popen | None = None  # its hang observer ([recover.localize] hang_threshold_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def count_restart(self) -> None:
        """The next start: one restart fewer left, one incarnation more (the caller starts it)."""
        self.restarts_left -= 1
        self.incarnation += 1


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal ``proc``'s process group, unless ``proc`` was reaped: its pid, and so its group id, may belong to
    another process by now."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def cpu_threads_per_process(processes: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, processes))


DEPOSED_GRACE_S = 2 * LEADER_TTL_S
"""A candidate that led a role and lost it exits at once (its keepalive's loss of the lease, or a refused write);
one that still runs this long after another took the role (or the lease lapsed) is stopped or stuck, and its
launcher ends it: nothing keeps waiting on it (learners still sending to a stopped syncer's store)."""


class ReplicaJob:
    """The running job of one node: the coordinator (node 0, or a standby on every node with etcd), a slot per
    replica group of this node (and the diloco syncer), their starts and restarts, and the cleanup that leaves no
    process of the run behind."""

    deposed_grace_s = DEPOSED_GRACE_S
    checkpoints_asked = checkpoints_passed_on = 0
    """SIGUSR2s this launcher received, and those it passed on to the job's store (:meth:`on_checkpoint_request`)."""

    def __init__(self, config, toml_path: str | None, overrides: list[str], ranks_per_replica: int,
                 metrics_rank: int, devices: list[list[str]] | None = None, plan: NodePlan | None = None,
                 verbose: bool = False):
        """``devices``: the GPUs of each of this node's replica groups, in order (``recover/placement.py``); None:
        no split (CPU). ``plan``: this node's part of the job (default: one node running every group).
        ``verbose``: every child's full output on the console, prefixed (else each goes to its file under
        ``<run>/logs/`` and the console shows the job's steps and events, :mod:`job_log`)."""
        from titan_recover.config.render import render_toml

        self.recover, self.chaos = config.recover, config.chaos
        self.checkpoint_folder = (os.path.join(os.path.abspath(config.dump_folder), config.checkpoint.folder)
                                  if config.checkpoint.enable else "")
        self.load_verified = bool(getattr(config.checkpoint, "load_verified", False))
        """The checkpoint manager restarts from the newest verified checkpoint: so does a cold restart."""
        self.plan = plan or single_node(config.recover.groups)
        self.devices = None if devices is None else dict(zip(self.plan.groups, devices))
        self.config_text = render_toml(config)
        """The resolved config: node 0 publishes it, the other nodes compare theirs."""
        self.toml_path, self.overrides = toml_path, overrides
        self.ranks, self.metrics_rank = ranks_per_replica, metrics_rank
        self.run_dir = os.path.abspath(config.dump_folder)
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics, self.verbose = config.metrics, verbose
        self.logs = "" if verbose or config.recover.diloco_mode else os.path.join(self.run_dir, "logs")
        """Where each child's output goes, one file per process kind (empty: the console, prefixed: with
        ``--verbose``, and in diloco mode, whose learners have no common step to summarise)."""
        if self.logs:
            os.makedirs(self.logs, exist_ok=True)
        self.job_log = None
        """Node 0: the job's metrics run and console lines (:meth:`start_job_log`)."""
        self.notice = NoticeFile.create() if self.recover.preemption_grace_s > 0 else None  # (recover/notice.py)
        self.base_env = self._base_env()
        self.children: list[subprocess.Popen] = []
        """Every process started, for the signal forwarding and the cleanup."""
        self.stopped_by: int | None = None
        """The signal (Ctrl-C / SIGTERM / SIGHUP) that stops the job, once one came."""
        self.stop_requested: int | None = None
        """The signal (SIGUSR1; SIGTERM with a grace) that asked for a stop with a checkpoint, once one came."""
        self.stop_honoured, self.preemption = False, PreemptionNotice(self.recover.preemption_grace_s)
        self.left_on_notice, self.leaving = False, frozenset()  # (:meth:`leaves_on_notice`)
        self.store: Store | None = None
        """The job's store (:meth:`open_job_store`)."""
        self.address = ""
        """Its URL, as every process of the job opens it: ``HOST:PORT`` of the embedded TCPStore, or the etcd URL of
        this job's keys."""
        self.announcement = None
        """On etcd, node 0: the lease-bound announcement of the job's name under the run folder's prefix."""
        self._leaders: dict[str, str] = {}
        """Each role's leader as this launcher last read it (etcd: the coordinator's and the syncer's keys)."""
        self._deposed: dict[str, tuple[str, float | None]] = {}
        """Each role's candidate of this node that led it last, and since when another leads (None: it leads)."""
        self._seen: dict[str, bytes | None] | None = None
        """The keys one pass of a supervision loop consults, read at its start in one round trip (:meth:`_pass`)."""
        self.coordinator = ReplicaSlot(-1, self.recover.coordinator_restarts)
        self.coordinator_beat = BeatWatch(b"", self.recover.coordinator_timeout_s, self.recover.startup_timeout_s)
        self.slots: list[ReplicaSlot] = []
        self.syncer: ReplicaSlot | None = None
        self.syncer_beat = BeatWatch(b"", self.recover.diloco.syncer_timeout_s, self.recover.startup_timeout_s)
        self.cold_restarted = -1
        """The latest cold restart (its empty epoch) this launcher restarted its groups for."""

    def _base_env(self) -> dict:
        env = dict(os.environ, **{RUN_DIR_ENV: self.run_dir, "TORCH_GLOO_LAZY_INIT": "1", "PYTHONUNBUFFERED": "1",
                                  NODE_ENV: str(self.plan.rank)})
        env.setdefault(JOB_START_ENV, repr(time.time()))  # time-triggered faults count from here (node 0's start)
        if self.notice is not None:
            env[NOTICE_FILE_ENV] = self.notice.path
        # On GPUs: NCCL's heartbeat monitor of a process's first group ends the process minutes after the watchdog of
        # any of its groups saw an error, a fault-tolerant group's included (its abandoned pieces after a peer died);
        # the replica protocol handles those, and the hang observer watches for hung ranks (docs/replica_groups.md)
        env[NCCL_MONITORING_ENV] = "0"
        env.setdefault(NCCL_NONBLOCKING_TIMEOUT_ENV, str(int(max(self.recover.collective_timeout_s, 1))))
        # torchrun caps a worker's CPU threads only when it starts several; R single-process replicas on one node
        # would each take every core and thrash. Share the cores unless the user chose.
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_process(len(self.plan.groups) * self.ranks)))
        return env

    def _start(self, cmd: list[str], env: dict, prefix: str, death_signal: int = signal.SIGKILL,
               log: str = "") -> subprocess.Popen:
        """Start a child; ``log``: the name of its output file under ``<run>/logs/`` (unless verbose)."""
        proc = _spawn(cmd, env, prefix, death_signal, log=self.log_path(log) if self.logs and log else None)
        self.children.append(proc)
        if self.stopped_by is not None:  # a signal came while it was being started: it ends with the others
            _signal_group(proc, signal.SIGTERM)
        return proc

    def _node_log(self, name: str) -> str:
        """The log of a role every node may run (a standby coordinator or syncer on etcd): one file per node in the
        shared run folder (``coordinator_node1``), the plain name on one node."""
        return f"{name}_node{self.plan.rank}" if self.plan.many else name

    def log_path(self, name: str) -> str:
        return os.path.join(self.logs, f"{name}.log")

    def start_job_log(self, toml_path: str | None) -> None:
        """Node 0: the job's one wandb run (``[metrics] enable_wandb``) and, in a synchronous job unless verbose, a
        line per committed step and per resilience event on the console (:mod:`job_log`)."""
        from titan_recover.recover.job_log import ConsoleLines, DilocoJobLog, DilocoWandbRun, JobLog, run_name
        from titan_recover.recover.job_log import WandbRun

        if self.plan.rank != 0:
            return
        diloco = self.recover.diloco_mode
        sinks = [ConsoleLines()] if self.logs else []
        metrics = self.metrics
        if metrics.enable_wandb:
            try:
                sinks.append((DilocoWandbRun if diloco else WandbRun)(
                    run_dir=self.run_dir, project=metrics.wandb_project, mode=metrics.wandb_mode,
                    name=run_name(toml_path, metrics.wandb_run_name, self.run_dir),
                    group=metrics.wandb_group or os.path.basename(self.run_dir),
                    config={"resolved_toml": self.config_text}))
            except Exception as error:  # noqa: BLE001 - the job trains without its wandb run
                print(f"[titan_recover] warning: the job's wandb run could not start ({error}); metrics.jsonl and "
                      "events.jsonl hold everything", file=sys.stderr, flush=True)
        if diloco:  # learners are not in lockstep: every process's output stays on the console
            if sinks:
                self.job_log = DilocoJobLog(self.run_dir, sinks[0]).start()
            return
        if self.logs:
            coordinator = "coordinator_node<r>.log" if self.plan.many else "coordinator.log"
            print(f"[titan_recover] each process's full output: {self.logs}/ (replica_<i>.log, {coordinator}); "
                  "--verbose shows them here", file=sys.stderr, flush=True)
        if sinks:
            self.job_log = JobLog(self.run_dir, sinks).start()

    def close_job_log(self) -> None:
        if self.job_log is not None:
            self.job_log.close()
            self.job_log = None

    def on_signal(self, signum, frame) -> None:
        """Ctrl-C / SIGTERM / SIGHUP: remember it (no restarts from now on) and forward SIGTERM to every child. With a
        preemption grace, the first SIGTERM once the job started is a stop request instead (:meth:`on_stop_request`),
        bounded by :meth:`end_after_grace`."""
        if signum == PREEMPTION_SIGNAL and self.preemption.repeats(time.monotonic()):
            return  # the notice taken a moment ago, come again by another path (srun forwarding it)
        if signum == PREEMPTION_SIGNAL and self.children and self.preemption.take(time.monotonic()):
            self._mark_notice(NOTICE)  # the same SIGTERM, if it reached the children too, is this notice
            self.on_stop_request(signum, frame)  # the loop decides: the whole job stops, or this node leaves
            return
        self.end_children(signum)

    def end_children(self, signum: int) -> None:
        """Remember ``signum`` as the job's end (no restarts from now on) and send every child SIGTERM."""
        self.stopped_by = signum
        self._mark_notice(ENDING)  # the SIGTERM below ends them, even if one took an earlier one for the notice
        for child in self.children:
            _signal_group(child, signal.SIGTERM)

    def _mark_notice(self, state: str) -> None:
        if self.notice is not None:
            self.notice.mark(state)

    # ---- the job's store --------------------------------------------------------------------------------
    def open_job_store(self) -> None:
        """The job's store: hosted here (node 0, embedded), node 0's (other nodes, waiting ``startup_timeout_s``
        at most: NoJobStore), or etcd. Then node 0 publishes its resolved config and start time, and every other
        node checks its own config against it (ConfigMismatch) before anything starts."""
        recover, plan = self.recover, self.plan
        if recover.store:
            self.join_etcd_job()
        elif plan.rank == 0:
            self.host_store()
        else:
            host, port = plan.endpoint
            self.store, self.address = join_embedded(host, port, recover.startup_timeout_s, recover.agree_timeout_s)
        agreed = agreed_text(self.config_text, self.ranks)
        if plan.rank == 0:
            publish_config(self.store, agreed, self.base_env[JOB_START_ENV])
        else:
            self.base_env[JOB_START_ENV] = agree_config(self.store, agreed, recover.startup_timeout_s)
        if plan.many:
            print(f"[titan_recover] {plan.describe()}; the job's store: {self.address}", file=sys.stderr, flush=True)

    def host_store(self) -> None:
        """The job's store, in this process (node 0): it lives as long as the job (the coordinator is only its
        client), at ``--rdzv-endpoint`` on many nodes (listening on every interface), else on
        ``coordinator_port``."""
        host, port = self.plan.endpoint or ("127.0.0.1", self.recover.coordinator_port)
        try:
            self.store, self.address = host_embedded(host, port, self.recover.agree_timeout_s)
        except DistError as error:  # the port is taken (another job, a launcher still ending) or not this host's
            where = "--rdzv-endpoint" if self.plan.endpoint else "recover.coordinator_port"
            raise NoJobStore(f"node 0 could not host the job's store on port {port} ({str(error).splitlines()[0]}): "
                             f"is another job using it? Choose a free port ({where})") from None

    def join_etcd_job(self) -> None:
        """An etcd store: node 0 names the job (the run folder's name, then its start) and announces it while it
        lives; the other nodes read the announcement. Every process opens the job's own prefix."""
        recover, run = self.recover, run_segment(self.run_dir)
        if self.plan.rank == 0:
            job = new_job_name()
            self.announcement = announce_job(recover.store, run, job, recover.agree_timeout_s)
        else:
            job = announced_job(recover.store, run, recover.startup_timeout_s)
        self.address = job_url(recover.store, run, job)
        self.store = connect(self.address, recover.agree_timeout_s)

    # ---- starts ------------------------------------------------------------------------------------------
    @property
    def runs_coordinator(self) -> bool:
        """Node 0 runs the coordinator; with an etcd store every node runs one, as a standby (leader election)."""
        return self.plan.rank == 0 or bool(self.recover.store)

    @property
    def coordinator_identity(self) -> str:
        """How this node's current coordinator start names itself in the leader election (etcd)."""
        return f"{socket.gethostname()}/node{self.plan.rank}/start{self.coordinator.incarnation}"

    def start_coordinator(self) -> None:
        """The coordinator's current start; a restart resumes the state it finds in the store. With an etcd store
        it is a standby until it leads (``--standby``)."""
        recover = self.recover
        standby = ["--standby", "--identity", self.coordinator_identity] if recover.store else []
        self.coordinator.proc = self._start(
            [sys.executable, "-m", "titan_recover.recover.coordinator_process", "--replicas", str(recover.groups),
             "--ranks-per-replica", str(self.ranks), "--run-dir", self.run_dir, "--store", self.address,
             "--recover-json", json.dumps(asdict(recover)), "--chaos-json", json.dumps(asdict(self.chaos)),
             "--checkpoint-folder", self.checkpoint_folder, *(["--load-verified"] if self.load_verified else []),
             *standby],
            self.base_env, "[coordinator] " if not self.plan.many else f"[coordinator node {self.plan.rank}] ",
            log=self._node_log("coordinator"),
        )
        self.coordinator_beat = BeatWatch(self._coordinator_beat(), self.recover.coordinator_timeout_s,
                                          self.recover.startup_timeout_s)

    # ---- reads ---------------------------------------------------------------------------------------------
    def _pass(self) -> None:
        """Start a pass of a supervision loop: the keys its questions read (whether the job is over or stopping, a
        cold restart, each replica's drop, the coordinator's and the syncer's beats and leaders) are read now, in
        one round trip (one transaction on etcd), instead of a request or two for each, ten times a second."""
        keys = [GroupKeys.FINISHED, GroupKeys.STOP, GroupKeys.COLD_RESTART, GroupKeys.COORDINATOR_BEAT,
                *(GroupKeys.dropped(slot.index) for slot in self.slots)]
        if self.recover.store:
            keys.append(GroupKeys.COORDINATOR_LEADER)
        if self.syncer is not None:
            keys += [DilocoKeys.SYNCER_BEAT, *([DilocoKeys.SYNCER_LEADER] if self.recover.store else [])]
        self._seen = dict(zip(keys, read_keys(self.store, keys)))

    def _read(self, key: str) -> bytes | None:
        """``key``'s value (None: absent): as the current pass read it, or from the store."""
        if self._seen is not None and key in self._seen:
            return self._seen[key]
        return read_keys(self.store, [key])[0]

    def _dropped_incarnation(self, replica: int) -> int | None:
        """The incarnation of ``replica`` last removed from the job (by the coordinator from an epoch, by the DiLoCo
        syncer from its learners; it may be stopped or hung and unable to exit by itself), or None."""
        value = self._read(GroupKeys.dropped(replica))
        return None if value is None else parse_dropped(value)[0]

    def _beat_of(self, key: str) -> bytes:
        """A process's beat in the job's store (empty before its first)."""
        return self._read(key) or b""

    def _coordinator_beat(self) -> bytes:
        return self._beat_of(GroupKeys.COORDINATOR_BEAT)

    def _end_if_hung(self, what: str, proc: subprocess.Popen, watch: BeatWatch, beat: bytes, setting: str) -> bool:
        """Kill ``proc`` (named ``what``) if its ``beat`` stayed unchanged longer than ``watch``'s bound (``setting``
        once it beat, ``startup_timeout_s`` before); True if it did."""
        quiet, bound = watch.quiet_s(beat, time.monotonic())
        if quiet <= bound:
            return False
        named = setting if bound == watch.timeout_s else "recover.startup_timeout_s"
        compiling = " while it compiled (its first evaluation)" if warming(beat) else ""
        print(f"[titan_recover] the {what} made no progress for {quiet:.1f} s{compiling} ({named} = {bound}): "
              "ending it", file=sys.stderr, flush=True)
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        return True

    def _leader(self, key: str, identity: str) -> tuple[str, bool]:
        """The identity that leads the role held in ``key`` (etcd; empty while nobody does), and whether it changed
        since this launcher last looked; notes when this node's candidate ``identity``, having led, stopped leading."""
        leader = (self._read(key) or b"").decode()
        changed = leader != self._leaders.get(key, "")
        self._leaders[key] = leader
        if leader == identity:
            self._deposed[key] = (identity, None)
        elif self._deposed.get(key) == (identity, None):
            self._deposed[key] = (identity, time.monotonic())
        return leader, changed

    def _end_if_deposed(self, what: str, proc: subprocess.Popen, key: str, identity: str) -> bool:
        """Kill this node's candidate ``identity`` (named ``what``) if it led the role in ``key``, lost it, and still
        runs ``deposed_grace_s`` later; True if it did."""
        led, since = self._deposed.get(key, ("", None))
        if led != identity or since is None or time.monotonic() - since <= self.deposed_grace_s:
            return False
        print(f"[titan_recover] this node's {what} lost the leadership {time.monotonic() - since:.1f} s ago and still "
              "runs (stopped or stuck): ending it", file=sys.stderr, flush=True)
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        return True

    def coordinator_leads(self) -> bool:
        """Whether this node's coordinator is the one coordinating (always, without standbys). When the leader
        changes, the beat is watched afresh: a new leader is never judged by its predecessor's silence."""
        if not self.recover.store:
            return True
        leader, changed = self._leader(GroupKeys.COORDINATOR_LEADER, self.coordinator_identity)
        if changed:  # held to startup_timeout_s until it beats, as a fresh start
            self.coordinator_beat = BeatWatch(self._coordinator_beat(), self.recover.coordinator_timeout_s,
                                              self.recover.startup_timeout_s)
        return leader == self.coordinator_identity

    def syncer_leads(self) -> bool:
        """Whether this node's syncer is the one serving (always, without standbys); as :meth:`coordinator_leads`."""
        if not self.recover.store:
            return True
        leader, changed = self._leader(DilocoKeys.SYNCER_LEADER, self.syncer_identity)
        if changed:
            self.syncer_beat = BeatWatch(self._syncer_beat(), self.recover.diloco.syncer_timeout_s,
                                         self.recover.startup_timeout_s)
        return leader == self.syncer_identity

    def start_replicas(self) -> None:
        """The syncer (diloco mode: docs/diloco.md), then one torchrun per replica group of this node."""
        if self.runs_syncer:
            self.syncer = ReplicaSlot(-1, self.recover.diloco.syncer_max_restarts)
            self.start_syncer()
        self.slots = [ReplicaSlot(i, self.recover.max_restarts) for i in self.plan.groups]
        for slot in self.slots:
            self.start_replica(slot)

    def start_replica(self, slot: ReplicaSlot, founding_step: int | None = None) -> None:
        """The current start (incarnation) of ``slot``'s torchrun, and its hang observer if localisation asks.
        ``founding_step``: the start founds the epoch after a cold restart and loads this checkpoint step."""
        recover, run_dir, ranks_per_replica, metrics_rank = self.recover, self.run_dir, self.ranks, self.metrics_rank
        toml_path, overrides = self.toml_path, self.overrides
        env = dict(self.base_env, **{REPLICA_ENV: str(slot.index), INCARNATION_ENV: str(slot.incarnation),
                                     COORDINATOR_ENV: self.address, "LOG_RANK": str(metrics_rank)})
        if founding_step is not None:
            env[FOUNDING_STEP_ENV] = str(founding_step)
        if self.devices is not None:  # the group's own GPUs: its local rank r is the r-th of them
            env[VISIBLE_ENV] = ",".join(self.devices[slot.index])
        cmd = [sys.executable, "-m", "titan_recover.torchrun", "--standalone", "--max-restarts=0",
               f"--nproc-per-node={ranks_per_replica}", f"--local-ranks-filter={metrics_rank}",
               "-m", "titan_recover.train", *([toml_path] if toml_path else []), *overrides]
        slot.proc = self._start(cmd, env, f"[replica {slot.index}] ", death_signal=signal.SIGTERM,
                                log=f"replica_{slot.index}")
        threshold = recover.localize.hang_threshold_s
        if threshold > 0:  # the replica's hang observer, a process of its own (docs/scout.md)
            if slot.observer is not None and slot.observer.poll() is None:
                _signal_group(slot.observer, signal.SIGTERM)
            slot.observer = self._start(
                [sys.executable, "-m", "titan_recover.recover.scout.observer", "--run-dir", run_dir, "--replica",
                 str(slot.index), "--incarnation", str(slot.incarnation), "--ranks", str(ranks_per_replica),
                 "--threshold-s", str(threshold), *(["--end-hung"] if recover.localize.end_hung else [])],
                self.base_env, f"[observer {slot.index}] ", log=f"observer_{slot.index}")

    @property
    def runs_syncer(self) -> bool:
        """In diloco mode node 0 runs the syncer; with an etcd store every node runs one, as a standby."""
        return self.recover.diloco_mode and (self.plan.rank == 0 or bool(self.recover.store))

    @property
    def syncer_identity(self) -> str:
        """How this node's current syncer start names itself in the leader election (etcd)."""
        return f"{socket.gethostname()}/node{self.plan.rank}/syncer{self.syncer.incarnation}"

    def syncer_host(self) -> str:
        """The address the learners reach this node's syncer at: on many nodes with the embedded store node 0's,
        the host part of ``--rdzv-endpoint`` (every node reaches it); with etcd this node's address on its route to
        the etcd cluster (``nodes.address_towards``; the host's name where no route is known or the route is a
        loopback one; ``TITAN_RECOVER_NODE_ADDRESS`` wins), since a standby on
        any node may serve."""
        if self.recover.store:
            def towards_the_store() -> str:
                try:
                    found = address_towards(*parse_store_url(self.recover.store).endpoints[0])
                except OSError:
                    return socket.getfqdn()
                return socket.getfqdn() if is_loopback(found) else found  # an etcd on this node, or its gateway

            host = node_address(towards_the_store)
            warning = unreachable("this node's syncer", host) if self.plan.many else None
            if warning:
                print(f"[titan_recover] warning: {warning}", file=sys.stderr, flush=True)
            return host
        return self.plan.endpoint[0] if self.plan.endpoint else "127.0.0.1"

    def start_syncer(self) -> None:
        """The syncer's current start; a restart resumes from its checkpoint. It serves on every interface; its
        port is ``syncer_port`` for node 0's first start, else a free one. With an etcd store it is a standby until
        it leads (``--standby``)."""
        syncer, address, run_dir, ranks_per_replica = self.syncer, self.address, self.run_dir, self.ranks
        toml_path, overrides = self.toml_path, self.overrides
        port = self.recover.diloco.syncer_port if self.plan.rank == 0 and syncer.incarnation == 0 else 0
        standby = ["--standby", "--identity", self.syncer_identity] if self.recover.store else []
        # held to startup_timeout_s until this start beats: a previous start's last beat is no evidence of it
        self.syncer_beat = BeatWatch(self._syncer_beat(), self.recover.diloco.syncer_timeout_s,
                                     self.recover.startup_timeout_s)
        syncer.proc = self._start(
            [sys.executable, "-m", "titan_recover.recover.diloco.syncer", "--coordinator", address, "--run-dir",
             run_dir, "--ranks", str(ranks_per_replica), "--start", str(syncer.incarnation), "--host",
             self.syncer_host(), "--port", str(port), "--nodes", str(self.plan.nnodes), *standby,
             *([toml_path] if toml_path else []), *overrides],
            dict(self.base_env, OMP_NUM_THREADS="1"),
            "[syncer] " if not self.plan.many else f"[syncer node {self.plan.rank}] ", log=self._node_log("syncer"))

    def _syncer_beat(self) -> bytes:
        return self._beat_of(DilocoKeys.SYNCER_BEAT)

    # ---- restarts ----------------------------------------------------------------------------------------
    def supervise_syncer(self) -> None:
        """A syncer whose beat stayed unchanged for ``syncer_timeout_s`` (``startup_timeout_s`` before its first)
        is hung: it is killed, and restarted from its checkpoint while it has restarts left. A standby's beat is
        watched only while it leads (the leading syncer's launcher watches it); one that led, lost the role and
        still runs is ended (it would keep learners that still send to it waiting)."""
        proc = self.syncer.proc
        if proc.poll() is None and self.stopped_by is None:
            if self.syncer_leads():
                self._end_if_hung("syncer", proc, self.syncer_beat, self._syncer_beat(),
                                  "recover.diloco.syncer_timeout_s")
            else:
                self._end_if_deposed("syncer", proc, DilocoKeys.SYNCER_LEADER, self.syncer_identity)
        self.restart_syncer_if_crashed()

    def restart_syncer_if_crashed(self) -> None:
        syncer = self.syncer
        given_up = syncer.ended_incarnation == syncer.incarnation
        if syncer.proc.poll() in (None, 0) or self.stopped_by is not None or given_up:
            return
        if self._read(GroupKeys.FINISHED) is not None:
            return  # the job's end is recorded: nothing left to lead
        if syncer.restarts_left > 0:
            syncer.count_restart()
            again = "as a standby" if self.recover.store else "from its checkpoint"
            print(f"[titan_recover] the syncer exited with {syncer.proc.returncode}: restarting it {again} "
                  f"(start {syncer.incarnation}, {syncer.restarts_left} restart(s) left)", file=sys.stderr, flush=True)
            self.start_syncer()
            return
        syncer.ended_incarnation = syncer.incarnation
        others = "; the other nodes' standby syncers remain" if self.recover.store and self.plan.many else ""
        print(f"[titan_recover] this node's syncer exited with {syncer.proc.returncode} and has no restarts left "
              f"(recover.diloco.syncer_max_restarts = {self.recover.diloco.syncer_max_restarts}){others}",
              file=sys.stderr, flush=True)

    def end_if_dropped(self, slot: ReplicaSlot, dropped: dict[int, int | None]) -> None:
        """A replica dropped from the job is ended, even if stopped or hung."""
        if slot.running and dropped.get(slot.index) == slot.incarnation != slot.ended_incarnation:
            slot.ended_incarnation = slot.incarnation
            print(f"[titan_recover] replica {slot.index} (start {slot.incarnation}) was dropped from the "
                  "job: ending its processes", file=sys.stderr, flush=True)
            _signal_group(slot.proc, signal.SIGKILL)
            _kill_all(processes_of_run(self.run_dir, replica=slot.index, incarnation=slot.incarnation))

    def restartable(self, slot: ReplicaSlot, over: bool) -> bool:
        """A replica group that exited with an error, with restarts left, in a job neither over nor stopping."""
        return slot.proc.poll() not in (None, 0) and slot.restarts_left > 0 and not over and self.stopped_by is None

    def restart_pending(self) -> bool:
        """Some group of this node ended with an error and is to be restarted: the watch goes on for it, even if
        it was the last one running when it ended."""
        over = self.job_over()
        return any(self.restartable(slot, over) for slot in self.slots)

    def restart_if_crashed(self, slot: ReplicaSlot, over: bool) -> None:
        """A replica group that exited with an error is started again while it has restarts left and the job is
        neither over nor stopping; what is left of its previous start is killed first."""
        if self.restartable(slot, over):
            _kill_all(processes_of_run(self.run_dir, replica=slot.index, incarnation=slot.incarnation))
            slot.count_restart()
            where = f"; its output: {self.log_path(f'replica_{slot.index}')}" if self.logs else ""
            print(f"[titan_recover] replica {slot.index} exited with {slot.proc.returncode}: restarting it "
                  f"(start {slot.incarnation}, {slot.restarts_left} restart(s) left){where}", file=sys.stderr,
                  flush=True)
            self.start_replica(slot)

    def supervise_coordinator(self) -> None:
        """A coordinator that exited before the job finished, or stopped beating (hung), is started again while
        it has restarts left; it resumes from the store. Without restarts left the job is stopped: every member
        stops at its next collective with the last committed step (and a durable checkpoint, with
        ``[checkpoint]``), never trains on without anyone to judge failures."""
        slot = self.coordinator
        if slot.proc is None or self.stopped_by is not None or self._read(GroupKeys.FINISHED) is not None:
            return  # no coordinator on this node (another node runs it), or no need for one any more
        code = slot.proc.poll()
        if code is None:
            if self.coordinator_leads():
                ended = self._end_if_hung("coordinator", slot.proc, self.coordinator_beat, self._coordinator_beat(),
                                          "recover.coordinator_timeout_s")
            else:  # a standby: the leading coordinator's launcher watches its beat
                ended = self._end_if_deposed("coordinator", slot.proc, GroupKeys.COORDINATOR_LEADER,
                                             self.coordinator_identity)
            if not ended:
                return
            code = slot.proc.returncode
        if slot.ended_incarnation == slot.incarnation:
            return  # given up already
        if slot.restarts_left > 0:
            slot.count_restart()
            print(f"[titan_recover] the coordinator exited with {code}: restarting it (start {slot.incarnation}, "
                  f"{slot.restarts_left} restart(s) left); it resumes the job's state from the store",
                  file=sys.stderr, flush=True)
            self.start_coordinator()
            return
        slot.ended_incarnation = slot.incarnation
        if self.recover.store and self.plan.many:
            print(f"[titan_recover] this node's coordinator exited with {code} and has no restarts left; the other "
                  "nodes' standby coordinators remain", file=sys.stderr, flush=True)
            return
        reason = (f"the coordinator exited with {code} and has no restarts left (recover.coordinator_restarts = "
                  f"{self.recover.coordinator_restarts}): stopping the job with the last committed step")
        print(f"[titan_recover] {reason}", file=sys.stderr, flush=True)
        self.stop_job(reason)

    def stop_job(self, reason: str, leaving: frozenset[int] = frozenset()) -> None:
        """Stop the job at once with a durable checkpoint of the last committed step (written by the lowest replica
        that committed it), as a coordinator's stop does, whether or not a coordinator runs. Left out of the stop's
        epoch, so that none is chosen to write the checkpoint: the members the coordinator has judged failed (its
        stored state's ``excluded``) and ``leaving``, groups known to be ending (those of other preempted nodes)."""
        self.store.set(GroupKeys.STOP, reason)  # before anything a rank wakes by: it reads the stop with it
        self._seen = None  # the rest of the pass reads the stop
        epoch = newest_published(self.store, int(self.store.get(GroupKeys.EPOCH))
                                 if self.store.check([GroupKeys.EPOCH]) else -1)
        if epoch >= 0:  # members in a collective or a barrier abort it and read the stop
            raise_fault_flag(self.store, epoch, reason)
        # ranks blocked on the next epoch wake by its members and read the stop: a coordinator that runs publishes
        # no epoch after a stop, so this launcher does, with the same members; an epoch a coordinator published
        # meanwhile stays as it was (its ranks read the stop written before it)
        members = decode_members(self.store.get(GroupKeys.members(epoch)))[0] if epoch >= 0 else ()
        state = read_keys(self.store, [GroupKeys.COORDINATOR_STATE])[0]
        failed = set(CoordinatorState.decode(state).excluded) if state is not None else set()
        members = tuple(m for m in members if m not in leaving and m not in failed)
        self.store.compare_set(GroupKeys.members(epoch + 1), "", encode_members(members, reason))

    def on_checkpoint_request(self, _signum, _frame) -> None:
        """SIGUSR2: a durable checkpoint of the next committed step, and the job trains on. Only counted here;
        :meth:`honour_checkpoint_requests` acts from the loop."""
        self.checkpoints_asked += 1

    def honour_checkpoint_requests(self) -> None:
        if self.checkpoints_asked == self.checkpoints_passed_on:
            return
        self.checkpoints_passed_on = self.checkpoints_asked
        name = signal.Signals(CHECKPOINT_SIGNAL).name
        if self.recover.diloco_mode or not self.checkpoint_folder:
            why = ("a diloco job's state is its syncer's checkpoint (recover.diloco.checkpoint_interval_s)"
                   if self.recover.diloco_mode else "[checkpoint] enable = false: there is nowhere to write it")
            print(f"[titan_recover] {name}: {why}; ignored", file=sys.stderr, flush=True)
            return
        if self.job_over():
            return
        request_checkpoint(self.store)
        print(f"[titan_recover] {name} to the launcher of node {self.plan.rank}: a durable checkpoint of the next "
              "committed step asked for; the job trains on", file=sys.stderr, flush=True)

    def on_stop_request(self, signum, _frame) -> None:
        """SIGUSR1 (e.g. SLURM's ``--signal=B:USR1@SECONDS`` before the time limit): stop the job with a durable
        checkpoint of the last committed step. Only remembered here; :meth:`honour_stop_request` acts from the
        loop (a signal handler must not use the store's client, which the loop may be using)."""
        self.stop_requested = signum

    @property
    def holds_the_job(self) -> bool:
        """This node's loss ends the job: it is the only node, or node 0, whose launcher hosts the embedded store."""
        return not self.recover.store and self.plan.rank == 0

    def leaves_on_notice(self) -> bool:
        """At a preemption notice: True if this node's groups leave as a lost node's do and the job trains on
        without them, False if the whole job stops with a checkpoint of its last committed step. The job stops
        where it cannot survive this node's loss (:attr:`holds_the_job`), or where the nodes not preempted (each
        notified node marks itself in the job's store first) run fewer than ``min_replicas`` groups: in a preemption
        of every node, the last to read the marks keeps its groups to write the checkpoint."""
        if self.holds_the_job:
            return False
        self.store.set(GroupKeys.PREEMPTED_PREFIX + str(self.plan.rank), "1")
        nodes = range(self.plan.nnodes)
        marks = read_keys(self.store, [GroupKeys.PREEMPTED_PREFIX + str(n) for n in nodes])
        preempted = {n for n, mark in zip(nodes, marks) if mark is not None}
        self.leaving = frozenset(g for n in preempted - {self.plan.rank}
                                 for g in node_groups(self.recover.groups, self.plan.nnodes, n))
        return groups_outside(preempted, self.recover.groups, self.plan.nnodes) >= self.recover.min_replicas

    def end_after_grace(self) -> None:
        """A preemption notice whose grace is over while the job still runs: end it as SIGTERM does."""
        if self.stopped_by is None and self.preemption.expired(time.monotonic()):
            print(f"[titan_recover] the job did not stop within recover.preemption_grace_s = "
                  f"{self.preemption.grace_s} s of SIGTERM: ending this node's processes without waiting for the "
                  "checkpoint", file=sys.stderr, flush=True)
            self.end_children(PREEMPTION_SIGNAL)

    def honour_stop_request(self) -> None:
        if self.stop_requested is None or self.stop_honoured:
            return
        self.stop_honoured = True
        if self.stop_requested == PREEMPTION_SIGNAL and not self.job_over() and self.leaves_on_notice():
            self.left_on_notice = True  # this node's groups leave as a lost node's do; the others train on
            # with fewer groups and nodes being taken, a durable checkpoint of the next committed step
            request_checkpoint(self.store)
            self.end_children(PREEMPTION_SIGNAL)
            return
        name = signal.Signals(self.stop_requested).name
        if self.recover.diloco_mode:
            print(f"[titan_recover] {name}: a stop with a checkpoint is for the synchronous mode; a diloco job's "
                  "state is its syncer's checkpoint (recover.diloco.checkpoint_interval_s): ignored",
                  file=sys.stderr, flush=True)
            return
        if self.job_over():
            return  # over or stopping already
        to = f"{name} to the launcher of node {self.plan.rank}"
        why = (f"{to}: a preemption notice, recover.preemption_grace_s = {self.preemption.grace_s} s"
               if self.stop_requested == PREEMPTION_SIGNAL else
               f"{to}, e.g. a scheduler's warning before the job's time limit")
        if self.stop_requested == PREEMPTION_SIGNAL and not self.holds_the_job:
            why += "; the nodes not preempted run fewer than recover.min_replicas groups"
        reason = f"stop requested ({why}): stopping the job with a durable checkpoint of the last committed step"
        print(f"[titan_recover] {reason}", file=sys.stderr, flush=True)
        self.store.set(GroupKeys.STOP_SIGNAL, str(self.stop_requested))  # every node exits 128 + it
        self.stop_job(reason, leaving=self.leaving)

    def cold_restart_due(self) -> int | None:
        """The empty epoch of a cold restart this launcher has not yet restarted its groups for, or None."""
        value = self._read(GroupKeys.COLD_RESTART)
        if value is not None and int(value) > self.cold_restarted:
            return int(value)
        return None

    def restart_every_group(self) -> bool:
        """The coordinator lost every replica and restarts the job from the newest durable state: every group of
        this node is started afresh (a start made before, e.g. a joiner that loaded an older checkpoint, is ended
        first), each start counting against its ``max_restarts``, and named in the store as the one that founds
        the next epoch (``-1``: no restarts left). True if any group was started."""
        cold = self.cold_restart_due()
        if cold is None or self.stopped_by is not None:
            return False
        self.cold_restarted = cold
        step = self._read(GroupKeys.founding_step(cold))  # the coordinator wrote it before the cold restart
        if step is None:  # collected: the epoch after it was founded and committed without this node's groups
            return False
        step, started = int(step), False
        for slot in self.slots:
            if slot.proc is not None:
                _signal_group(slot.proc, signal.SIGKILL)
                _kill_all(processes_of_run(self.run_dir, replica=slot.index, incarnation=slot.incarnation))
            if slot.restarts_left == 0:
                self.store.set(GroupKeys.founding(cold, slot.index), "-1")
                continue
            slot.count_restart()
            self.store.set(GroupKeys.founding(cold, slot.index), str(slot.incarnation))  # before it can look
            print(f"[titan_recover] every replica was lost: restarting replica {slot.index} from the checkpoint of "
                  f"step {step} (start {slot.incarnation}, {slot.restarts_left} restart(s) left)", file=sys.stderr,
                  flush=True)
            self.start_replica(slot, founding_step=step)
            started = True
        return started

    def job_state(self) -> tuple[bool, dict[int, int | None]]:
        """What the job's store says: (the job is over or stopping, so nothing is restarted; replica -> its
        incarnation last dropped)."""
        return self.job_over(), {slot.index: self._dropped_incarnation(slot.index) for slot in self.slots}

    def job_over(self) -> bool:
        """The job is over or stopping (nothing is restarted)."""
        return self._read(GroupKeys.FINISHED) is not None or self._read(GroupKeys.STOP) is not None

    def watch(self) -> None:
        """Until every replica group has ended: keep a coordinator running, end dropped replicas, restart crashed
        ones (and the syncer). Ends early once the syncer finished (learners still restarting are not needed)."""
        try:
            while self._watch_pass():
                time.sleep(0.1)
        finally:
            self._seen = None  # reads after the loop go to the store
        if self.await_verdict():
            self.watch()  # every group was restarted meanwhile (a cold restart)

    def _watch_pass(self) -> bool:
        """One pass of :meth:`watch`; False once the watch is over."""
        self._pass()
        if not (any(slot.running for slot in self.slots) or self.restart_every_group() or self.restart_pending()):
            return False
        if self.syncer is not None:
            if self.syncer_done():  # the job ended (the budget trained, or no learner left)
                return False
            self.supervise_syncer()
        self.honour_stop_request()
        self.honour_checkpoint_requests()
        self.end_after_grace()
        self.supervise_coordinator()
        self.restart_every_group()
        over, dropped = self.job_state()
        for slot in self.slots:
            self.end_if_dropped(slot, dropped)
            self.restart_if_crashed(slot, over)
        return True

    def await_verdict(self) -> bool:
        """The replica groups ended: wait (``agree_timeout_s`` at most) for the coordinator to record the job's
        verdict, keeping one running (a restarted coordinator may still be starting when the last step ends).
        True if a cold restart started groups again meanwhile (the job goes on)."""
        if self.syncer is not None or self.stopped_by is not None:
            return False
        if self.recover.diloco_mode:  # another node's syncer ends the job once every node's learners ended
            self.store.set(DilocoKeys.learners_over(self.plan.rank), "1")
        if self.plan.many:
            return self.await_job_verdict()
        deadline = time.monotonic() + self.recover.agree_timeout_s
        try:
            while True:
                self._pass()
                if self._read(GroupKeys.FINISHED) is not None or time.monotonic() >= deadline:
                    return False
                if self.coordinator.proc.poll() is not None \
                        and self.coordinator.ended_incarnation == self.coordinator.incarnation:
                    return False  # no coordinator left to judge
                self.supervise_coordinator()
                if self.restart_every_group():
                    return True
                time.sleep(0.1)
        finally:
            self._seen = None

    def await_job_verdict(self) -> bool:
        """Many nodes: this node's replica groups ended, but the job may go on on other nodes. Wait for the
        coordinator's verdict as long as some coordinator makes progress (its beat changed within
        ``agree_timeout_s``), keeping this node's coordinator (or standby) running meanwhile. True if a cold
        restart started this node's groups again meanwhile (the job goes on)."""
        slot, timeout = self.coordinator, self.recover.agree_timeout_s
        watch = BeatWatch(b"", timeout, timeout)
        try:
            return self._await_job_verdict(slot, timeout, watch)
        finally:
            self._seen = None

    def _await_job_verdict(self, slot: ReplicaSlot, timeout: float, watch: BeatWatch) -> bool:
        while True:
            self._pass()
            if self._read(GroupKeys.FINISHED) is not None or self.stopped_by is not None:
                return False
            self.supervise_coordinator()
            if self.restart_every_group():
                return True
            if slot.proc is not None and slot.proc.poll() is not None and slot.ended_incarnation == slot.incarnation \
                    and not self.recover.store:
                return False  # no coordinator left to judge
            quiet, _ = watch.quiet_s(self._coordinator_beat(), time.monotonic())
            if quiet > timeout:
                print(f"[titan_recover] no coordinator made progress for {timeout} s (recover.agree_timeout_s) "
                      "while this node waited for the job's verdict", file=sys.stderr, flush=True)
                return False
            time.sleep(0.1)

    # ---- the end -----------------------------------------------------------------------------------------
    def result(self) -> int:
        """The job's exit code (once the replica groups ended): 128 + the signal that stopped it; in diloco mode
        1 if the syncer did not save the global model (node 0); otherwise 0 only if the job's verdict in the store
        is ``trained`` (the coordinator saw the training budget committed, every member finished without a stop;
        in diloco mode the syncer counted every block of the budget trained), else 1 with the reason."""
        codes = [slot.proc.returncode for slot in self.slots]
        finished = sum(1 for c in codes if c == 0)
        print(f"[titan_recover] replica exit codes {codes}; {finished} of {len(self.slots)} ended normally",
              file=sys.stderr, flush=True)
        verdict = self._verdict()
        if verdict == "trained" and (self.syncer is None or self.syncer_done()):
            return 0  # the budget was committed before any signal could stop it
        if self.stopped_by is not None:
            print(f"[titan_recover] {self._stopped_by_signal()}", file=sys.stderr, flush=True)
            return 128 + self.stopped_by
        if self.syncer is not None:
            if not self.finish_syncer():
                return 1
            verdict = self._verdict()  # the syncer records the end once it saved the global model
        if verdict == "trained":
            return 0
        if self.recover.diloco_mode:
            why = f"the syncer ended the job: {verdict}" if verdict else "the syncer recorded no end"
            print(f"[titan_recover] the job did not train its budget: {why}", file=sys.stderr, flush=True)
            return 1
        stop = self.store.get(GroupKeys.STOP).decode() if self.store.check([GroupKeys.STOP]) else ""
        print("[titan_recover] the job did not commit its training budget: " +
              (stop or "every replica group ended before the coordinator saw the last step committed"),
              file=sys.stderr, flush=True)
        requested = self.stop_requested or int(self._read(GroupKeys.STOP_SIGNAL) or 0)  # this node's, or another's
        return 128 + requested if requested else 1

    def _stopped_by_signal(self) -> str:
        name = signal.Signals(self.stopped_by).name
        if self.left_on_notice:
            return (f"stopped by {name}, a preemption notice to node {self.plan.rank}, whose loss the job survives: "
                    "its replica groups left the job as a lost node's do, and the other nodes train on")
        hint = (": the terminal or SSH session that ran the launcher closed (run it under nohup, tmux or a "
                "scheduler)" if self.stopped_by == signal.SIGHUP else "")
        return (f"stopped by {name}{hint}; this node's processes were ended without a checkpoint (the job resumes "
                "from its newest one)")

    def _verdict(self) -> str:
        """The job's verdict in its store (``trained``, ``stopped``, ...; empty while none is recorded)."""
        try:
            return self.store.get(GroupKeys.FINISHED).decode() if self.store.check([GroupKeys.FINISHED]) else ""
        except DistError:
            if self.stopped_by is None:
                raise
            return ""  # stopped by a signal, and node 0's store went with its launcher

    def settle_nodes(self, code: int) -> None:
        """Many nodes: every other node acknowledges the verdict it read (its exit code); node 0, whose launcher
        hosts the embedded store, keeps it up until all did, ``agree_timeout_s`` at most."""
        plan = self.plan
        if not plan.many:
            return
        if plan.rank != 0:
            self.store.set(NodeKeys.ack(plan.rank), str(code))
            return
        if self.recover.store or self.stopped_by is not None:
            return  # etcd outlives this launcher; after Ctrl-C / SIGTERM nobody waits
        missing = await_acks(self.store, plan.nnodes, self.recover.agree_timeout_s)
        if missing:
            print(f"[titan_recover] node(s) {', '.join(map(str, missing))} did not acknowledge the job's verdict "
                  f"within {self.recover.agree_timeout_s} s (recover.agree_timeout_s); the job's store closes now",
                  file=sys.stderr, flush=True)

    def finish_syncer(self) -> bool:
        """This node's learners are over: once every node's are, the syncer merges what is left and saves the global
        model (restarted if it crashes, within ``agree_timeout_s``); until then learners of other nodes may still
        train, and the syncer ends the job itself if none is alive for ``startup_timeout_s``. True if it did: this
        node's syncer ended with 0, or, with standby syncers, whichever led recorded the job's end (a syncer
        records it after it saved the global model). With standbys this node keeps its candidate running until
        then, however its own ended, as long as some syncer beats (``agree_timeout_s``)."""
        syncer, nodes, standbys = self.syncer, self.plan.nnodes, bool(self.recover.store)
        if not self.syncer_done():
            self.store.set(DilocoKeys.learners_over(self.plan.rank), "1")
        agree_s = self.recover.agree_timeout_s
        deadline, beats = None, BeatWatch(b"", agree_s, agree_s, warming_s=self.recover.startup_timeout_s)
        over_keys = [DilocoKeys.learners_over(n) for n in range(nodes)]
        try:
            while True:
                self._pass()
                if self.syncer_done() or self.stopped_by is not None:
                    break
                self.supervise_coordinator()
                if deadline is None and None not in read_keys(self.store, over_keys):
                    deadline = time.monotonic() + self.recover.agree_timeout_s
                if deadline is not None and time.monotonic() > deadline:
                    break
                self.supervise_syncer()
                if syncer.proc.poll() not in (None, 0) and syncer.restarts_left == 0 and not standbys:
                    break
                quiet, bound = beats.quiet_s(self._syncer_beat(), time.monotonic()) if standbys else (0.0, 0.0)
                if quiet > bound:
                    named = "agree_timeout_s" if bound == agree_s else "startup_timeout_s: it was compiling"
                    print(f"[titan_recover] no syncer made progress for {bound} s (recover.{named}) while this node "
                          "waited for the job's end", file=sys.stderr, flush=True)
                    break
                time.sleep(0.1)
        finally:
            self._seen = None
        print(f"[titan_recover] syncer exit code {syncer.proc.poll()}", file=sys.stderr, flush=True)
        return self.syncer_done()

    def syncer_done(self) -> bool:
        """This node's syncer ended the job (exit 0), or, with standbys (etcd), any syncer recorded its end."""
        return self.syncer.proc.poll() == 0 or (bool(self.recover.store) and self._read(GroupKeys.FINISHED) is not None)

    def cleanup(self) -> None:
        """SIGTERM to every child still running, SIGKILL after GRACE_S, then any process carrying the run's
        marker."""
        self._mark_notice(ENDING)
        for child in self.children:
            if child.poll() is None:
                _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while any(c.poll() is None for c in self.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self.children:
            _signal_group(child, signal.SIGKILL)
        _kill_all(processes_of_run(self.run_dir, node=self.plan.rank))
        if self.notice is not None:
            self.notice.remove()
        if self.announcement is not None:
            self.announcement.resign()


class BeatWatch:
    """How long a process's beat in the store (a value it rewrites while it makes progress) has stayed unchanged,
    on this process's clock, and the bound it is held to: ``timeout_s`` once the process beat, ``start_s`` before
    its first beat (a process start, with its imports, can take much longer than a beat on a loaded node), and
    ``warming_s`` (default ``start_s``) while its beat ends in :data:`~titan_recover.recover.diloco.rules.WARMING`
    (a first compile follows it)."""

    def __init__(self, before_start: bytes, timeout_s: float, start_s: float, warming_s: float | None = None):
        self._first = before_start
        """The beat's value when the process was started (a previous start's): no evidence of this one."""
        self._value: bytes | None = None
        self._since = 0.0
        self.timeout_s, self.start_s = timeout_s, start_s
        self.warming_s = start_s if warming_s is None else warming_s

    def quiet_s(self, value: bytes, now: float) -> tuple[float, float]:
        """(seconds ``value`` has stayed unchanged, the bound that applies now)."""
        if value != self._value:
            self._value, self._since = value, now
        if value == self._first:
            return now - self._since, self.start_s
        return now - self._since, self.warming_s if warming(value) else self.timeout_s


def launch_replicas(config, toml_path: str | None, overrides: list[str], ranks_per_replica: int,
                    metrics_rank: int, devices: list[list[str]] | None = None, plan: NodePlan | None = None,
                    verbose: bool = False) -> int:
    """Run this node's part of the replica-group job to its end; returns the launcher's exit code
    (:meth:`ReplicaJob.result`: the job's verdict): 2 when this node's config differs from node 0's, 1 when the job's
    store cannot be found or is lost."""
    job = ReplicaJob(config, toml_path, overrides, ranks_per_replica, metrics_rank, devices=devices, plan=plan,
                     verbose=verbose)
    previous = {s: signal.signal(s, job.on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, job.on_stop_request)
    previous[CHECKPOINT_SIGNAL] = signal.signal(CHECKPOINT_SIGNAL, job.on_checkpoint_request)
    try:
        job.open_job_store()
        if job.stopped_by is not None:  # Ctrl-C / SIGTERM / SIGHUP while this node waited for the job's store
            print(f"[titan_recover] stopped by {signal.Signals(job.stopped_by).name} before this node started anything",
                  file=sys.stderr, flush=True)
            return 128 + job.stopped_by
        job.start_job_log(toml_path)
        if job.runs_coordinator:
            job.start_coordinator()
        job.start_replicas()
        job.watch()
        job.close_job_log()  # its last lines (the last step, the final events) before the verdict
        code = job.result()
        job.settle_nodes(code)
        return code
    except ConfigMismatch as e:
        print(f"titan_recover: config error: {e}", file=sys.stderr, flush=True)
        return 2
    except NoJobStore as e:
        print(f"titan_recover: {e}", file=sys.stderr, flush=True)
        return 1
    except DistError as e:
        print(f"titan_recover: the job's store at {job.address} was lost ({str(e).splitlines()[0]}): node 0's "
              "launcher ended or the network failed; ending this node's processes", file=sys.stderr, flush=True)
        return 1
    finally:
        job.close_job_log()
        job.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)
