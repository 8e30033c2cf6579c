"""The DiLoCo syncer's part of a node's launcher (docs/diloco.md): node 0 runs the syncer, and with an etcd store
every node runs one as a standby; it is watched by its beat while it leads, restarted from its checkpoint when it
crashes or hangs, ended when it lost the lead and still runs, and waited for at the job's end while it merges what
is left and saves the global model. Part of :class:`~titan_recover.recover.launcher.ReplicaJob`.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from torch.distributed import Store

from titan_recover.recover.children import BeatWatch, ReplicaSlot
from titan_recover.recover.config import RecoverConfig
from titan_recover.recover.diloco.rules import DilocoKeys
from titan_recover.recover.groups.keys import GroupKeys
from titan_recover.recover.nodes import address_towards, is_loopback, node_address, NodePlan, unreachable
from titan_recover.recover.stores import parse_store_url, read_keys


class SyncerSupervision:
    """The syncer's slot and beat (:meth:`init_syncer`); starts it through the job's ``_start`` with its
    ``base_env``, and reads the store through the job's pass (``_pass``, ``_read``, ``_leader``)."""

    # what it reads of the node's job (ReplicaJob sets these)
    recover: RecoverConfig
    plan: NodePlan
    store: Store | None
    address: str
    run_dir: str
    ranks: int
    toml_path: str | None
    overrides: list[str]
    base_env: dict
    stopped_by: int | None
    _seen: dict | None

    def init_syncer(self) -> None:
        self.syncer: ReplicaSlot | None = None
        """Node 0's syncer in diloco mode, every node's with etcd (:meth:`start_replicas`); None elsewhere."""
        self.syncer_beat = BeatWatch(b"", self.recover.diloco.syncer_timeout_s, self.recover.startup_timeout_s)

    @property
    def runs_syncer(self) -> bool:
        """In diloco mode node 0 runs the syncer; with an etcd store every node runs one, as a standby."""
        return self.recover.diloco_mode and (self.plan.rank == 0 or bool(self.recover.store))

    @property
    def syncer_identity(self) -> str:
        """How this node's current syncer start names itself in the leader election (etcd)."""
        return f"{socket.gethostname()}:{os.getpid()}/node{self.plan.rank}/syncer{self.syncer.incarnation}"

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

    def syncer_leads(self) -> bool:
        """Whether this node's syncer is the one serving (always, without standbys); as :meth:`coordinator_leads`."""
        if not self.recover.store:
            return True
        leader, changed = self._leader(DilocoKeys.SYNCER_LEADER, self.syncer_identity)
        if changed:
            self.syncer_beat = BeatWatch(self._syncer_beat(), self.recover.diloco.syncer_timeout_s,
                                         self.recover.startup_timeout_s)
        return leader == self.syncer_identity

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
