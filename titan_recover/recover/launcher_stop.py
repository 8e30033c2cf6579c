"""The signals a node's launcher takes and the stops they lead to (docs/deploy.md, "By hand" and "Preemption"):
Ctrl-C / SIGTERM / SIGHUP end the node's processes; SIGUSR1, and with ``[recover] preemption_grace_s`` a first
SIGTERM (a preemption notice), stop the job with a durable checkpoint of its last committed step, or, on a node
whose loss the job survives, make this node's groups leave; SIGUSR2 asks for a checkpoint while the job trains on.

A handler only records what came (it must not use the store's client, which the supervision loop may be using) or
signals the children; the loop acts on it (``honour_*``). Part of :class:`~titan_recover.recover.launcher.ReplicaJob`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from torch.distributed import Store

from titan_recover.recover.children import signal_group
from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.groups.keys import GroupKeys, newest_published, raise_fault_flag, request_checkpoint
from titan_recover.recover.groups.protocol import CoordinatorState, decode_members, encode_members
from titan_recover.recover.nodes import groups_outside, node_groups, NodePlan
from titan_recover.recover.notice import ENDING, NOTICE, NoticeFile
from titan_recover.recover.stop_request import CHECKPOINT_SIGNAL, PREEMPTION_SIGNAL, PreemptionNotice
from titan_recover.recover.stores import read_keys


class StopControl:
    """The launcher's stops. Owns what the signals left (:meth:`init_stops`); reads the job's ``recover``,
    ``plan``, ``store``, ``notice``, ``children`` and ``checkpoint_folder``, and :meth:`job_over`."""

    # what it reads of the node's job (ReplicaJob sets these)
    recover: RecoverConfig
    plan: NodePlan
    store: Store | None
    notice: NoticeFile | None
    children: list[subprocess.Popen]
    checkpoint_folder: str
    _seen: dict | None
    checkpoints_asked = checkpoints_passed_on = 0
    """SIGUSR2s this launcher received, and those it passed on to the job's store (:meth:`on_checkpoint_request`)."""

    def init_stops(self) -> None:
        self.stopped_by: int | None = None
        """The signal (Ctrl-C / SIGTERM / SIGHUP) that stops the job, once one came."""
        self.stop_requested: int | None = None
        """The signal (SIGUSR1; SIGTERM with a grace) that asked for a stop with a checkpoint, once one came."""
        self.stop_honoured, self.preemption = False, PreemptionNotice(self.recover.preemption_grace_s)
        self.left_on_notice, self.leaving = False, frozenset()  # (:meth:`leaves_on_notice`)

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
            signal_group(child, signal.SIGTERM)

    def _mark_notice(self, state: str) -> None:
        if self.notice is not None:
            self.notice.mark(state)

    def on_stop_request(self, signum, _frame) -> None:
        """SIGUSR1 (e.g. SLURM's ``--signal=B:USR1@SECONDS`` before the time limit): stop the job with a durable
        checkpoint of the last committed step. Only remembered here; :meth:`honour_stop_request` acts from the
        loop (a signal handler must not use the store's client, which the loop may be using)."""
        self.stop_requested = signum

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

    def end_after_grace(self) -> None:
        """A preemption notice whose grace is over while the job still runs: end it as SIGTERM does."""
        if self.stopped_by is None and self.preemption.expired(time.monotonic()):
            print(f"[titan_recover] the job did not stop within recover.preemption_grace_s = "
                  f"{self.preemption.grace_s} s of SIGTERM: ending this node's processes without waiting for the "
                  "checkpoint", file=sys.stderr, flush=True)
            self.end_children(PREEMPTION_SIGNAL)

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

    def _stopped_by_signal(self) -> str:
        name = signal.Signals(self.stopped_by).name
        if self.left_on_notice:
            return (f"stopped by {name}, a preemption notice to node {self.plan.rank}, whose loss the job survives: "
                    "its replica groups left the job as a lost node's do, and the other nodes train on")
        hint = (": the terminal or SSH session that ran the launcher closed (run it under nohup, tmux or a "
                "scheduler)" if self.stopped_by == signal.SIGHUP else "")
        return (f"stopped by {name}{hint}; this node's processes were ended without a checkpoint (the job resumes "
                "from its newest one)")
