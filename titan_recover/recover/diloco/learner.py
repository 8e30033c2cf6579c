"""A Decoupled DiLoCo learner (docs/diloco.md): one replica group training on its own, sending fragment deltas to
the syncer without waiting and mixing in the global fragments it publishes.

Driven by the ``diloco`` training mode (:mod:`titan_recover.recover.modes.diloco`); TorchTitan's loop, inner
optimizer (AdamW), parallelisms and logging are untouched. Per rank (the rank inside the learner's replica group:
the same rank of every learner holds the same shards):

* data: before every inner step the learner claims the next data block (:mod:`.blocks`) and trains its replica
  microbatch ids ``b A + a``;
* after inner step ``t`` the fragments due (``due_fragments``) go to the send thread (:mod:`.transport`) as
  ``mark_f - local_f`` with the tokens behind it (:mod:`.fragments`);
* the pull thread fetches every newer global fragment; at the next step boundary, once every rank of the learner
  holds the same version, the learner mixes it in.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.distributed import DistError

from titan_recover.recover.diloco import blocks
from titan_recover.recover.diloco.fragments import LocalFragments
from titan_recover.recover.diloco.messages import offer_parameters, withdraw_offer
from titan_recover.recover.diloco.rules import DilocoKeys, due_fragments, schedule_step, total_blocks, Version
from titan_recover.recover.diloco.transport import Delta, DeltaSender, GlobalPuller, POLL_S, SyncerLink
from titan_recover.recover.groups.agree import extremes

logger = logging.getLogger(__name__)

OUTSTANDING_POLL_S = 0.5
"""Past the budget, how often rank 0 looks whether a block came back."""


class BlockGivenBack(RuntimeError):
    """This learner start was taken for lost and its block given to another learner (:func:`blocks.record_trained`
    found the hold ended): the start must end without sending the block's progress."""


def parameter_names(model_parts) -> list[str]:
    """Parameter names as a plain model has them (:func:`titan_recover.evaluate.plain_name`)."""
    from titan_recover.evaluate import plain_name

    return [plain_name(name) for part in model_parts for name, _ in part.named_parameters()]


def _encode(version: Version) -> int:
    """One integer per version, ordered as versions are (for the ranks' all-reduce); -1 for none."""
    return -1 if version[1] < 0 else version[0] * (1 << 32) + version[1]


