"""A learner's transport to the syncer (docs/diloco.md, "A learner"): threads that never block training.

* :class:`SyncerLink`: a thread's connection to the current syncer, found through the coordinator's store and
  re-established when a restarted syncer publishes a new generation;
* :class:`DeltaSender`: the send thread; a fragment's deltas queue up as one while the syncer is unreachable;
* :class:`GlobalPuller`: the pull thread, fetching every newer global fragment of its rank;
* :class:`StuckWatch`: for each of the two, the thread that replaces it when it is stuck on a syncer that a newer
  one replaced (a call to a stopped store server blocks for as long as TCP allows, whatever the store's timeout).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from titan_recover.recover.diloco.messages import announce_sender, read_fragment, write_delta
from titan_recover.recover.diloco.rules import decode_versions, DilocoKeys, Version
from titan_recover.recover.stores import connect, read_keys

logger = logging.getLogger(__name__)

POLL_S = 0.05
RETRY_S = 0.5
STORE_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 1.0
STUCK_S = 2.0
"""A send or a pull that has not returned for this long, while a newer syncer than the one it talks to is published,
is abandoned (:class:`StuckWatch`): about the time a standby takes to lead after the syncer stopped."""
WATCH_S = 0.25


def read_syncer(coordinator) -> tuple[str, int] | None:
    """The syncer's ``(HOST:PORT, generation)`` as published in the coordinator's store, or None."""
    published = read_keys(coordinator, [DilocoKeys.SYNCER])[0]
    if published is None:
        return None
    address, generation = published.decode().split()
    return address, int(generation)


class SyncerLink:
    """One thread's connection to the current syncer, re-established when a restarted syncer publishes itself.

    After a failed call the link probes the published address once per call with a short timeout: a syncer that
    died stays unreachable until its restart publishes a new generation, and no thread blocks on it meanwhile."""

    def __init__(self, coordinator_address: str, on_connect=None):
        self.coordinator = connect(coordinator_address, STORE_TIMEOUT_S)
        self.store = None
        self.generation = -1
        """The generation of the syncer whose store ``store`` is."""
        self.target = -1
        """The generation this link talks to, or is connecting to (a connection can block on a stopped syncer)."""
        self.on_connect = on_connect

    def current(self):
        """The store of the newest syncer (reconnecting if it changed); None while none is reachable."""
        published = read_syncer(self.coordinator)
        if published is None:
            return None
        address, generation = published
        if generation != self.generation or self.store is None:
            failed_before = generation == self.generation
            self.target = generation
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


def _started(run, worker: int, name: str) -> threading.Thread:
    """A daemon thread running ``run(worker)``, started."""
    thread = threading.Thread(target=run, args=(worker,), name=name, daemon=True)
    thread.start()
    return thread


class StuckWatch:
    """A thread that watches one worker thread of a learner's transport. ``state()`` gives (since when the worker
    has been in a call to the syncer's store, None when it is not; the syncer generation its link talks to). Once
    the worker has been in one call for :data:`STUCK_S` and a newer generation than the one it talks to (its link's
    ``target``) is published, ``abandon(stuck_on, published)`` replaces the worker (which must touch nothing if
    its call ever returns).

    Why: a call to a store whose server is stopped (SIGSTOP, or a partitioned node) blocks for as long as TCP
    allows: with torch's TCPStore a ``get``, a ``check`` and a 4 MB ``set`` to a stopped server all block past the
    store's timeout."""

    def __init__(self, coordinator_address: str, state, abandon, name: str):
        self.coordinator_address, self.state, self.abandon = coordinator_address, state, abandon
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        coordinator = None
        while not self._stop.wait(WATCH_S):
            since, generation = self.state()
            if since is None or time.monotonic() - since <= STUCK_S:
                continue
            try:
                coordinator = coordinator or connect(self.coordinator_address, STORE_TIMEOUT_S)
                published = read_syncer(coordinator)
            except Exception as error:  # noqa: BLE001 - the job's store unreachable: look again later
                logger.debug("syncer not read (%s)", error)
                coordinator, published = None, None
            if published is not None and published[1] > generation:
                self.abandon(generation, published[1])

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=STORE_TIMEOUT_S)


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
    syncer is unreachable, deltas of a fragment queue up as one (summed), so the queue holds at most F entries.

    A send stuck on a syncer that a newer one replaced is abandoned (:class:`StuckWatch`): its delta goes back to
    the queue and a new send thread with a new link delivers it to the newer syncer."""

    def __init__(self, coordinator_address: str, *, learner: int, incarnation: int, rank: int):
        self.coordinator_address = coordinator_address
        self.learner, self.incarnation, self.rank = learner, incarnation, rank
        self.link = SyncerLink(coordinator_address, on_connect=self._hello)
        self.queue: dict[int, Delta] = {}
        self.inflight: Delta | None = None
        """The delta the send thread is sending, and since when (``sending_since``)."""
        self.sending_since = 0.0
        self.sent = 0
        self.abandoned = 0
        """Send threads abandoned, each stuck on a syncer that a newer one replaced."""
        self.number = 0
        self.numbered_for = -1  # the syncer generation ``number`` counts for
        self.worker = 0
        """The current send thread's number: a thread with an older one was abandoned and must touch nothing."""
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = _started(self._run, self.worker, "titan-recover-diloco-send")
        self.watch = StuckWatch(coordinator_address, self._state, self._abandon, "titan-recover-diloco-send-watch")

    def _hello(self, store) -> None:
        if self.link.generation != self.numbered_for:  # a new syncer store: numbering restarts
            self.number, self.numbered_for = 0, self.link.generation
        announce_sender(store, self.learner, self.rank, self.incarnation)

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
            return len(self.queue) + int(self.inflight is not None)

    def _requeue(self, delta: Delta) -> None:
        """Put ``delta`` back at the head of the queue, absorbing a newer one of its fragment (under ``cond``)."""
        newer = self.queue.pop(delta.fragment, None)
        if newer is not None:
            delta.absorb(newer)
        self.queue = {delta.fragment: delta, **self.queue}

    def _run(self, worker: int) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopped and worker == self.worker:
                    self.cond.wait()
                if self.stopped or worker != self.worker:
                    return
                delta = self.queue.pop(next(iter(self.queue)))  # the oldest fragment first
                self.inflight, self.sending_since, link = delta, time.monotonic(), self.link
            try:
                self._send(link, delta, worker)
            except Exception as error:  # the syncer is down or restarting: keep the delta, try again
                with self.cond:
                    if worker != self.worker:
                        return
                    self.inflight = None
                    self._requeue(delta)
                    self.cond.notify_all()
                logger.warning("learner %d rank %d: delta of fragment %d not sent (%s); retrying", self.learner,
                               self.rank, delta.fragment, error)
                link.drop()
                time.sleep(RETRY_S)
                continue
            with self.cond:
                if worker != self.worker:
                    return
                self.inflight = None
                self.sent += 1
                self.cond.notify_all()

    def _send(self, link: SyncerLink, delta: Delta, worker: int) -> None:
        store = link.current()
        if store is None:
            raise ConnectionError("no syncer published yet")
        with self.cond:
            number = self.number
        write_delta(store, self.learner, self.incarnation, self.rank, number, fragment=delta.fragment,
                    step=delta.step, tokens=delta.tokens, base=delta.base, data=delta.data)
        with self.cond:
            if worker == self.worker:
                self.number = number + 1

    def _state(self) -> tuple[float | None, int]:
        with self.cond:
            return (self.sending_since if self.inflight is not None else None), self.link.target

    def _abandon(self, stuck_on: int, published: int) -> None:
        link = SyncerLink(self.coordinator_address, on_connect=self._hello)  # connects: not under the lock
        with self.cond:  # the training thread's submit takes it
            if self.inflight is None or self.link.target != stuck_on:
                return  # it returned meanwhile
            delta, self.inflight = self.inflight, None
            # a copy: the abandoned thread may still be reading the original's bytes
            self._requeue(Delta(delta.fragment, delta.step, delta.tokens, delta.base, delta.data.clone()))
            self.worker += 1
            self.abandoned += 1
            self.link = link
            self.thread = _started(self._run, self.worker, "titan-recover-diloco-send")
            self.cond.notify_all()
        logger.warning("learner %d rank %d: a delta send to syncer %d has not returned for %.0f s and syncer %d is "
                       "published: sending to it from a new thread", self.learner, self.rank, stuck_on, STUCK_S,
                       published)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued delta is sent; False if that did not happen within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.queue or self.inflight is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.1))
        return True

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
            thread = self.thread
        thread.join(timeout=STORE_TIMEOUT_S)
        self.watch.stop()


