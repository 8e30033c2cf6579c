"""A Decoupled DiLoCo learner (docs/diloco.md): one replica group training on its own, sending fragment deltas to
the syncer without waiting and mixing in the global fragments it publishes.

Called from :class:`titan_recover.trainer.RecoverTrainer`'s hooks with ``[recover] mode = "diloco"``; TorchTitan's
loop, inner optimizer (AdamW), parallelisms and logging are untouched. Per rank (a *position*: the same rank of every
learner holds the same shards):

* data: before every inner step the learner claims the next data block from the job's counter (the coordinator's
  store) and trains its replica microbatch ids ``b A + a``: a learner trains as many blocks as its speed allows,
  no id is trained twice while the learner lives, and the counter ends the job when the budget (``training.steps``
  synchronous steps of ``replicas`` groups) is claimed. The block a dead learner was training is given back (by the
  syncer, or by the learner's restart) and the next claim of any learner takes it first;
* after inner step ``t`` the fragments due (``due_fragments``) go to a send thread as ``mark_f - local_f`` (the
  progress since the fragment was last sent or adopted) with the tokens behind it;
* a pull thread fetches every newer global fragment; at the next step boundary, once every rank of the learner
  holds the same version, ``local_f <- global_f + (local_f - mark_f)`` (what was trained since the last send is
  kept, what was sent comes back through the global fragment).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch

from titan_recover.recover.groups.blobs import get_blob, put_blob
from titan_recover.recover.diloco.rules import (
    decode_versions,
    DilocoKeys,
    due_fragments,
    schedule_step,
    split_fragments,
    total_blocks,
    Version,
)
from titan_recover.recover.groups.member import connect
from titan_recover.recover.phoenix.state_transfer import bytes_view, local_tensor

logger = logging.getLogger(__name__)

POLL_S = 0.05
RETRY_S = 0.5
STORE_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 1.0


def parameter_names(model_parts) -> list[str]:
    """Parameter names as a plain model has them (:func:`titan_recover.evaluate.plain_name`)."""
    from titan_recover.evaluate import plain_name

    return [plain_name(name) for part in model_parts for name, _ in part.named_parameters()]


def read_syncer(coordinator) -> tuple[str, int] | None:
    """The syncer's ``(HOST:PORT, generation)`` as published in the coordinator's store, or None."""
    if not coordinator.check([DilocoKeys.SYNCER]):
        return None
    address, generation = coordinator.get(DilocoKeys.SYNCER).decode().split()
    return address, int(generation)


class SyncerLink:
    """One thread's connection to the current syncer, re-established when a restarted syncer publishes itself.

    After a failed call the link probes the published address once per call with a short timeout: a syncer that
    died stays unreachable until its restart publishes a new generation, and no thread blocks on it meanwhile."""

    def __init__(self, coordinator_address: str, on_connect=None):
        self.coordinator = connect(coordinator_address, STORE_TIMEOUT_S)
        self.store = None
        self.generation = -1
        self.on_connect = on_connect

    def current(self):
        """The store of the newest syncer (reconnecting if it changed); None while none is reachable."""
        published = read_syncer(self.coordinator)
        if published is None:
            return None
        address, generation = published
        if generation != self.generation or self.store is None:
            failed_before = generation == self.generation
            try:
                store = connect(address, PROBE_TIMEOUT_S if failed_before else STORE_TIMEOUT_S)
            except Exception:  # not listening (yet, or any more)
                return None
            if failed_before:
                store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
            self.store, self.generation = store, generation
            if self.on_connect is not None:
                self.on_connect(self.store)
        return self.store

    def drop(self) -> None:
        self.store = None


@dataclass
class Delta:
    fragment: int
    step: int
    tokens: int
    base: Version
    data: torch.Tensor  # float32, CPU, flat

    def absorb(self, newer: "Delta") -> None:
        """A later delta of the same fragment queued behind this one: progress adds up, nothing is dropped."""
        self.data += newer.data
        self.tokens += newer.tokens
        self.step = newer.step


class DeltaSender:
    """The send thread: deltas leave the training thread as CPU copies and reach the syncer in pieces. While the
    syncer is unreachable, deltas of a fragment queue up as one (summed), so the queue holds at most F entries."""

    def __init__(self, coordinator_address: str, *, learner: int, incarnation: int, position: int):
        self.learner, self.incarnation, self.position = learner, incarnation, position
        self.link = SyncerLink(coordinator_address, on_connect=self._hello)
        self.queue: dict[int, Delta] = {}
        self.sending = False
        self.sent = 0
        self.number = 0
        self.numbered_for = -1  # the syncer generation ``number`` counts for
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="titan-recover-diloco-send", daemon=True)
        self.thread.start()

    def _hello(self, store) -> None:
        if self.link.generation != self.numbered_for:  # a new syncer store: numbering restarts
            self.number, self.numbered_for = 0, self.link.generation
        store.set(DilocoKeys.hello(self.learner, self.position), str(self.incarnation))

    def submit(self, delta: Delta) -> None:
        with self.cond:
            queued = self.queue.get(delta.fragment)
            if queued is None:
                self.queue[delta.fragment] = delta
            else:
                queued.absorb(delta)
            self.cond.notify_all()

    def pending(self) -> int:
        with self.cond:
            return len(self.queue) + int(self.sending)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                fragment = next(iter(self.queue))  # the oldest fragment first
                delta = self.queue.pop(fragment)
                self.sending = True
            try:
                self._send(delta)
                with self.cond:
                    self.sent += 1
            except Exception as error:  # the syncer is down or restarting: keep the delta, try again
                logger.warning("learner %d position %d: delta of fragment %d not sent (%s); retrying", self.learner,
                               self.position, fragment, error)
                self.link.drop()
                with self.cond:
                    newer = self.queue.pop(fragment, None)
                    if newer is not None:
                        delta.absorb(newer)
                    self.queue = {fragment: delta, **self.queue}
                time.sleep(RETRY_S)
            finally:
                with self.cond:
                    self.sending = False
                    self.cond.notify_all()

    def _send(self, delta: Delta) -> None:
        store = self.link.current()
        if store is None:
            raise ConnectionError("no syncer published yet")
        prefix = DilocoKeys.delta(self.learner, self.incarnation, self.position, self.number)
        nbytes = put_blob(store, prefix, bytes_view(delta.data))
        store.set(DilocoKeys.meta(prefix), json.dumps({
            "fragment": delta.fragment, "step": delta.step, "tokens": delta.tokens, "base": list(delta.base),
            "bytes": nbytes, "sent_at": time.time()}))
        self.number += 1

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued delta is sent; False if that did not happen within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.queue or self.sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.1))
        return True

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=STORE_TIMEOUT_S)


class GlobalPuller:
    """The pull thread: fetches every newer global fragment of this position into ``ready``."""

    def __init__(self, coordinator_address: str, *, position: int, fragments: int):
        self.position = position
        self.link = SyncerLink(coordinator_address)
        self.fetched: list[Version] = [(-1, -1)] * fragments
        self.ready: dict[int, tuple[Version, torch.Tensor]] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="titan-recover-diloco-pull", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._poll()
            except Exception as error:  # the syncer is down or a version was replaced while read: try again
                logger.debug("position %d: pull failed (%s)", self.position, error)
                self.link.drop()
                self._stop.wait(RETRY_S)

    def _poll(self) -> None:
        store = self.link.current()
        if store is None or not store.check([DilocoKeys.VERSIONS]):
            return
        generation, versions = decode_versions(store.get(DilocoKeys.VERSIONS))
        for fragment, version in enumerate(versions):
            if (generation, version) <= self.fetched[fragment]:
                continue
            prefix = DilocoKeys.fragment(fragment, self.position, version)
            if not store.check([DilocoKeys.meta(prefix)]):  # already replaced by a newer one: next poll
                continue
            nbytes = int(store.get(DilocoKeys.meta(prefix)))
            data = get_blob(store, prefix, nbytes).view(torch.float32).clone()
            with self.lock:
                self.ready[fragment] = ((generation, version), data)
                self.fetched[fragment] = (generation, version)

    def newest(self) -> dict[int, tuple[Version, torch.Tensor]]:
        with self.lock:
            return dict(self.ready)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=STORE_TIMEOUT_S)


def offer_parameters(store, learner: int, position: int, names: list[str], tensors: list[torch.Tensor],
                     ranges: list[tuple[int, int]], global_shapes: list[list[int]] | None = None) -> None:
    """Offer this position's parameters (its local shards) as the initial global model (the syncer takes the first
    learner whose every position offered). ``global_shapes``: the whole parameters' shapes, if sharded."""
    payload = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    prefix = DilocoKeys.init(learner, position)
    nbytes = put_blob(store, prefix, bytes_view(payload))
    shapes = [list(t.shape) for t in tensors]
    store.set(DilocoKeys.meta(prefix), json.dumps({
        "bytes": nbytes, "names": names, "shapes": shapes, "ranges": ranges,
        "global_shapes": global_shapes or shapes}))


