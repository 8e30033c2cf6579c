"""The coordinator: hosts the run's TCPStore, judges liveness from heartbeats, forms membership epochs.

    python -m titan_recover.recover.groups.coordinator --replicas R --ranks-per-replica W --run-dir DIR [--port P]

One small process per job (started by the launcher, or by hand on the head node of a multi-node job). It decides
nothing about training itself: it raises fault flags for members that stopped beating or progressing, and after
every fault publishes the next epoch's members (see docs/replica_groups.md). It exits when every replica has
finished, when it is told to stop (SIGTERM / SIGINT), or after writing ``stop``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed import TCPStore

from titan_recover.recover.events import EventLog
from titan_recover.recover.groups.keys import fault_time_and_reason, GroupKeys, raise_fault_flag, read_join_requests
from titan_recover.recover.groups.liveness import Heartbeat, LivenessWatch, WatchedTime
from titan_recover.recover.groups.protocol import (
    all_joined,
    decide_members,
    decode_admission,
    encode_admission,
    encode_members,
    ready_to_join,
)

if TYPE_CHECKING:  # the [recover] section composes this package's users: only its type is named here
    from titan_recover.recover.config import RecoverConfig

logger = logging.getLogger("titan_recover.coordinator")

TICK_S = 0.02
FINISH_LINGER_S = 0.5
MAX_LOOK_GAP_S = 0.25
"""Most time one look at the heartbeats counts (the coordinator looks every TICK_S): a longer gap means the
coordinator or its store stalled, and the rest is not held against the members (liveness.LivenessWatch)."""


def describe_beats(beats: dict[int, Heartbeat], ages: dict[int, tuple[float, float] | None], incarnation: int,
                   now: float) -> dict[str, dict]:
    """What the coordinator saw of each rank when it declared a replica failed (for the event log): how long it
    watched the beat and the progress stamp stay unchanged, the beat's own age (``now`` - its timestamp), the step
    and phase it reported, and its incarnation when it is not the member's (a later start of the group beating
    under the same key)."""
    described = {}
    for rank, beat in beats.items():
        record = {"age_s": round(now - beat.time, 3), "step": beat.step, "phase": beat.phase}
        if ages.get(rank) is not None:
            record["quiet_s"], record["still_s"] = (round(a, 3) for a in ages[rank])
        if beat.incarnation != incarnation:
            record["incarnation"] = beat.incarnation
        described[str(rank)] = record
    return described


class Coordinator:
    def __init__(self, config: RecoverConfig, *, replicas: int, ranks_per_replica: int, run_dir: str,
                 host: str = "0.0.0.0", port: int = 0):
        self.config = config
        self.replicas, self.ranks = replicas, ranks_per_replica
        self.run_dir = run_dir
        self.store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=config.agree_timeout_s))
        self.port = self.store.port
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), "coordinator")
        self.epoch = -1
        self.members: tuple[int, ...] = ()
        self.excluded: set[int] = set()
        self.incarnation: dict[int, int] = {}  # the incarnation of each member (a restart is a new one)
        self.dropped: dict[int, int] = {}  # the incarnation of each replica last removed
        self.watch = LivenessWatch(config.heartbeat_timeout_s, config.progress_timeout_s,
                                   max_gap_s=max(MAX_LOOK_GAP_S, 2 * config.heartbeat_interval_s))
        self._terminate = False

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        self._terminate = True

    def run(self) -> int:
        if self.config.mode == "diloco":
            return self._serve_learners()
        if not self._form_first_epoch():
            return 1
        while not self._terminate:
            if self._finished():
                stopped = self.store.check([GroupKeys.STOP])
                self.events.emit("job_finished", epoch=self.epoch, members=list(self.members), stopped=stopped)
                self.store.set(GroupKeys.FINISHED, "1")
                time.sleep(FINISH_LINGER_S)  # let clients that poll the store (the launcher) see it before it closes
                return 1 if stopped else 0
            if not self.store.check([GroupKeys.STOP]):  # after a stop, only keep serving the store to the survivors
                self._watch_liveness()
                if self.store.check([GroupKeys.fault(self.epoch)]):
                    self._form_next_epoch()
                elif self.store.check([GroupKeys.admission(self.epoch)]):
                    self._admit()
            time.sleep(TICK_S)
        return 0

    def _serve_learners(self) -> int:
        """Diloco mode: learners never form epochs; this store is the job's stable meeting point (the syncer's
        address, the data-block counter, heartbeats) until the syncer reports the job finished."""
        while not self._terminate:
            if self.store.check([GroupKeys.FINISHED]):
                self.events.emit("job_finished", mode="diloco")
                time.sleep(FINISH_LINGER_S)
                return 0
            time.sleep(TICK_S * 5)
        return 0

    def _done(self, replica: int, rank: int) -> bool:
        return self.store.check([GroupKeys.done(replica, rank)])

    def _joined(self, epoch: int, replica: int, rank: int) -> bool:
        """The rank joined ``epoch`` (it is alive), or finished training (it is done, not dead)."""
        return self.store.check([GroupKeys.join(epoch, replica, rank)]) or self._done(replica, rank)

    def _finished(self) -> bool:
        return all(self._done(m, r) for m in self.members for r in range(self.ranks))

    # ---- epochs ------------------------------------------------------------------------------------------
    def _registered(self, replica: int) -> bool:
        return all(self.store.check([GroupKeys.register(replica, r)]) for r in range(self.ranks))

    def _registered_incarnation(self, replica: int) -> int:
        return int(self.store.get(GroupKeys.register(replica, 0)).decode().split(",")[3])

    def _form_first_epoch(self) -> bool:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not self._terminate:
            complete = [i for i in range(self.replicas) if self._registered(i)]
            if len(complete) == self.replicas or time.monotonic() > deadline:
                missing = sorted(set(range(self.replicas)) - set(complete))
                reason = "all replicas registered" if not missing else f"replicas {missing} did not register in time"
                self.incarnation = {i: self._registered_incarnation(i) for i in complete}
                return self._publish(0, tuple(complete), tuple(missing), reason, timing={})
            time.sleep(TICK_S)
        return False

    def _watch_liveness(self) -> None:
        watched = [m for m in self.members if m not in self.excluded]
        # a rank that finished training stops beating: it is done, not dead
        keys = [(m, r) for m in watched for r in range(self.ranks) if not self._done(m, r)]
        if not keys:
            return
        raw = self.store.multi_get([GroupKeys.heartbeat(m, r) for m, r in keys])
        now = time.monotonic()  # after the read: what it returned is the store's state at about this time
        beats = {key: Heartbeat.decode(value) for key, value in zip(keys, raw)}
        self.watch.look(now, beats)
        for replica in watched:
            ranks = [r for m, r in keys if m == replica]
            verdict = self.watch.judge(replica, ranks, self.incarnation.get(replica, 0))
            if not verdict.alive:
                self.excluded.add(replica)
                flag = raise_fault_flag(self.store, self.epoch, verdict.reason())
                self.events.emit("failure_detected", epoch=self.epoch, replica=replica, by="coordinator",
                                 reason=verdict.reason(), dead_ranks=list(verdict.dead_ranks),
                                 hung_ranks=list(verdict.hung_ranks), flag=flag,
                                 beats=describe_beats({r: beats[(replica, r)] for r in ranks},
                                                      self.watch.ages(replica, ranks, self.incarnation.get(replica, 0)),
                                                      self.incarnation.get(replica, 0), time.time()),
                                 unwatched_s=round(self.watch.time.unwatched_s, 3))

    def _form_next_epoch(self) -> None:
        fault_time, reason = fault_time_and_reason(self.store.get(GroupKeys.fault(self.epoch)))
        noticed = time.time()
        self.events.emit("fault_flag", epoch=self.epoch, reason=reason, raised_at=fault_time)
        target = self.epoch + 1
        for replica in self.members:  # members that voted a replica out (docs/scout.md)
            if replica not in self.excluded and self.store.check([GroupKeys.evicted(self.epoch, replica)]):
                self.excluded.add(replica)
                self.events.emit("replica_evicted", epoch=self.epoch, replica=replica,
                                 reason=self.store.get(GroupKeys.evicted(self.epoch, replica)).decode())
        candidates = [m for m in self.members if m not in self.excluded]
        window = WatchedTime(self.watch.max_gap_s, time.monotonic())  # a stalled coordinator does not shorten it
        while True:
            joined = {m: {r for r in range(self.ranks) if self._joined(target, m, r)} for m in self.members}
            window.tick(time.monotonic())
            if all_joined(candidates, joined, self.ranks) or window.elapsed_s > self.config.join_window_s:
                break
            time.sleep(0.005)
        decision = decide_members(self.members, joined, self.ranks, excluded=self.excluded)
        self.excluded -= set(decision.removed)
        self._publish(target, decision.members, decision.removed, f"{reason} -> {decision.reason}",
                      timing={"fault_raised_at": fault_time, "coordinator_noticed_at": noticed})

    def _admit(self) -> None:
        """Members committed a step and asked to admit ready joiners: publish the grown epoch (docs/phoenix.md)."""
        step, requested = decode_admission(self.store.get(GroupKeys.admission(self.epoch)))
        requests = {}
        for replica in requested:
            asked = read_join_requests(self.store, replica, self.ranks)
            if asked is not None:
                requests[replica] = asked
        admitted = ready_to_join(self.members, requests, self.ranks, self.dropped)
        for replica in admitted:
            self.incarnation[replica] = requests[replica][0]
            self.events.emit("replica_admitted", epoch=self.epoch + 1, replica=replica, after_step=step,
                             incarnation=self.incarnation[replica])
        withdrawn = sorted(set(requested) - set(admitted))
        reason = f"admitted {list(admitted)} after step {step}" + (f"; {withdrawn} no longer ready" if withdrawn else "")
        self.store.set(GroupKeys.admitted(self.epoch + 1), encode_admission(step, admitted))
        self._publish(self.epoch + 1, tuple(sorted(self.members + admitted)), (), reason, timing={})

    def _publish(self, epoch: int, members: tuple[int, ...], removed: tuple[int, ...], reason: str,
                 timing: dict) -> bool:
        for replica in removed:
            self.dropped[replica] = self.incarnation.get(replica, 0)
            self.watch.forget(replica)
            self.store.set(GroupKeys.dropped(replica), f"{self.dropped[replica]}|{time.time():.6f}")
        self.store.set(GroupKeys.members(epoch), encode_members(members, reason))
        self.epoch, self.members = epoch, members
        too_few = len(members) < self.config.min_replicas
        if too_few:
            message = (f"only {len(members)} replica(s) left {list(members)} after losing {list(removed)}, "
                       f"fewer than recover.min_replicas = {self.config.min_replicas}: stopping")
            self.store.set(GroupKeys.STOP, message)
        self.store.set(GroupKeys.EPOCH, str(epoch))
        self.events.emit("epoch_formed", epoch=epoch, members=list(members), removed=list(removed), reason=reason,
                         **timing)
        if too_few:
            self.events.emit("job_stopped", epoch=epoch, reason=message)
            logger.error(message)
        return not too_few


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--ranks-per-replica", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--recover-json", default="{}", help="the [recover] section as JSON")
    parser.add_argument("--address-file", help="write HOST:PORT here once the store listens")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[coordinator] %(asctime)s %(message)s")
    fields = json.loads(args.recover_json)
    from titan_recover.recover.config import RecoverConfig  # the process entry: the launcher's [recover] section

    config = RecoverConfig.from_dict(fields)
    coordinator = Coordinator(config, replicas=args.replicas, ranks_per_replica=args.ranks_per_replica,
                              run_dir=args.run_dir, host=args.host, port=args.port)
    signal.signal(signal.SIGTERM, coordinator.request_stop)
    signal.signal(signal.SIGINT, coordinator.request_stop)
    coordinator.events.emit("coordinator_started", port=coordinator.port, config=asdict(config))
    if args.address_file:
        tmp = args.address_file + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(f"{coordinator.port}\n")
        os.replace(tmp, args.address_file)
    return coordinator.run()


if __name__ == "__main__":
    sys.exit(main())