class Learner:
    """One rank of a learner: its fragments, data blocks, and the send and pull threads.

    The mode calls :meth:`start`, then :meth:`has_work` before every inner step, :meth:`local_batch_indices` for its
    microbatches, :meth:`after_inner_step`, and :meth:`finish` (or :meth:`close` on an error) at the end. ``parts``:
    what TorchTitan built (:class:`~titan_recover.recover.modes.base.TrainerParts`)."""

    def __init__(self, parts, member, events, *, learner: int, learners: int, incarnation: int,
                 coordinator_address: str):
        config = parts.config
        self.options = config.recover.diloco
        self.parts, self.member, self.events = parts, member, events
        self.step = 0
        """The last inner step this learner trained (the job's count: a restart continues it)."""
        self.learner, self.learners, self.incarnation = learner, learners, incarnation
        self.rank = torch.distributed.get_rank()
        self.ranks = torch.distributed.get_world_size()
        self.params = [p for m in parts.model_parts for p in m.parameters()]
        self.names = parameter_names(parts.model_parts)
        self.local = LocalFragments(self.params, self.options.fragments,
                                    where=f"learner {learner} rank {self.rank}")
        self.fragments = self.local.count
        self.adopted: list[Version] = [(-1, -1)] * self.fragments
        self.batch_degree, self.batch_rank = parts.batch_layout()
        self.accumulation = parts.gradient_accumulation_steps
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
        self.finished = False
        """:meth:`finish` ran: this rank reported done."""
        self._stamp_every_s = min(1.0, config.recover.progress_timeout_s / 4)
        """The longest a bounded wait of the main thread goes without a progress stamp."""
        self.sender = DeltaSender(coordinator_address, learner=learner, incarnation=incarnation, rank=self.rank)
        self.puller = GlobalPuller(coordinator_address, rank=self.rank, fragments=self.fragments)

    # ---- start -------------------------------------------------------------------------------------------
    def start(self, timeout_s: float, step: int) -> int:
        """Offer this rank's parameters as the initial global model (the syncer takes the first complete offer
        unless it resumed from its checkpoint), adopt every global fragment, and give back the block this learner's
        previous start was training (a restart). Returns the step to count from: ``step``, or the job's count a
        restarted learner continues."""
        self.step = step
        deadline = time.monotonic() + timeout_s
        store, offered = self._offer_until_adopted(SyncerLink(self.coordinator_address), deadline)
        if offered is not None:  # the global model exists: the offer is never read (one written late included)
            try:
                withdraw_offer(store, self.learner, self.rank, offered)
            except DistError as error:  # that syncer is gone, and its store with it
                logger.info("learner %d rank %d: offer not withdrawn (%s)", self.learner, self.rank, error)
        given_back = None
        step = blocks.last_step(self.coordinator, self.learner)
        if step is not None:  # a restart: continue the step count
            self.step = step
            if self.rank == 0:  # the block the previous start was training goes back to the pool
                given_back = blocks.requeue_block(self.coordinator, self.learner, self.who)
        if self.ranks > 1:
            torch.distributed.barrier()  # every rank read the step before rank 0 may claim a block
        if self.rank == 0:
            self.events.emit("learner_started", incarnation=self.incarnation, versions=[list(v) for v in self.adopted],
                             requeued_block=given_back, step=self.step, fragments=self.fragments,
                             blocks=self.blocks)
        return self.step

    def _offer_until_adopted(self, link: SyncerLink, deadline: float):
        """Offer this rank's parameters to the syncer that has no global model yet, and to each newer one that
        still has none (a syncer that died before its first checkpoint took nothing with it), until every global
        fragment is adopted. Returns (the store offered to last, the offer's size) or (None, None)."""
        store, offered, offered_to = None, None, -1
        while True:
            current = link.current()
            if current is not None and link.generation != offered_to:
                try:
                    if not current.check([DilocoKeys.VERSIONS]):
                        offered = offer_parameters(current, self.learner, self.rank, self.names,
                                                   self.local.locals(), self.local.ranges,
                                                   global_shapes=[list(p.shape) for p in self.params])
                        store = current
                    offered_to = link.generation
                except DistError as error:  # that syncer went away meanwhile: offer to the next one
                    logger.info("learner %d rank %d: offer not made (%s)", self.learner, self.rank, error)
                    link.drop()
            self.adopt_ready()
            if all(v[1] >= 0 for v in self.adopted):
                return store, offered
            self._wait(deadline, "the global model from the syncer" if current is not None else
                       "the syncer to publish its address")

    def _wait(self, deadline: float, what: str) -> None:
        self.member.progress(phase="startup")
        if time.monotonic() > deadline:
            raise TimeoutError(f"learner {self.learner} rank {self.rank}: no {what} within the startup "
                               "timeout (recover.startup_timeout_s); is the syncer running?")
        time.sleep(POLL_S)

    # ---- data blocks -------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Called before every inner step: claims the step's data block; False once the budget is claimed. The
        learner then finishes at once (:meth:`finish`): the syncer's last merges need not wait for the end of
        TorchTitan's loop (its rank 0 sleeps 2 s there, without progress)."""
        if self.finished:
            return False
        self.block = self._claim()
        if self.block is None:
            self.finish()
            return False
        self._set_learning_rate(schedule_step(self.block, self.learners))
        return True

    def _claim(self) -> int | None:
        """Rank 0 claims and shares the block with the learner's other ranks. Past the budget, it waits while some
        block is not counted trained (:meth:`_await_given_back`): a block given back then is trained here, not left
        untrained by a job whose other learners all ended."""
        if self.rank == 0:
            block = blocks.claim_block(self.coordinator, self.who)
            if block >= self.blocks:
                block = self._await_given_back()
            if block < self.blocks:
                blocks.record_training(self.coordinator, self.learner, block, self.step, self.incarnation)
                self.events.emit("block_claimed", console=False, block=block, step=self.step,
                                 incarnation=self.incarnation)
            if self.ranks > 1:
                blocks.share_claim(self.coordinator, self.learner, self.incarnation, self.claims, block)
        else:
            block = blocks.read_claim(self.coordinator, self.learner, self.incarnation, self.claims,
                                      lambda: self.member.progress(phase="rejoin_wait"), most_s=self._stamp_every_s)
        self.claims += 1
        return block if block < self.blocks else None

    def _await_given_back(self) -> int:
        """Past the budget (every block is claimed): while some block is not counted trained, wait, and take it if
        it is given back (its holder lost). The wait ends when every block is trained, or once no block was counted
        for ``startup_timeout_s + 2 x progress_timeout_s`` (time for the syncer to give a hung holder's block back,
        even across a syncer restart; a job whose syncer is gone for good gives nothing back): then the block stays
        untrained, which the job's verdict reports unless another learner trains it. Returns the block taken, or the
        budget (none)."""
        recover = self.parts.config.recover
        most_s = recover.startup_timeout_s + 2 * recover.progress_timeout_s
        trained, deadline = -1, 0.0
        while (now_trained := blocks.blocks_trained(self.coordinator)) < self.blocks:
            if now_trained != trained:  # blocks are being counted: the others are not stuck
                trained, deadline = now_trained, time.monotonic() + most_s
            block = blocks.claim_requeued(self.coordinator, self.who)
            if block is not None:
                return block
            if time.monotonic() > deadline:
                logger.warning("learner %d: %d of the budget's %d blocks are trained, none was counted for %.0f s "
                               "(recover.startup_timeout_s + 2 x recover.progress_timeout_s) and none was given back; "
                               "ending without them", self.learner, trained, self.blocks, most_s)
                break
            self._waiting(min(OUTSTANDING_POLL_S, self._stamp_every_s))
        return self.blocks

    def _waiting(self, seconds: float) -> None:
        """Between looks of a wait for other learners (a bounded one: not a hang)."""
        self.member.progress(phase="rejoin_wait")
        time.sleep(seconds)

    def local_batch_indices(self) -> list[int]:
        """Indices ``n`` of this rank's local batches in the current inner step (``n = g * dp + r``)."""
        first = self.block * self.accumulation
        return [(first + a) * self.batch_degree + self.batch_rank for a in range(self.accumulation)]

    def _set_learning_rate(self, step: int) -> None:
        """The inner schedule follows the job's progress (the block), not this learner's own step count."""
        # through TorchTitan's own Stateful interface: the schedule's position, then one step to it, which sets
        # every parameter group's learning rate to ``base * lambda(step - 1)``
        schedulers = self.parts.lr_schedulers
        schedulers.load_state_dict({"last_epoch": step - 2})
        schedulers.step()

    # ---- after every inner step --------------------------------------------------------------------------
    def after_inner_step(self, step: int) -> None:
        """The block is trained: count it (unless it was given away meanwhile: :class:`BlockGivenBack`), send the
        due fragments, mix in the newer global ones."""
        self.step = step
        self.member.progress(step=step, phase="sync")
        kept = self.rank != 0 or blocks.record_trained(self.coordinator, self.learner, self.block, step,
                                                       self.incarnation, self.who)
        ready, codes = self._ready()
        agreed, kept = self._agreed(codes, kept)
        if not kept:  # nothing of this block may reach the syncer: another learner trains it
            raise BlockGivenBack(f"learner {self.learner} (start {self.incarnation}) rank {self.rank}: the syncer took "
                                 f"this learner for lost (no heartbeat for recover.heartbeat_timeout_s, or no progress "
                                 f"for recover.progress_timeout_s) and gave its block {self.block} to another learner; "
                                 "this start ends without sending that block's progress (its data would count twice)")
        for f in range(self.fragments):
            self.tokens_since[f] += self.tokens_per_step
        for f in due_fragments(step, self.fragments, self.options.inner_steps):
            self.send(f, step)
        self._mix(ready, codes, agreed)

    def send(self, fragment: int, step: int) -> None:
        delta = self.local.take_delta(fragment)
        self.sender.submit(Delta(fragment, step, self.tokens_since[fragment], self.adopted[fragment], delta))
        self.tokens_since[fragment] = 0

    def adopt_ready(self) -> None:
        """Mix in every newer global fragment that every rank of the learner holds."""
        ready, codes = self._ready()
        agreed, _ = self._agreed(codes)
        self._mix(ready, codes, agreed)

    def _ready(self) -> tuple[dict, list[int]]:
        """The newest global fragments the pull thread holds, and their versions' codes (-1: none)."""
        ready = self.puller.newest()
        return ready, [_encode(ready[f][0]) if f in ready else -1 for f in range(self.fragments)]

    def _mix(self, ready: dict, codes: list[int], agreed: list[bool]) -> None:
        for f in range(self.fragments):
            if not agreed[f] or codes[f] <= _encode(self.adopted[f]):
                continue
            version, global_flat = ready[f]
            self.local.mix(f, global_flat.to(self.parts.device))
            self.adopted[f] = version
            self.adoptions += 1

    def _agreed(self, codes: list[int], kept: bool = True) -> tuple[list[bool], bool]:
        """Per fragment: every rank of the learner holds the same version; and whether every rank's ``kept`` holds
        (rank 0's verdict on the block reaches the others). One all-reduce (:func:`extremes`), read back once per
        inner step: the adoption is the host's decision; none with one rank."""
        if self.ranks == 1:
            return [True] * self.fragments, kept
        lowest, highest = extremes(codes + [int(kept)], self.parts.device)
        return [lo == hi for lo, hi in zip(lowest[:-1], highest[:-1])], lowest[-1] == 1

    # ---- end ---------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send what every fragment gained since its last send."""
        for f in range(self.fragments):
            if self.tokens_since[f]:
                self.send(f, self.step)

    def finish(self, timeout_s: float | None = None) -> None:
        """The budget is claimed and this learner's last block trained: flush, wait (``timeout_s``, default
        ``recover.agree_timeout_s``) until every delta left, and report this rank done. Once."""
        if self.finished:
            return
        self.finished = True
        if timeout_s is None:
            timeout_s = self.parts.config.recover.agree_timeout_s
        self.flush()
        drained, deadline = False, time.monotonic() + timeout_s
        while not drained and time.monotonic() < deadline:  # a bounded wait, not a hang
            self.member.progress(phase="transfer")
            drained = self.sender.drain(min(self._stamp_every_s, max(0.0, deadline - time.monotonic())))
        if self.rank == 0:
            self.events.emit("learner_finished", step=self.step, sent=self.sender.sent, drained=drained,
                             adoptions=self.adoptions)
        self.member.finish()  # done: the syncer stops expecting deltas from this rank (and its progress stamps)
        self.close()

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