def _set_once(store, key: str, who: str) -> bool:
    """Compare-and-set on an absent key: True for the one call whose value landed (each call writes a value of
    its own, so a caller that already holds the key does not take it again)."""
    token = f"{who}/{uuid.uuid4().hex}"
    return store.compare_set(key, "", token) == token.encode()


def requeue_block(coordinator, learner: int, who: str) -> int | None:
    """Give back the block a dead learner was training, unless it finished it or someone gave it back already;
    returns the block given back. The syncer (on losing the learner) and the learner's restart both try."""
    if not coordinator.check([DilocoKeys.block(learner)]):
        return None
    block, _ = coordinator.get(DilocoKeys.block(learner)).decode().split()
    if block == "done" or not _set_once(coordinator, DilocoKeys.requeued_of(int(block)), who):
        return None
    number = coordinator.add(DilocoKeys.REQUEUED, 1) - 1
    coordinator.set(DilocoKeys.requeue(number), block)
    return int(block)


def claim_requeued(coordinator, who: str) -> int | None:
    """Take a block given back by a dead learner, if any is free."""
    for number in range(coordinator.add(DilocoKeys.REQUEUED, 0)):
        key = DilocoKeys.requeue(number)
        if coordinator.check([key]) and _set_once(coordinator, DilocoKeys.requeue_owner(number), who):
            return int(coordinator.get(key))
    return None


