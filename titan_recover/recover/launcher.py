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
import time
from dataclasses import asdict

from torch.distributed import DistError, Store

from titan_recover.recover.children import (BeatWatch, cpu_threads_per_process, kill_all, LAUNCHER_ENV,
                                            processes_of_run, ReplicaSlot, signal_group, spawn)
from titan_recover.recover.groups.member import (COORDINATOR_ENV, FOUNDING_STEP_ENV, INCARNATION_ENV, REPLICA_ENV,
                                                 RUN_DIR_ENV)
from titan_recover.recover.chaos.config import JOB_START_ENV
from titan_recover.recover.diloco.rules import DilocoKeys, warming
from titan_recover.recover.events import NODE_ENV
from titan_recover.recover.groups.keys import GroupKeys, parse_dropped
from titan_recover.recover.job_store import (agree_config, announce_job, announced_job, Announcement, await_acks,
                                             claim_node, ConfigMismatch, host_embedded, join_embedded,
                                             launcher_identity, new_job_name, NodeReplaced, NoJobStore, publish_config,
                                             running_job, run_segment)
from titan_recover.recover.launcher_stop import StopControl
from titan_recover.recover.launcher_syncer import SyncerSupervision
from titan_recover.recover.nodes import agreed_text, NodeKeys, NodePlan, single_node
from titan_recover.recover.notice import ENDING, NOTICE_FILE_ENV, NoticeFile
from titan_recover.recover.placement import VISIBLE_ENV
from titan_recover.recover.standby import LEADER_TTL_S
from titan_recover.recover.stop_request import CHECKPOINT_SIGNAL
from titan_recover.recover.stores import connect, job_url, read_keys

