"""A Decoupled DiLoCo learner (docs/diloco.md): one replica group training on its own, sending fragment deltas to
the syncer without waiting and mixing in the global fragments it publishes.

Called from :class:`titan_recover.trainer.RecoverTrainer`'s hooks with ``[recover] mode = "diloco"`` (through
:func:`attach_learner`); TorchTitan's loop, inner optimizer (AdamW), parallelisms and logging are untouched. Per rank
(a *position*: the same rank of every learner holds the same shards):

* data: before every inner step the learner claims the next data block (:mod:`.blocks`) and trains its replica
  microbatch ids ``b A + a``;
* after inner step ``t`` the fragments due (``due_fragments``) go to the send thread (:mod:`.transport`) as
  ``mark_f - local_f`` with the tokens behind it (:mod:`.fragments`);
* the pull thread fetches every newer global fragment; at the next step boundary, once every rank of the learner
  holds the same version, the learner mixes it in.
"""

from __future__ import annotations

import os
import time

import torch

from titan_recover.recover.diloco import blocks
from titan_recover.recover.diloco.fragments import LocalFragments
from titan_recover.recover.diloco.messages import offer_parameters
from titan_recover.recover.diloco.rules import DilocoKeys, due_fragments, schedule_step, total_blocks, Version
from titan_recover.recover.diloco.transport import Delta, DeltaSender, GlobalPuller, POLL_S, SyncerLink


def parameter_names(model_parts) -> list[str]:
    """Parameter names as a plain model has them (:func:`titan_recover.evaluate.plain_name`)."""
    from titan_recover.evaluate import plain_name

    return [plain_name(name) for part in model_parts for name, _ in part.named_parameters()]


def _encode(version: Version) -> int:
    """One integer per version, ordered as versions are (for the ranks' all-reduce); -1 for none."""
    return -1 if version[1] < 0 else version[0] * (1 << 32) + version[1]