def _encode(version: Version) -> int:
    return -1 if version[1] < 0 else version[0] * (1 << 32) + version[1]


class Learner:
    """One rank of a learner: its fragments, marks, data blocks, and the two threads."""

    def __init__(self, trainer, member, events, *, learner: int, learners: int, incarnation: int,
                 coordinator_address: str):
        config = trainer.config
        self.config = config.recover.diloco
        self.trainer, self.member, self.events = trainer, member, events
        self.learner, self.learners, self.incarnation = learner, learners, incarnation
        self.position = torch.distributed.get_rank()
        self.positions = torch.distributed.get_world_size()
        self.period = self.config.inner_steps
        self.params = [p for m in trainer.model_parts for p in m.parameters()]
        self.names = parameter_names(trainer.model_parts)
        local = [local_tensor(p.data) for p in self.params]
        self.ranges = split_fragments([t.numel() for t in local], self.config.fragments)
        self.fragments = len(self.ranges)
        self.marks = [self._flat(f).clone() for f in range(self.fragments)]
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

    # ---- tensors -----------------------------------------------------------------------------------------
    def _locals(self, fragment: int) -> list[torch.Tensor]:
        start, end = self.ranges[fragment]
        return [local_tensor(p.data) for p in self.params[start:end]]

    def _flat(self, fragment: int) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float() for t in self._locals(fragment)])

    def _write(self, fragment: int, flat: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for t in self._locals(fragment):
                t.copy_(flat[at : at + t.numel()].view_as(t).to(t.dtype))
                at += t.numel()

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
            offer_parameters(store, self.learner, self.position, self.names,
                             [local_tensor(p.data) for p in self.params], self.ranges,
                             global_shapes=[list(p.shape) for p in self.params])
        while not all(v[1] >= 0 for v in self.adopted):
            self.adopt_ready()
            if not all(v[1] >= 0 for v in self.adopted):
                self._wait(deadline, "the global model from the syncer")
        given_back = None
        if self.coordinator.check([DilocoKeys.block(self.learner)]):  # a restart: continue the step count
            self.trainer.step = int(self.coordinator.get(DilocoKeys.block(self.learner)).split()[1])
            if self.position == 0:  # the block the previous start was training goes back to the pool
                given_back = requeue_block(self.coordinator, self.learner, self.who)
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
        if self.position == 0:
            block = claim_requeued(self.coordinator, self.who)
            if block is None:
                block = self.coordinator.add(DilocoKeys.NEXT_BLOCK, 1) - 1
            if block < self.blocks:
                self.coordinator.set(DilocoKeys.block(self.learner), f"{block} {self.trainer.step}")
                self.events.emit("block_claimed", console=False, block=block, step=self.trainer.step,
                                 incarnation=self.incarnation)
            if self.positions > 1:
                self.coordinator.set(DilocoKeys.claim(self.learner, self.incarnation, self.claims), str(block))
        else:
            block = int(self.coordinator.get(DilocoKeys.claim(self.learner, self.incarnation, self.claims)))
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
        for f in due_fragments(step, self.fragments, self.period):
            self.send(f, step)
        self.adopt_ready()
        if self.position == 0:  # the block is trained
            self.coordinator.set(DilocoKeys.block(self.learner), f"done {step}")
            if _set_once(self.coordinator, DilocoKeys.done_of(self.block), self.who):
                self.coordinator.add(DilocoKeys.BLOCKS_DONE, 1)

    def send(self, fragment: int, step: int) -> None:
        flat = self._flat(fragment)
        delta = (self.marks[fragment] - flat).cpu()
        self.marks[fragment].copy_(flat)
        self.sender.submit(Delta(fragment, step, self.tokens_since[fragment], self.adopted[fragment], delta))
        self.tokens_since[fragment] = 0

    def adopt_ready(self) -> None:
        ready = self.puller.newest()
        codes = [_encode(ready[f][0]) if f in ready else -1 for f in range(self.fragments)]
        if self.positions > 1:  # adopt a version only once every rank of the learner holds it
            agreed = torch.tensor(codes + [-c for c in codes], dtype=torch.int64, device=self.trainer.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
            highest, lowest = agreed[: self.fragments].tolist(), [-c for c in agreed[self.fragments :].tolist()]
            same = [hi == lo for hi, lo in zip(highest, lowest)]
        else:
            same = [True] * self.fragments
        for f in range(self.fragments):
            if not same[f] or codes[f] <= _encode(self.adopted[f]):
                continue
            version, global_flat = ready[f]
            global_flat = global_flat.to(self.trainer.device)
            if global_flat.numel() != self.marks[f].numel():
                raise RuntimeError(f"learner {self.learner} position {self.position}: global fragment {f} has "
                                   f"{global_flat.numel()} elements, this rank holds {self.marks[f].numel()} "
                                   "(a different model or sharding than the syncer's)")
            self._write(f, global_flat + (self._flat(f) - self.marks[f]))
            self.marks[f].copy_(global_flat)
            self.adopted[f] = version
            self.adoptions += 1

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
    (the syncer reads them), then :meth:`Learner.start`. Sets ``trainer.chaos`` and ``trainer.learner``."""
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
