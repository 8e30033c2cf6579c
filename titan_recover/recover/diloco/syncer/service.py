"""The syncer (docs/diloco.md, "The syncer"): start, the loop, merges and the end of the job.

It hosts its own store, publishes its address and generation through the coordinator's store, takes the first
complete parameter offer of a learner as the initial global model (or resumes from its checkpoint), and then loops:
read the learners' deltas, close every fragment's round once its quorum delivered and the grace window says so,
merge with token weights, step the outer optimizer, publish the new version. It never waits for a learner it does
not expect (dead, or not worth it)."""

from __future__ import annotations

import logging
import math
import os
import time
from datetime import timedelta

from titan_recover.recover.chaos.process import ProcessFaults
from titan_recover.recover.diloco.blocks import blocks_trained, collect_done, requeue_block
from titan_recover.recover.diloco.messages import read_offer, withdraw_offer
from titan_recover.recover.diloco.rules import DilocoKeys, total_blocks, WARMING
from titan_recover.recover.diloco.syncer.checkpoint import (checkpoint_dir, global_model_path, load_checkpoint,
                                                            save_atomically, save_checkpoint)
from titan_recover.recover.diloco.syncer.evaluation import GlobalEvaluator
from titan_recover.recover.diloco.syncer.global_model import GlobalModel
from titan_recover.recover.diloco.syncer.inbox import Inbox
from titan_recover.recover.diloco.syncer.liveness import LearnerLiveness, LIVENESS_EVERY_S
from titan_recover.recover.diloco.syncer.metrics import Progress, SyncerMetrics
from titan_recover.recover.diloco.syncer.rounds import merge_record, Rounds
from titan_recover.recover.events import EventLog
from titan_recover.recover.stores import connect, host_port, read_keys
from titan_recover.recover.groups.keys import GroupKeys, write_dropped

logger = logging.getLogger("titan_recover.syncer")

POLL_S = 0.02
FINAL_QUIET_S = 1.0
COLLECT_EVERY_S = 5.0
"""How often the syncer deletes the done keys of blocks nobody can finish again (``blocks.collect_done``: a read
of every learner's key each time; the keys grow by one per inner step of each learner)."""


class MissingCheckpoint(RuntimeError):
    """An earlier syncer saved a checkpoint that this one cannot find (the run folder is not shared)."""