class Learner:
    """One rank of a learner: its fragments, data blocks, and the send and pull threads.

    The trainer calls :meth:`has_work` before every inner step, :meth:`local_batch_indices` for its microbatches,
    :meth:`after_inner_step`, and :meth:`finish` (or :meth:`close` on an error) at the end."""

    def __init__(self, trainer, member, events, *, learner: int, learners: int, incarnation: int,
                 coordinator_address: str):
        config = trainer.config
        self.options = config.recover.diloco
        self.trainer, self.member, self.events = trainer, member, events
        self.learner, self.learners, self.incarnation = learner, learners, incarnation
        self.position = torch.distributed.get_rank()
        self.positions = torch.distributed.get_world_size()
        self.params = [p for m in trainer.model_parts for p in m.parameters()]
        self.names = parameter_names(trainer.model_parts)
        self.local = LocalFragments(self.params, self.options.fragments,
                                    where=f"learner {learner} position {self.position}")
        self.fragments = self.local.count
        self.adopted: list[Version] = [(-1, -1)] * self.fragments
        self.batch_degree, self.batch_rank = trainer.batch_layout()
        self.accumulation = trainer.gradient_accumulation_steps
        self.tokens_per_step = (self.accumulation * self.batch_degree * config.training.local_batch_size
                                * config.training.seq_len)
        self.tokens_since = [0] * self.fragments
        self.blocks = total_blocks(config.training.steps, learners)
        self.block: int | None = None
        self.claims = 0
        self.who = f"{learner}.{incarnation}"
        self.adoptions = 0
        self.coordinator = member.store
        self.coordinator_address = coordinator_address
        self.sender = DeltaSender(coordinator_address, learner=learner, incarnation=incarnation, position=self.position)
        self.puller = GlobalPuller(coordinator_address, position=self.position, fragments=self.fragments)

    # ---- start -------------------------------------------------------------------------------------------
    def start(self, timeout_s: float) -> None:
        """Offer this rank's parameters as the initial global model (the syncer takes the first complete offer
        unless it resumed from its checkpoint), adopt every global fragment, and give back the block this learner's
        previous start was training (a restart)."""
        deadline = time.monotonic() + timeout_s
        link = SyncerLink(self.coordinator_address)
        while (store := link.current()) is None:
            self._wait(deadline, "the syncer to publish its address")
        if not store.check([DilocoKeys.VERSIONS]):
            offer_parameters(store, self.learner, self.position, self.names, self.local.locals(), self.local.ranges,
                             global_shapes=[list(p.shape) for p in self.params])
        while not all(v[1] >= 0 for v in self.adopted):
            self.adopt_ready()
            if not all(v[1] >= 0 for v in self.adopted):
                self._wait(deadline, "the global model from the syncer")
        given_back = None
        step = blocks.last_step(self.coordinator, self.learner)
        if step is not None:  # a restart: continue the step count
            self.trainer.step = step
            if self.position == 0:  # the block the previous start was training goes back to the pool
                given_back = blocks.requeue_block(self.coordinator, self.learner, self.who)
        if self.positions > 1:
            torch.distributed.barrier()  # every rank read the step before rank 0 may claim a block
        if self.position == 0:
            self.events.emit("learner_started", incarnation=self.incarnation, versions=[list(v) for v in self.adopted],
                             requeued_block=given_back, step=self.trainer.step, fragments=self.fragments,
                             blocks=self.blocks)

    def _wait(self, deadline: float, what: str) -> None:
        self.member.progress(phase="startup")
        if time.monotonic() > deadline:
            raise TimeoutError(f"learner {self.learner} position {self.position}: no {what} within the startup "
                               "timeout (recover.startup_timeout_s); is the syncer running?")
        time.sleep(POLL_S)

    # ---- data blocks -------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Called before every inner step: claims the step's data block; False once the budget is claimed."""
        self.block = self._claim()
        if self.block is None:
            self.flush()  # at once: the syncer's last merges need not wait for the end of TorchTitan's loop
            return False
        self._set_learning_rate(schedule_step(self.block, self.learners))
        return True

    def _claim(self) -> int | None:
        """Rank 0 claims and shares the block with the learner's other ranks."""
        if self.position == 0:
            block = blocks.claim_block(self.coordinator, self.who)
            if block < self.blocks:
                blocks.record_training(self.coordinator, self.learner, block, self.trainer.step)
                self.events.emit("block_claimed", console=False, block=block, step=self.trainer.step,
                                 incarnation=self.incarnation)
            if self.positions > 1:
                blocks.share_claim(self.coordinator, self.learner, self.incarnation, self.claims, block)
        else:
            block = blocks.read_claim(self.coordinator, self.learner, self.incarnation, self.claims)
        self.claims += 1
        return block if block < self.blocks else None

    def local_batch_indices(self) -> list[int]:
        """Indices ``n`` of this rank's local batches in the current inner step (``n = g * dp + r``)."""
        first = self.block * self.accumulation
        return [(first + a) * self.batch_degree + self.batch_rank for a in range(self.accumulation)]

    def _set_learning_rate(self, step: int) -> None:
        """The inner schedule follows the job's progress (the block), not this learner's own step count."""
        for scheduler in self.trainer.lr_schedulers.schedulers:
            scheduler.last_epoch = step - 1
            for group, base, lr_lambda in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                              scheduler.lr_lambdas):
                group["lr"] = base * lr_lambda(step - 1)

    # ---- after every inner step --------------------------------------------------------------------------
    def after_inner_step(self, step: int) -> None:
        self.member.progress(step=step, phase="sync")
        for f in range(self.fragments):
            self.tokens_since[f] += self.tokens_per_step
        for f in due_fragments(step, self.fragments, self.options.inner_steps):
            self.send(f, step)
        self.adopt_ready()
        if self.position == 0:  # the block is trained
            blocks.record_trained(self.coordinator, self.learner, self.block, step, self.who)

    def send(self, fragment: int, step: int) -> None:
        delta = self.local.take_delta(fragment)
        self.sender.submit(Delta(fragment, step, self.tokens_since[fragment], self.adopted[fragment], delta))
        self.tokens_since[fragment] = 0

    def adopt_ready(self) -> None:
        """Mix in every newer global fragment that every rank of the learner holds."""
        ready = self.puller.newest()
        codes = [_encode(ready[f][0]) if f in ready else -1 for f in range(self.fragments)]
        agreed = self._agreed(codes)
        for f in range(self.fragments):
            if not agreed[f] or codes[f] <= _encode(self.adopted[f]):
                continue
            version, global_flat = ready[f]
            self.local.mix(f, global_flat.to(self.trainer.device))
            self.adopted[f] = version
            self.adoptions += 1

    def _agreed(self, codes: list[int]) -> list[bool]:
        """Per fragment: every rank of the learner holds the same version (one all-reduce of ``2F`` integers)."""
        if self.positions == 1:
            return [True] * self.fragments
        both = torch.tensor(codes + [-c for c in codes], dtype=torch.int64, device=self.trainer.device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        highest, lowest = both[: self.fragments].tolist(), [-c for c in both[self.fragments :].tolist()]
        return [hi == lo for hi, lo in zip(highest, lowest)]

    # ---- end ---------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send what every fragment gained since its last send."""
        for f in range(self.fragments):
            if self.tokens_since[f]:
                self.send(f, self.trainer.step)

    def finish(self, timeout_s: float) -> None:
        """The budget is claimed and this learner's last block trained: flush, wait until every delta left, and
        report this rank done."""
        self.flush()
        drained = self.sender.drain(timeout_s)
        if self.position == 0:
            self.events.emit("learner_finished", step=self.trainer.step, sent=self.sender.sent, drained=drained,
                             adoptions=self.adoptions)
        self.close()
        self.member.finish()  # done: the syncer stops expecting deltas from this rank

    def close(self) -> None:
        self.sender.stop()
        self.puller.stop()

    def metrics(self) -> dict:
        return {
            "diloco/block": self.block if self.block is not None else -1,
            "diloco/deltas_sent": self.sender.sent,
            "diloco/deltas_queued": self.sender.pending(),
            "diloco/adoptions": self.adoptions,
            "diloco/oldest_version": min(v[1] for v in self.adopted),
        }


def attach_learner(trainer) -> Learner:
    """Join the job as a learner: the event log and fault injection of this rank, heartbeats to the coordinator
    (the syncer reads them), then :meth:`Learner.start`. Sets ``trainer.chaos`` and ``trainer.learner``.

    The wiring of the other packages (events, chaos, membership) into the trainer: to be replaced by the diloco
    mode's registered class (``modes``)."""
    from titan_recover.recover.chaos.monkey import ChaosMonkey
    from titan_recover.recover.events import EventLog
    from titan_recover.recover.groups.member import (COORDINATOR_ENV, incarnation_from_env, REPLICA_ENV,
                                                     ReplicaMember, RUN_DIR_ENV)

    config = trainer.config
    for name in (REPLICA_ENV, COORDINATOR_ENV):
        if name not in os.environ:
            raise RuntimeError(f"[recover] mode = \"diloco\" but {name} is not set: start learners with "
                               "./run_train.sh (docs/diloco.md)")
    learner = int(os.environ[REPLICA_ENV])
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    incarnation = incarnation_from_env()
    run_dir = os.environ.get(RUN_DIR_ENV, config.dump_folder)
    events = EventLog(os.path.join(run_dir, "events.jsonl"), f"{learner}/{rank}", replica=learner, rank=rank)
    trainer.chaos = ChaosMonkey(config.chaos.schedule(config.recover.groups, world), learner, rank, events,
                                incarnation=incarnation, run_dir=run_dir)
    trainer.optimizers.register_step_pre_hook(lambda *_: trainer.chaos.maybe_inject(trainer.step, "optimizer"))
    member = ReplicaMember(config.recover, replica=learner, rank=rank, ranks_per_replica=world,
                           address=os.environ[COORDINATOR_ENV], incarnation=incarnation)
    member.register()
    trainer.learner = Learner(trainer, member, events, learner=learner, learners=config.recover.replicas,
                              incarnation=incarnation, coordinator_address=os.environ[COORDINATOR_ENV])
    trainer.learner.start(config.recover.startup_timeout_s)
    trainer.metrics_processor.step_metrics_fn = trainer.learner.metrics
    return trainer.learner