class GlobalPuller:
    """The pull thread: fetches every newer global fragment of this rank into ``ready``. A pull stuck on a syncer
    that a newer one replaced is abandoned (:class:`StuckWatch`): a new pull thread with a new link reads the newer
    syncer."""

    def __init__(self, coordinator_address: str, *, rank: int, fragments: int):
        self.coordinator_address, self.rank = coordinator_address, rank
        self.link = SyncerLink(coordinator_address)
        self.fetched: list[Version] = [(-1, -1)] * fragments
        self.ready: dict[int, tuple[Version, torch.Tensor]] = {}
        self.lock = threading.Lock()
        self.polling_since: float | None = None
        self.worker = 0
        """The current pull thread's number: a thread with an older one was abandoned and must touch nothing."""
        self.abandoned = 0
        self._stop = threading.Event()
        self.thread = _started(self._run, self.worker, "titan-recover-diloco-pull")
        self.watch = StuckWatch(coordinator_address, self._state, self._abandon, "titan-recover-diloco-pull-watch")

    def _run(self, worker: int) -> None:
        while not self._stop.wait(POLL_S):
            with self.lock:
                if worker != self.worker:
                    return
                self.polling_since, link = time.monotonic(), self.link
            try:
                self._poll(link, worker)
            except Exception as error:  # the syncer is down or a version was replaced while read: try again
                logger.debug("rank %d: pull failed (%s)", self.rank, error)
                link.drop()
                self._stop.wait(RETRY_S)
            finally:
                with self.lock:
                    if worker == self.worker:
                        self.polling_since = None

    def _poll(self, link: SyncerLink, worker: int) -> None:
        store = link.current()
        if store is None or not store.check([DilocoKeys.VERSIONS]):
            return
        generation, versions = decode_versions(store.get(DilocoKeys.VERSIONS))
        for fragment, version in enumerate(versions):
            if (generation, version) <= self.fetched[fragment]:
                continue
            data = read_fragment(store, fragment, self.rank, version)
            if data is None:  # already replaced by a newer one: next poll
                continue
            with self.lock:
                if worker != self.worker:
                    return
                self.ready[fragment] = ((generation, version), data)
                self.fetched[fragment] = (generation, version)

    def _state(self) -> tuple[float | None, int]:
        with self.lock:
            return self.polling_since, self.link.target

    def _abandon(self, stuck_on: int, published: int) -> None:
        link = SyncerLink(self.coordinator_address)  # connects: not under the lock the training thread's newest takes
        with self.lock:
            if self.polling_since is None or self.link.target != stuck_on:
                return  # it returned meanwhile
            self.polling_since = None
            self.worker += 1
            self.abandoned += 1
            self.link = link
            self.thread = _started(self._run, self.worker, "titan-recover-diloco-pull")
        logger.warning("rank %d: a pull from syncer %d has not returned for %.0f s and syncer %d is published: "
                       "pulling from it in a new thread", self.rank, stuck_on, STUCK_S, published)

    def newest(self) -> dict[int, tuple[Version, torch.Tensor]]:
        with self.lock:
            return dict(self.ready)

    def stop(self) -> None:
        self._stop.set()
        with self.lock:
            thread = self.thread
        thread.join(timeout=STORE_TIMEOUT_S)
        self.watch.stop()