class Syncer:
    """``config``: the run's config (``[recover]``, ``[recover.diloco]``, ``[training]``, ``[chaos]``,
    ``[metrics]``, and what the validation loss needs). ``ranks``: ranks per learner. ``start``: how many times
    the syncer was started before on this node. ``host``: the address every learner reaches this node at;
    ``nodes``: how many launchers run learners (each reports when its learners ended). ``coordinator``: the job's
    store already opened (a standby's fenced store, docs/diloco.md "Standby syncers"), else opened at
    ``coordinator_address``; ``identity``: the candidate's name in the election (empty without one)."""

    def __init__(self, config, *, coordinator_address: str = "", run_dir: str, ranks: int, start: int = 0,
                 host: str = "127.0.0.1", port: int = 0, nodes: int = 1, coordinator=None, identity: str = ""):
        self.config, self.options = config, config.recover.diloco
        self.learners, self.ranks, self.nodes = config.recover.replicas, ranks, nodes
        self.blocks = total_blocks(config.training.steps, self.learners)
        self.run_dir, self.identity = run_dir, identity
        self.coordinator = coordinator or connect(coordinator_address, timeout_s=config.recover.agree_timeout_s)
        self.store = _serve_store(host, port)
        self.generation = self.coordinator.add(DilocoKeys.GENERATION, 1)
        self.address = host_port(host, self.store.port)
        self.who = f"syncer.{self.generation}"
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), "syncer", start=start,
                               generation=self.generation)
        # [chaos] faults name the syncer's start in the job (its generation - 1), whichever node it runs on
        self.faults = ProcessFaults(config.chaos.schedule(self.learners, ranks), "syncer", self.generation - 1,
                                    self.events)
        self.model = GlobalModel(ranks=ranks, outer_lr=self.options.outer_lr,
                                 outer_momentum=self.options.outer_momentum)
        self.progress = Progress()
        self.rounds: Rounds | None = None  # once the model's fragments are known
        self.inbox = Inbox(self.store, learners=self.learners, ranks=ranks)
        self.liveness = LearnerLiveness(self.coordinator, learners=self.learners, ranks=ranks,
                                        heartbeat_timeout_s=config.recover.heartbeat_timeout_s,
                                        progress_timeout_s=config.recover.progress_timeout_s)
        self.metrics = SyncerMetrics(run_dir)
        self.evaluator = GlobalEvaluator(config, ranks)
        self.alive: set[int] = set()
        self.done: set[int] = set()
        self.end_reason = ""
        self.val_loss: float | None = None
        self._liveness_at = 0.0
        self._ticked_at: float | None = None
        self._tick_gap_s = 0.0
        """Time from the loop's previous pass to this one: a round whose window ended between them closes in
        this pass, late by at most this much (logged with each merge)."""
        self._beaten = 0.0
        self._named_stopped: set[tuple[int, int]] = set()
        """(learner, start) named dropped for a heartbeat that stood still (:meth:`_drop_stopped`)."""
        self._evaluated = False
        """Whether this process evaluated (compiled) the global model before."""
        self._someone_alive_at = time.monotonic()
        """When a learner was last alive (or this syncer started): none for ``startup_timeout_s`` ends the job."""
        self._collected_at = 0.0
        self._checkpoint_at = time.monotonic()
        self._eval_at = time.monotonic()

    @property
    def versions(self) -> list[int]:
        return self.model.versions

    # ---- start -------------------------------------------------------------------------------------------
    def beat(self, at_once: bool = False, warming: bool = False) -> None:
        """Tell the launcher this start makes progress (at most every ``heartbeat_interval_s``, or now): each pass
        of the loop, and while it waits for the initial model; a beat unchanged for ``syncer_timeout_s`` is a hang.
        ``warming``: now, marked :data:`WARMING` (work that compiles follows); the next beat is then written at once,
        whatever the interval, so the mark lasts only through that work. A fenced store refuses the beat of a syncer
        that lost its role (``NotLeader``)."""
        now = time.monotonic()
        if at_once or warming or now - self._beaten >= self.config.recover.heartbeat_interval_s:
            mark = WARMING if warming else ""
            self.coordinator.set(DilocoKeys.SYNCER_BEAT, f"{self.generation}:{time.time():.6f}{mark}")
            self._beaten = -math.inf if warming else now

    def publish_address(self) -> None:
        self.coordinator.set(DilocoKeys.SYNCER, f"{self.address} {self.generation}")

    def initialize(self, timeout_s: float) -> None:
        state = load_checkpoint(self.run_dir)
        if state is None and self.coordinator.check([DilocoKeys.CHECKPOINTED]):
            generation, merges = self.coordinator.get(DilocoKeys.CHECKPOINTED).decode().split()
            raise MissingCheckpoint(
                f"syncer {self.generation}: syncer {generation} saved a checkpoint (after {merges} merges) that is "
                f"not in {checkpoint_dir(self.run_dir)}: a syncer that takes over on another node resumes from it, "
                "so the run folder (dump_folder) must be on a filesystem every node shares")
        if state is not None:
            self._load(state)
        else:
            self._take_offer(timeout_s)
            self.rounds = Rounds(self.model.fragments)
        for f in range(self.model.fragments):
            self.model.publish(self.store, f)
        self.model.publish_versions(self.store, self.generation)
        self.events.emit("syncer_started", resumed=state is not None, versions=list(self.versions),
                         merges=self.progress.merges, merged_tokens=self.progress.merged_tokens,
                         fragments=self.model.fragments, address=self.address, identity=self.identity)
        if state is None:
            self._checkpoint()

    def _take_offer(self, timeout_s: float) -> None:
        """The first learner whose every rank offered its parameters gives the initial global model."""
        deadline = time.monotonic() + timeout_s
        while True:
            for learner in range(self.learners):
                offer = read_offer(self.store, learner, self.ranks)
                if offer is not None:
                    self.model.build(*offer)
                    self.events.emit("initial_model", from_learner=learner,
                                     parameters=sum(f.numel() for f in offer[1]))
                    for other in range(self.learners):  # never read again: a model's bytes per learner
                        for rank in range(self.ranks):
                            withdraw_offer(self.store, other, rank)
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("no learner offered its parameters within recover.startup_timeout_s")
            self.beat()
            time.sleep(POLL_S)

    # ---- state -------------------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {**self.model.state_dict(), **self.progress.state_dict(), "period_s": list(self.rounds.period_s)}

    def _load(self, state: dict) -> None:
        self.model.load_state_dict(state)
        self.progress.load_state_dict(state)
        self.rounds = Rounds(self.model.fragments, period_s=state["period_s"])

    def _checkpoint(self) -> None:
        save_checkpoint(self._state(), self.run_dir, self.generation)
        self.coordinator.set(DilocoKeys.CHECKPOINTED, f"{self.generation} {self.progress.merges}")
        self._checkpoint_at = time.monotonic()

    # ---- learners ----------------------------------------------------------------------------------------
    def _judge_liveness(self) -> None:
        """A learner lost (neither alive nor done) gives back the block it was training: the block of the start
        last seen alive, never one a restart claimed since."""
        alive, done = self.liveness.judge()
        if alive:
            self._someone_alive_at = time.monotonic()
        for learner in sorted(self.alive - alive - done):
            start = self.liveness.incarnation[learner]
            given_back = requeue_block(self.coordinator, learner, self.who, incarnation_at_most=start)
            if given_back is not None or learner in self.liveness.hung:
                # that start can add nothing (its block is another's) or is stuck: its launcher ends it if it still
                # runs, and starts it again; one that only missed beats between blocks trains on
                write_dropped(self.coordinator, learner, start)
            reason = self.liveness.reasons.get(learner, "no heartbeat")
            self.events.emit("learner_lost", learner=learner, reason=reason, requeued_block=given_back)
        self.alive, self.done = alive, done
        self._drop_stopped()

    def _drop_stopped(self) -> None:
        """A lost learner that held no block trains on if it comes back; one whose heartbeat stayed unchanged for
        ``progress_timeout_s`` will not (a stopped process): named dropped once, so that its launcher ends it and
        starts it again (a start that is gone already is not ended twice: the launcher matches the start)."""
        for learner, start in sorted(self.liveness.stopped.items()):
            if (learner, start) in self._named_stopped or learner in self.done:
                continue
            self._named_stopped.add((learner, start))
            write_dropped(self.coordinator, learner, start)
            self.events.emit("learner_stopped", learner=learner, start=start,
                             reason=f"no heartbeat for recover.progress_timeout_s = "
                                    f"{self.config.recover.progress_timeout_s} s")

    def _receive(self, now: float) -> int:
        """Deliver every delta complete in every rank to its round; the pieces read."""
        received, deliveries = self.inbox.receive()
        for delivery in deliveries:
            self.rounds.deliver(delivery, now)
        return received

    # ---- rounds ------------------------------------------------------------------------------------------
    def _maybe_merge(self, fragment: int, now: float, final: bool = False) -> None:
        quorum = self.rounds.merge_quorum(fragment, now, self.alive, min_quorum=self.options.min_quorum,
                                          max_window_s=self.options.max_window_s, final=final)
        if quorum is not None:
            self._merge(fragment, now, quorum, final)

    def _merge(self, fragment: int, now: float, quorum: int, final: bool) -> None:
        closed = self.rounds.close(fragment, now)
        version = self.model.merge(fragment, closed.deltas, closed.tokens)
        self.model.publish(self.store, fragment)
        self.model.publish_versions(self.store, self.generation)
        self.progress.record_merge(fragment, self.model.fragments, closed.tokens, closed.steps)
        record = merge_record(closed, fragment=fragment, version=version, generation=self.generation,
                              alive=self.alive, quorum=quorum, min_quorum=self.options.min_quorum, now=now,
                              final=final)
        record["tick_gap_s"] = self._tick_gap_s
        self.events.emit("fragment_merged", **record)
        self.metrics.log(now, self.progress, len(self.alive), merge=record)
        self._inject_faults()

    def _inject_faults(self) -> None:
        """``[chaos]`` faults of the syncer fire right after their merge (``step``: merges so far)."""
        self.faults.maybe_inject(self.progress.merges, "merge")

    # ---- evaluation --------------------------------------------------------------------------------------
    def evaluate(self, now: float) -> float | None:
        """The global model's validation loss; None when the ranks' shards do not assemble by rows."""
        parameters = self.model.parameters()
        if parameters is None:
            return None
        # beats between validation microbatches: an evaluation longer than syncer_timeout_s is not a hang. The
        # first microbatch of this process's first evaluation compiles (a FlexAttention model): announced, it is
        # held to startup_timeout_s, and the beat after it drops the mark (docs/diloco.md)
        if not self._evaluated:
            self.beat(warming=True)
        self.val_loss = self.evaluator.loss(parameters, progress=self.beat)
        self._evaluated = True
        self._eval_at = time.monotonic()
        self.metrics.log(now, self.progress, len(self.alive), val_loss=self.val_loss)
        self.events.emit("global_evaluated", merges=self.progress.merges, versions=list(self.versions),
                         val_loss=self.val_loss, merged_tokens=self.progress.merged_tokens)
        return self.val_loss

    # ---- loop --------------------------------------------------------------------------------------------
    def run(self) -> int:
        self.publish_address()
        self.initialize(self.config.recover.startup_timeout_s)
        self.evaluate(time.time())
        quiet_since = None
        while True:
            now = time.time()
            received = self._tick(now)
            if self._over():
                quiet_since = None if received else (quiet_since or time.monotonic())
                if quiet_since is not None and time.monotonic() - quiet_since > FINAL_QUIET_S:
                    return self.finish()
            time.sleep(POLL_S)

    def _tick(self, now: float) -> int:
        """One pass of the loop: liveness, deltas, merges, and the checkpoint and evaluation when due."""
        self._tick_gap_s = now - self._ticked_at if self._ticked_at is not None else 0.0
        self._ticked_at = now
        self.beat()
        if now - self._liveness_at > LIVENESS_EVERY_S:
            self._judge_liveness()
            self._liveness_at = now
        if now - self._collected_at > COLLECT_EVERY_S:
            collect_done(self.coordinator, self.learners)  # here: the thread that gives blocks back
            self._collected_at = now
        received = self._receive(now)
        for f in range(self.model.fragments):
            self._maybe_merge(f, now)
        if time.monotonic() - self._checkpoint_at > self.options.checkpoint_interval_s:
            self._checkpoint()
        if self.options.eval_interval_s and time.monotonic() - self._eval_at > self.options.eval_interval_s:
            self.evaluate(now)
        return received

    def _over(self) -> bool:
        """Every node's launcher saw its learners end, or the budget is trained and every live learner has sent its
        last deltas (a learner still restarting is not waited for: the blocks it held were given back and trained
        by others), or no learner was alive for ``startup_timeout_s`` (a node lost with its launcher reports
        nothing; a restart beats well within that)."""
        if None not in read_keys(self.coordinator, [DilocoKeys.learners_over(n) for n in range(self.nodes)]):
            self.end_reason = "every learner ended"
            return True
        if blocks_trained(self.coordinator) >= self.blocks and not self.alive:
            self.end_reason = f"the budget's {self.blocks} blocks are trained and no learner is running"
            return True
        timeout = self.config.recover.startup_timeout_s
        if not self.alive and time.monotonic() - self._someone_alive_at > timeout:
            self.end_reason = f"no learner was alive for {timeout} s (recover.startup_timeout_s)"
            return True
        return False

    def verdict(self) -> str:
        """What the job's store records at the end: ``trained`` once every block of the budget was trained, else
        why not (the launchers exit with it)."""
        done = blocks_trained(self.coordinator)
        if done >= self.blocks:
            return "trained"
        return f"{self.end_reason}, with {done} of the budget's {self.blocks} blocks trained"

    def finish(self) -> int:
        """Every learner ended: merge what is left, evaluate, save the global model and the checkpoint (after a
        beat that a fenced store refuses once another syncer leads: a deposed one saves nothing)."""
        self.beat(at_once=True)
        now = time.time()
        for f in range(self.model.fragments):
            self._maybe_merge(f, now, final=True)
        val_loss = self.evaluate(now)
        parameters = self.model.parameters()
        if parameters is not None:
            save_atomically(parameters, global_model_path(self.run_dir))
        self._checkpoint()
        self.events.emit("syncer_finished", reason=self.end_reason, merges=self.progress.merges,
                         blocks_done=blocks_trained(self.coordinator), merged_tokens=self.progress.merged_tokens,
                         goodput_tokens_per_s=self.progress.goodput(now), elapsed_s=now - self.progress.started_at,
                         val_loss=val_loss, versions=list(self.versions))
        self.metrics.close()
        self.coordinator.set(GroupKeys.FINISHED, self.verdict())
        return 0


def _serve_store(host: str, port: int):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
