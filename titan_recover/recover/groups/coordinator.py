"""The coordinator: judges liveness from heartbeats and forms membership epochs, in the job's store.

One small process per job (:mod:`titan_recover.recover.coordinator_process`), a client of the job's store (which
the launcher hosts: the coordinator can die and be restarted without losing anything members need). It decides
nothing about training itself: it raises fault flags for members that stopped beating or progressing, and after
every fault publishes the next epoch's members (see docs/replica_groups.md). Its decisions are written to the store
before members can read them, so a new start resumes where a killed one stopped ("Coordinator restarts"). It exits
when every replica has finished, when it is told to stop (SIGTERM / SIGINT), or after writing ``stop``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, TYPE_CHECKING

from torch.distributed import Store

from titan_recover.recover.events import EventLog
from titan_recover.recover.groups.keys import (
    fault_time_and_reason,
    GroupKeys,
    missing_keys,
    raise_fault_flag,
    read_join_requests,
    write_dropped,
)
from titan_recover.recover.groups.liveness import group_beats, Heartbeat, LivenessWatch, WatchedTime
from titan_recover.recover.groups.protocol import (
    all_joined,
    CoordinatorState,
    decide_members,
    DurableState,
    decode_members,
    decode_admission,
    encode_admission,
    encode_members,
    founders,
    ready_to_join,
    resume_action,
)
from titan_recover.recover.stores import read_keys

if TYPE_CHECKING:  # the [recover] section composes this package's users: only its type is named here
    from titan_recover.recover.config import RecoverConfig

logger = logging.getLogger("titan_recover.coordinator")

TICK_S = 0.02
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
    """One start of the job's coordinator, a client of the job's store. Everything it decided lives in the store
    (:class:`CoordinatorState`, written ahead of every epoch it publishes), so a coordinator that was killed is
    replaced by a new start that resumes where it stopped; what it only watched (heartbeats) it watches afresh."""

    def __init__(self, config: RecoverConfig, store: Store, *, replicas: int, ranks_per_replica: int, run_dir: str,
                 chaos=None, durable_state: Callable[[], DurableState | None] | None = None):
        self.config = config
        self.replicas, self.ranks = replicas, ranks_per_replica
        self.run_dir = run_dir
        self.store = store
        self.start = self.store.add(GroupKeys.COORDINATOR_STARTS, 1) - 1
        """Which start of the job's coordinator this is (0: the first)."""
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), "coordinator", start=self.start)
        self.chaos = chaos
        """Faults of the coordinator (``[chaos]``, ``process = "coordinator"``): an object with
        ``maybe_inject(step, phase)``, or None."""
        self.durable_state = durable_state
        """The newest durable state the job could restart from (a checkpoint's step and why), or None: asked when
        every replica is lost at once. Its step is published with the cold restart and every group loads it."""
        self.epoch = -1
        self.members: tuple[int, ...] = ()
        self.cold = False
        """The current epoch is empty after losing every replica: the groups restart and found the next one."""
        self.excluded: set[int] = set()
        self._named_lost: set[int] = set()  # after a stop: the excluded members named lost in the store
        self.incarnation: dict[int, int] = {}  # the incarnation of each member (a restart is a new one)
        self.dropped: dict[int, int] = {}  # the incarnation of each replica last removed
        self.watch = LivenessWatch(config.heartbeat_timeout_s, config.progress_timeout_s,
                                   max_gap_s=max(MAX_LOOK_GAP_S, 2 * config.heartbeat_interval_s))
        self._terminate = False
        self._beaten = 0.0
        self._beats_seen: set[str] = set()
        """The groups' beat keys read once: present from then on, read together (:meth:`_read_beats`)."""

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        self._terminate = True

    def run(self) -> int:
        if self.config.mode == "diloco":
            return self._serve_learners()
        if not self._resume():
            return 1
        while not self._terminate:
            if self.cold and not self._form_founding_epoch():
                continue  # stopped: the survivors (none) are done at once
            stopped = self.store.check([GroupKeys.STOP])
            if self._finished(skip=self.excluded if stopped else set()):
                self.events.emit("job_finished", epoch=self.epoch, members=list(self.members), stopped=stopped)
                self.store.set(GroupKeys.FINISHED, "stopped" if stopped else "trained")
                return 1 if stopped else 0
            self._beat()
            if stopped:  # the survivors only finish; one that dies meanwhile never will, and is not waited for
                self._watch_liveness(raise_flags=False)
                self._name_lost()
            else:
                self._watch_liveness()
                if self.store.check([GroupKeys.fault(self.epoch)]):
                    self._form_next_epoch()
                elif self.store.check([GroupKeys.admission(self.epoch)]):
                    self._admit()
            time.sleep(TICK_S)
        return 0

    def _resume(self) -> bool:
        """Form epoch 0, or take over the stored state of a coordinator that died (docs/replica_groups.md
        "Coordinator restarts"). False only if stopped (terminated) before epoch 0 was formed; an epoch published
        with a stop goes on to the loop, which waits for the members to finish and records the verdict."""
        published = int(self.store.get(GroupKeys.EPOCH)) if self.store.check([GroupKeys.EPOCH]) else -1
        state = (CoordinatorState.decode(self.store.get(GroupKeys.COORDINATOR_STATE))
                 if self.store.check([GroupKeys.COORDINATOR_STATE]) else None)
        action = resume_action(state, published)
        self.events.emit("coordinator_started", action=action, epoch=published)
        if action == "form_first":
            self._form_first_epoch()
            return not self._terminate
        self.incarnation, self.dropped = dict(state.incarnation), dict(state.dropped)
        if action == "finish":  # the previous start died half-way through publishing this epoch
            self._write(state)
            self.events.emit("epoch_formed", epoch=state.epoch, members=list(state.members),
                             removed=list(state.removed), reason=state.reason, finished_publication=True)
            self.excluded = set(state.excluded)
            return True
        self.epoch, self.members, self.excluded = state.epoch, state.members, set(state.excluded)
        self.cold = state.cold
        return True

    def _serve_learners(self) -> int:
        """Diloco mode: learners never form epochs; the job's store is their stable meeting point (the syncer's
        address, the data-block counter, heartbeats) until the syncer reports the job finished."""
        self.events.emit("coordinator_started", action="serve_learners")
        while not self._terminate:
            if self.store.check([GroupKeys.FINISHED]):
                self.events.emit("job_finished", mode="diloco")
                return 0
            self._beat()
            time.sleep(TICK_S * 5)
        return 0

    def _beat(self) -> None:
        """Tell the launcher this start makes progress (at most every ``heartbeat_interval_s``)."""
        now = time.monotonic()
        if now - self._beaten >= self.config.heartbeat_interval_s:
            self.store.set(GroupKeys.COORDINATOR_BEAT, f"{self.start}:{time.time():.6f}")
            self._beaten = now

    def _inject(self, phase: str, step: int) -> None:
        if self.chaos:
            self.chaos.maybe_inject(step, phase)

    def _done(self, replica: int, rank: int) -> bool:
        return self.store.check([GroupKeys.done(replica, rank)])

    def _joined(self, epoch: int, expected_missing: int | None = None) -> dict[int, set[int]]:
        """Every member's ranks that joined ``epoch`` (alive): all of them once the group's join is complete, else
        those its leader reported so far. The complete joins in one request when every group is in, a few per
        group that is not (:func:`missing_keys`; ``expected_missing``: how many are not, by the groups' counter),
        and two more for each of those. A group whose leader finished training counts whole: its last step is
        committed (done, not dead)."""
        any_done, every, joined = self._any_done(), set(range(self.ranks)), {}
        keys = {GroupKeys.join(epoch, replica): replica for replica in self.members}
        incomplete = {keys[key] for key in missing_keys(self.store, list(keys), expected_missing)}
        for replica in self.members:
            so_far = GroupKeys.joining(epoch, replica)
            if replica not in incomplete or (any_done and self._done(replica, 0)):
                joined[replica] = every
            else:
                so_far_value = read_keys(self.store, [so_far])[0]
                joined[replica] = set(decode_members(so_far_value)[0]) if so_far_value is not None else set()
        return joined

    def _finished(self, skip: set[int] = frozenset()) -> bool:
        """Every rank of every member but those in ``skip`` is done (one request)."""
        members = [m for m in self.members if m not in skip]
        return not members or self.store.check([GroupKeys.done(m, r) for m in members for r in range(self.ranks)])

    def _any_done(self) -> bool:
        """Some rank finished training: only then are ranks' ``done`` keys looked at one by one."""
        return self.store.add(GroupKeys.DONE_COUNT, 0) > 0

    # ---- epochs ------------------------------------------------------------------------------------------
    def _registered(self, replica: int) -> bool:
        return all(self.store.check([GroupKeys.register(replica, r)]) for r in range(self.ranks))

    def _registered_incarnations(self, replica: int) -> dict[int, int]:
        """rank -> the incarnation that last registered as that rank of ``replica``."""
        keys = [GroupKeys.register(replica, r) for r in range(self.ranks)]
        return {r: int(value.decode().split(",")[3]) for r, value in enumerate(read_keys(self.store, keys))
                if value is not None}

    def _form_first_epoch(self) -> bool:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not self._terminate:
            complete = [i for i in range(self.replicas) if self._registered(i)]
            if len(complete) == self.replicas or time.monotonic() > deadline:
                missing = sorted(set(range(self.replicas)) - set(complete))
                reason = "all replicas registered" if not missing else f"replicas {missing} did not register in time"
                # a replica restarted before epoch 0 (a start that crashed while building) is a joiner: it waits
                # for an admission and the state of the first members, so it is no member of epoch 0
                restarted = [i for i in complete if set(self._registered_incarnations(i).values()) != {0}]
                if len(restarted) == len(complete):
                    restarted = []  # nobody to admit them: every start that registered is a member
                if restarted:
                    reason += f"; replicas {restarted} restarted before epoch 0: they join by admission"
                members = tuple(i for i in complete if i not in restarted)
                self.incarnation = {i: self._registered_incarnations(i)[0] for i in members}
                return self._publish(0, members, tuple(missing), reason, timing={})
            self._beat()
            time.sleep(TICK_S)
        return False

    def _read_beats(self, keys: list[str]) -> list[bytes]:
        """The groups' beats (``b""`` for one never written): the keys already seen in one request (a beat key is
        never deleted during a job), the others each only if present. A read must never wait for a key: a group may
        die between its registration and its first beat, and after a stop a member may be gone without one (an
        absent beat is a silent one)."""
        seen = [k for k in keys if k in self._beats_seen]
        values = dict(zip(seen, self.store.multi_get(seen) if seen else []))
        unseen = [k for k in keys if k not in values]
        values.update(zip(unseen, (v or b"" for v in read_keys(self.store, unseen))))
        self._beats_seen.update(k for k in unseen if values[k])
        return [values[k] for k in keys]

    def _watch_liveness(self, raise_flags: bool = True) -> None:
        """Judge the members not yet excluded; one dead or hung is excluded and, unless ``raise_flags`` is False
        (after a stop, when no epoch follows), the epoch's fault flag raised."""
        watched = [m for m in self.members if m not in self.excluded]
        # a rank that finished training stops beating: it is done, not dead; once the leader rank finished, the
        # group's last step is committed and the group's beat (the leader's relay) stops: it is no longer watched
        any_done = self._any_done()
        ranks = {m: [r for r in range(self.ranks) if not (any_done and self._done(m, r))] for m in watched}
        ranks = {m: rs for m, rs in ranks.items() if rs and 0 in rs}
        if not ranks:
            return
        raw = self._read_beats([GroupKeys.heartbeat(m) for m in ranks])
        now = time.monotonic()  # after the read: what it returned is the store's state at about this time
        beats = group_beats(dict(zip(ranks, raw)), ranks, self.incarnation)
        self.watch.look(now, beats, self.incarnation)
        if self.chaos:
            self._inject("step", min(beat.step for beat in beats.values()))
        for replica in ranks:
            ranks_of = ranks[replica]
            verdict = self.watch.judge(replica, ranks_of, self.incarnation.get(replica, 0))
            if not verdict.alive:
                self.excluded.add(replica)
                self._save(dataclasses.replace(self._state(), excluded=tuple(sorted(self.excluded))))
                flag = raise_fault_flag(self.store, self.epoch, verdict.reason()) if raise_flags else None
                self.events.emit("failure_detected", epoch=self.epoch, replica=replica, by="coordinator",
                                 reason=verdict.reason(), dead_ranks=list(verdict.dead_ranks),
                                 hung_ranks=list(verdict.hung_ranks), flag=flag,
                                 beats=describe_beats({r: beats[(replica, r)] for r in ranks_of},
                                                      self.watch.ages(replica, ranks_of,
                                                                      self.incarnation.get(replica, 0)),
                                                      self.incarnation.get(replica, 0), time.time()),
                                 unwatched_s=round(self.watch.time.unwatched_s, 3))

    def _name_lost(self) -> None:
        """After a stop: name in the job's store each member found dead or hung (``stop/lost/<replica>``, once), so
        that the survivors waiting for the stop's checkpoint pass a lost writer's turn on
        (:mod:`~titan_recover.recover.groups.stop_checkpoint`)."""
        for replica in sorted(self.excluded - self._named_lost):
            self.store.set(GroupKeys.stop_lost(replica), "1")
            self._named_lost.add(replica)

    def _form_next_epoch(self) -> None:
        fault_time, reason = fault_time_and_reason(self.store.get(GroupKeys.fault(self.epoch)))
        noticed = time.time()
        self.events.emit("fault_flag", epoch=self.epoch, reason=reason, raised_at=fault_time)
        target = self.epoch + 1
        self._inject("epoch", target)
        voted = self.store.check([GroupKeys.evictions(self.epoch)])  # members that voted replicas out (scout.md)
        for replica in self.members if voted else ():
            if replica not in self.excluded and self.store.check([GroupKeys.evicted(self.epoch, replica)]):
                self.excluded.add(replica)
                self.events.emit("replica_evicted", epoch=self.epoch, replica=replica,
                                 reason=self.store.get(GroupKeys.evicted(self.epoch, replica)).decode())
        candidates = [m for m in self.members if m not in self.excluded]
        window = WatchedTime(self.watch.max_gap_s, time.monotonic())  # a stalled coordinator does not shorten it
        joined = {}
        while True:
            window.tick(time.monotonic())
            over = window.elapsed_s > self.config.join_window_s
            # one read per look; the groups' joins only once enough groups are in, at the end, or near the end of
            # the job (a group whose leader finished counts as joined)
            count = self.store.add(GroupKeys.joined_count(target), 0)
            if over or count >= len(candidates) or self._any_done():
                joined = self._joined(target, expected_missing=max(0, len(self.members) - count))
                if over or all_joined(candidates, joined, self.ranks):
                    break
            self._beat()
            time.sleep(0.005)
        decision = decide_members(self.members, joined, self.ranks, excluded=self.excluded)
        self.excluded -= set(decision.removed)
        reason, timing = f"{reason} -> {decision.reason}", {"fault_raised_at": fault_time,
                                                             "coordinator_noticed_at": noticed}
        if decision.members:
            self._publish(target, decision.members, decision.removed, reason, timing)
            return
        # no live member holds the state: the worst case is a restart from the newest durable state, never worse
        durable = self.durable_state() if self.durable_state is not None else None
        if durable is None:
            self._publish(target, (), decision.removed, reason, timing, stop=(
                f"every replica group was lost at once ({reason}) and no durable state exists to restart from: "
                "enable [checkpoint] (enable = true, interval = N) so that the job restarts every group from its "
                "newest checkpoint"))
            return
        self.events.emit("cold_restart", epoch=target, durable=durable.why, step=durable.step,
                         removed=list(decision.removed))
        self._publish(target, (), decision.removed, f"{reason}; restarting every group from the {durable.why}",
                      timing, cold=durable.step)

    def _form_founding_epoch(self) -> bool:
        """After a cold restart (epoch ``R`` empty): wait until every group's launcher named the start it made for
        it and those starts registered (``startup_timeout_s`` at most), then publish epoch ``R + 1`` with them:
        they start from the newest durable state and the lowest one's parameters. False if it stops the job."""
        cold_epoch, deadline = self.epoch, time.monotonic() + self.config.startup_timeout_s
        while not self._terminate:
            founding = {r: int(self.store.get(GroupKeys.founding(cold_epoch, r)))
                        for r in range(self.replicas) if self.store.check([GroupKeys.founding(cold_epoch, r)])}
            registered = {r: self._registered_incarnations(r) for r, incarnation in founding.items() if incarnation >= 0}
            ready, settled = founders(registered, founding, self.ranks)
            if (settled and len(founding) == self.replicas) or time.monotonic() > deadline:
                break
            self._beat()
            time.sleep(TICK_S)
        else:
            return False
        self.incarnation.update({r: founding[r] for r in ready})
        missing = sorted(set(range(self.replicas)) - set(ready))
        reason = (f"founded by {list(ready)} from the newest durable state after losing every replica"
                  + (f"; {missing} not restarted or not registered in time" if missing else ""))
        return self._publish(cold_epoch + 1, ready, (), reason, timing={})

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
        self._publish(self.epoch + 1, tuple(sorted(self.members + admitted)), (), reason, timing={},
                      admitted=(step, admitted))

    # ---- the store: the state written ahead, then the epoch members read -----------------------------------
    def _state(self) -> CoordinatorState:
        return CoordinatorState(self.epoch, self.members, "", incarnation=self.incarnation, dropped=self.dropped,
                                excluded=tuple(sorted(self.excluded)))

    def _save(self, state: CoordinatorState) -> None:
        self.store.set(GroupKeys.COORDINATOR_STATE, state.encode())

    def _publish(self, epoch: int, members: tuple[int, ...], removed: tuple[int, ...], reason: str,
                 timing: dict, admitted: tuple[int, tuple[int, ...]] | None = None, *, cold: int | None = None,
                 stop: str = "") -> bool:
        """Write epoch ``epoch``'s state ahead, then publish it (:meth:`_write`). ``cold``: the empty epoch of a
        cold restart, from the checkpoint of this step. ``stop``: stop the job with this message; an epoch with
        fewer than ``min_replicas`` members (and not cold) stops it too. False if it stops the job."""
        for replica in removed:
            self.dropped[replica] = self.incarnation.get(replica, 0)
            self.watch.forget(replica)
        if not stop and cold is None and len(members) < self.config.min_replicas:
            stop = (f"only {len(members)} replica(s) left {list(members)} after losing {list(removed)}, "
                    f"fewer than recover.min_replicas = {self.config.min_replicas}: stopping")
        state = CoordinatorState(epoch, members, reason, removed, admitted, dict(self.incarnation),
                                 dict(self.dropped), tuple(sorted(self.excluded)), stop, cold is not None, cold)
        self._save(state)  # ahead of what members read: a restarted coordinator finishes this publication
        self._inject("publish", epoch)
        written = self._write(state)
        self.events.emit("epoch_formed", epoch=epoch, members=list(members), removed=list(removed), reason=reason,
                         **timing)
        if state.stop:
            self.events.emit("job_stopped", epoch=epoch, reason=state.stop)
            logger.error(state.stop)
        return written

    def _write(self, state: CoordinatorState) -> bool:
        """Publish ``state``'s epoch to the members (every write idempotent: a restart may repeat them); False if
        it stops the job."""
        for replica in state.removed:
            write_dropped(self.store, replica, state.dropped[replica])
        if state.admitted is not None:  # with the start of each replica admitted: only that start may enter
            step, replicas = state.admitted
            self.store.set(GroupKeys.admitted(state.epoch),
                           encode_admission(step, replicas, [state.incarnation.get(r, 0) for r in replicas]))
        if state.stop:  # before the members: a rank woken by the members key sees the stop that came with them
            self.store.set(GroupKeys.STOP, state.stop)
        if state.cold:  # the step first: a launcher reads it once it sees the cold restart
            self.store.set(GroupKeys.founding_step(state.epoch), str(state.durable_step))
            self.store.set(GroupKeys.COLD_RESTART, str(state.epoch))
        self.store.set(GroupKeys.members(state.epoch), encode_members(state.members, state.reason))
        self.store.set(GroupKeys.EPOCH, str(state.epoch))
        self.epoch, self.members, self.cold = state.epoch, state.members, state.cold
        return not state.stop
