"""A learner's transport to the syncer (docs/diloco.md, "A learner"): threads that never block training.

* :class:`SyncerLink`: a thread's connection to the current syncer, found through the coordinator's store and
  re-established when a restarted syncer publishes a new generation;
* :class:`DeltaSender`: the send thread; a fragment's deltas queue up as one while the syncer is unreachable;
* :class:`GlobalPuller`: the pull thread, fetching every newer global fragment of its rank.
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
from titan_recover.recover.stores import connect

logger = logging.getLogger(__name__)

POLL_S = 0.05
RETRY_S = 0.5
STORE_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 1.0


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

    def __init__(self, coordinator_address: str, *, learner: int, incarnation: int, rank: int):
        self.learner, self.incarnation, self.rank = learner, incarnation, rank
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
                logger.warning("learner %d rank %d: delta of fragment %d not sent (%s); retrying", self.learner,
                               self.rank, fragment, error)
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
        write_delta(store, self.learner, self.incarnation, self.rank, self.number, fragment=delta.fragment,
                    step=delta.step, tokens=delta.tokens, base=delta.base, data=delta.data)
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
    """The pull thread: fetches every newer global fragment of this rank into ``ready``."""

    def __init__(self, coordinator_address: str, *, rank: int, fragments: int):
        self.rank = rank
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
                logger.debug("rank %d: pull failed (%s)", self.rank, error)
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
            data = read_fragment(store, fragment, self.rank, version)
            if data is None:  # already replaced by a newer one: next poll
                continue
            with self.lock:
                self.ready[fragment] = ((generation, version), data)
                self.fetched[fragment] = (generation, version)

    def newest(self) -> dict[int, tuple[Version, torch.Tensor]]:
        with self.lock:
            return dict(self.ready)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=STORE_TIMEOUT_S)