GRACE_S = 10.0
NCCL_MONITORING_ENV = "TORCH_NCCL_ENABLE_MONITORING"
"""Off in every process of a replica-group job (:meth:`ReplicaJob._base_env`)."""
NCCL_NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
"""How long NCCL lets a non-blocking communicator's init or abort take: ``collective_timeout_s`` in every process
of a replica-group job unless the user set it. torch reads it once per process, at the first non-blocking call of
any communicator, so it is set before the process starts."""
NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""In every process of a replica-group job, unless the user set it: torch's own default, ``3``. The nccl
fault-tolerant group builds its communicators with it at ``0`` and puts it back, on its connecting thread
(ftpg/nccl.py); an environment variable that exists is replaced in place, where adding one reallocates the
environment while other threads may read it (torch warns of such a race in ``ProcessGroupNCCL``'s constructor)."""


DEPOSED_GRACE_S = 2 * LEADER_TTL_S
"""A candidate that led a role and lost it exits at once (its keepalive's loss of the lease, or a refused write);
one that still runs this long after another took the role (or the lease lapsed) is stopped or stuck, and its
launcher ends it: nothing keeps waiting on it (learners still sending to a stopped syncer's store)."""


class ReplicaJob(StopControl, SyncerSupervision):
    """The running job of one node: the coordinator (node 0, or a standby on every node with etcd), a slot per
    replica group of this node (and the diloco syncer: :class:`SyncerSupervision`), their starts and restarts, the
    stops the signals ask for (:class:`StopControl`), the job's verdict, and the cleanup that leaves no process of
    the run behind."""

    deposed_grace_s = DEPOSED_GRACE_S

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
        self.init_stops()
        self.store: Store | None = None
        """The job's store (:meth:`open_job_store`)."""
        self.address = ""
        """Its URL, as every process of the job opens it: ``HOST:PORT`` of the embedded TCPStore, or the etcd URL of
        this job's keys."""
        self.announcement = None
        """On etcd: this launcher's hold on the announcement of the job's name under the run folder's prefix."""
        self.node_claim = None
        """On etcd: this launcher's hold on its node's key in the job's store (one launcher per node)."""
        self.store_lost = False
        """The job's store stopped answering: nothing is asked of it any more (held leases lapse by themselves)."""
        self._leaders: dict[str, str] = {}
        """Each role's leader as this launcher last read it (etcd: the coordinator's and the syncer's keys)."""
        self._deposed: dict[str, tuple[str, float | None]] = {}
        """Each role's candidate of this node that led it last, and since when another leads (None: it leads)."""
        self._seen: dict[str, bytes | None] | None = None
        """The keys one pass of a supervision loop consults, read at its start in one round trip (:meth:`_pass`)."""
        self.coordinator = ReplicaSlot(-1, self.recover.coordinator_restarts)
        self.coordinator_beat = BeatWatch(b"", self.recover.coordinator_timeout_s, self.recover.startup_timeout_s)
        self.slots: list[ReplicaSlot] = []
        self.init_syncer()
        self.cold_restarted = -1
        """The latest cold restart (its empty epoch) this launcher restarted its groups for."""

    def _base_env(self) -> dict:
        env = dict(os.environ, **{RUN_DIR_ENV: self.run_dir, "TORCH_GLOO_LAZY_INIT": "1", "PYTHONUNBUFFERED": "1",
                                  NODE_ENV: str(self.plan.rank), LAUNCHER_ENV: str(os.getpid())})
        env.setdefault(JOB_START_ENV, repr(time.time()))  # time-triggered faults count from here (node 0's start)
        if self.notice is not None:
            env[NOTICE_FILE_ENV] = self.notice.path
        # On GPUs: NCCL's heartbeat monitor of a process's first group ends the process minutes after the watchdog of
        # any of its groups saw an error, a fault-tolerant group's included (its abandoned pieces after a peer died);
        # the replica protocol handles those, and the hang observer watches for hung ranks (docs/replica_groups.md)
        env[NCCL_MONITORING_ENV] = "0"
        env.setdefault(NCCL_NONBLOCKING_TIMEOUT_ENV, str(int(max(self.recover.collective_timeout_s, 1))))
        env.setdefault(NCCL_ASYNC_ERROR_HANDLING_ENV, "3")
        # torchrun caps a worker's CPU threads only when it starts several; R single-process replicas on one node
        # would each take every core and thrash. Share the cores unless the user chose.
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_process(len(self.plan.groups) * self.ranks)))
        return env

    def _start(self, cmd: list[str], env: dict, prefix: str, death_signal: int = signal.SIGKILL,
               log: str = "") -> subprocess.Popen:
        """Start a child; ``log``: the name of its output file under ``<run>/logs/`` (unless verbose)."""
        proc = spawn(cmd, env, prefix, death_signal, log=self.log_path(log) if self.logs and log else None)
        self.children.append(proc)
        if self.stopped_by is not None:  # a signal came while it was being started: it ends with the others
            signal_group(proc, signal.SIGTERM)
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

    # ---- the job's store --------------------------------------------------------------------------------
    def open_job_store(self) -> None:
        """The job's store: hosted here (node 0, embedded), node 0's (other nodes, waiting ``startup_timeout_s``
        at most: NoJobStore), or etcd. Then node 0 publishes its resolved config and start time, and every other
        node checks its own config against it (ConfigMismatch) before anything starts."""
        recover, plan = self.recover, self.plan
        joined = plan.rank != 0
        if recover.store:
            joined = self.join_etcd_job()
        elif plan.rank == 0:
            self.host_store()
        else:
            host, port = plan.endpoint
            self.store, self.address = join_embedded(host, port, recover.startup_timeout_s, recover.agree_timeout_s)
        agreed = agreed_text(self.config_text, self.ranks)
        if not joined:
            publish_config(self.store, agreed, self.base_env[JOB_START_ENV])
        else:
            self.base_env[JOB_START_ENV] = agree_config(self.store, agreed, recover.startup_timeout_s)
        if self.owns_node_key and not recover.store:  # once its config agreed (on etcd, claim_node holds it)
            self.store.set(NodeKeys.launcher(plan.rank), launcher_identity())
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

    def join_etcd_job(self) -> bool:
        """An etcd store: node 0 of a new job names it (the run folder's name, then its start) and announces it;
        every other launcher reads the announcement and keeps it alive with the others, so that it lasts while any
        node of the job lives. A node 0 that finds a job running (a replacement of the lost node 0) joins it as
        the other nodes do. Then each holds its node's key. Every process opens the job's own prefix. True if this
        launcher joined a job that node 0 named (it adopts the published config and start)."""
        recover, run = self.recover, run_segment(self.run_dir)
        job = running_job(recover.store, run, recover.agree_timeout_s) if self.plan.rank == 0 else None
        joined = self.plan.rank != 0 or job is not None
        if not joined:
            job = new_job_name()
            self.announcement = announce_job(recover.store, run, job, recover.agree_timeout_s)
        else:
            job = job or announced_job(recover.store, run, recover.startup_timeout_s)
            self.announcement = Announcement(recover.store, run, job, recover.agree_timeout_s).stand_by()
        self.address = job_url(recover.store, run, job)
        self.node_claim = claim_node(self.address, self.plan.rank, recover.agree_timeout_s)
        self.store = connect(self.address, recover.agree_timeout_s)
        return joined

    # ---- starts ------------------------------------------------------------------------------------------
    @property
    def runs_coordinator(self) -> bool:
        """Node 0 runs the coordinator; with an etcd store every node runs one, as a standby (leader election)."""
        return self.plan.rank == 0 or bool(self.recover.store)

    @property
    def coordinator_identity(self) -> str:
        """How this node's current coordinator start names itself in the leader election (etcd)."""
        return f"{socket.gethostname()}:{os.getpid()}/node{self.plan.rank}/start{self.coordinator.incarnation}"

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
        if self.owns_node_key:
            keys.append(NodeKeys.launcher(self.plan.rank))
        self._seen = dict(zip(keys, read_keys(self.store, keys)))
        if self.owns_node_key:
            holder = (self._seen[NodeKeys.launcher(self.plan.rank)] or b"").decode()
            if holder and holder != launcher_identity():
                raise NodeReplaced(f"node {self.plan.rank}'s launcher was replaced by {holder} (this one, "
                                   f"{launcher_identity()}, was stopped or cut off meanwhile): ending this "
                                   "launcher's processes")

    @property
    def owns_node_key(self) -> bool:
        """This launcher names itself in its node's key, and ends if another launcher does (many nodes: on etcd
        every node, held by a lease; on the embedded store every node but 0, which hosts the store)."""
        return self.plan.many and (bool(self.recover.store) or self.plan.rank != 0)

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
        signal_group(proc, signal.SIGKILL)
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
        signal_group(proc, signal.SIGKILL)
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

    def start_replicas(self) -> None:
        """The syncer (diloco mode: docs/diloco.md), then one torchrun per replica group of this node."""
        if self.runs_syncer:
            self.syncer = ReplicaSlot(-1, self.recover.diloco.syncer_max_restarts)
            self.start_syncer()
        self.slots = [ReplicaSlot(i, self.recover.max_restarts) for i in self.plan.groups]
        for slot in self.slots:
            slot.incarnation = self.next_start(slot.index)
            self.start_replica(slot)

    def next_start(self, replica: int) -> int:
        """The incarnation of ``replica``'s next start, taken from the job's counter of its starts: 0 for the job's
        first; a launcher that replaces a lost node's numbers its groups' first starts after the lost ones."""
        return self.store.add(GroupKeys.starts(replica), 1) - 1

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
                signal_group(slot.observer, signal.SIGTERM)
            slot.observer = self._start(
                [sys.executable, "-m", "titan_recover.recover.scout.observer", "--run-dir", run_dir, "--replica",
                 str(slot.index), "--incarnation", str(slot.incarnation), "--ranks", str(ranks_per_replica),
                 "--threshold-s", str(threshold), *(["--end-hung"] if recover.localize.end_hung else [])],
                self.base_env, f"[observer {slot.index}] ", log=f"observer_{slot.index}")

    # ---- restarts ----------------------------------------------------------------------------------------
    def end_if_dropped(self, slot: ReplicaSlot, dropped: dict[int, int | None]) -> None:
        """A replica dropped from the job is ended, even if stopped or hung."""
        if slot.running and dropped.get(slot.index) == slot.incarnation != slot.ended_incarnation:
            slot.ended_incarnation = slot.incarnation
            print(f"[titan_recover] replica {slot.index} (start {slot.incarnation}) was dropped from the "
                  "job: ending its processes", file=sys.stderr, flush=True)
            signal_group(slot.proc, signal.SIGKILL)
            kill_all(processes_of_run(self.run_dir, replica=slot.index, incarnation=slot.incarnation))

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
            kill_all(processes_of_run(self.run_dir, replica=slot.index, incarnation=slot.incarnation))
            slot.count_restart(self.next_start(slot.index))
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
                signal_group(slot.proc, signal.SIGKILL)
                kill_all(processes_of_run(self.run_dir, replica=slot.index, incarnation=slot.incarnation))
            if slot.restarts_left == 0:
                self.store.set(GroupKeys.founding(cold, slot.index), "-1")
                continue
            slot.count_restart(self.next_start(slot.index))
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

    def cleanup(self) -> None:
        """SIGTERM to every child still running, SIGKILL after GRACE_S, then any process carrying the run's
        marker; the leases held on etcd are revoked, unless the store was lost (they lapse by themselves: a revoke
        would wait out a request timeout each)."""
        self._mark_notice(ENDING)
        for child in self.children:
            if child.poll() is None:
                signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while any(c.poll() is None for c in self.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self.children:
            signal_group(child, signal.SIGKILL)
        kill_all(processes_of_run(self.run_dir, node=self.plan.rank, launcher=os.getpid()))
        if self.notice is not None:
            self.notice.remove()
        for held in (self.announcement, self.node_claim):
            if held is not None and not self.store_lost:
                held.resign()


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
    except (NoJobStore, NodeReplaced) as e:
        print(f"titan_recover: {e}", file=sys.stderr, flush=True)
        return 1
    except DistError as e:
        job.store_lost = True
        holder = "the etcd cluster is down" if job.recover.store else "node 0's launcher ended"
        print(f"titan_recover: the job's store at {job.address} was lost ({str(e).splitlines()[0]}): {holder}, or "
              "this host is cut off from it; ending this node's processes", file=sys.stderr, flush=True)
        return 1
    finally:
        job.close_job_log()
        job.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)
