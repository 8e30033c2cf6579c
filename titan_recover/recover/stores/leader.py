"""Leader election on the job's etcd store, for a standby coordinator.

The leader of a role is the candidate whose identity is in the role's key (``store.get(key)`` names it). A
candidate creates the key only if it is absent, bound to a lease of ``ttl_s`` seconds that a keepalive thread
refreshes every ``ttl_s / 3``. If the leader stops (killed, partitioned, stalled), its lease expires ``ttl_s``
after the last refresh, etcd deletes the key at its next check of expired leases (every 500 ms), and a waiting
candidate, watching the key, creates it then.

The keepalive refreshes every ``ttl_s / 4`` and retries a refresh that failed (no answer, a connection refused)
until ``3/4 ttl_s`` after the last refresh that succeeded was sent; with no success by then, or when etcd answers
that the lease is gone, it sets ``lost``: before etcd can let another candidate in (the lease lives at least
``ttl_s`` from that send, if the two clocks run at the same rate), with ``ttl_s / 4`` left for the holder to stop.
A single slow answer (a loaded machine, an etcd busy syncing its log) therefore costs nothing while a later try
gets through in time. ``term`` (the revision at which a leader took the key, larger for every later
leader) fences the leader's writes: :meth:`LeaderElection.fenced` gives a store whose every write is a transaction
that applies only while the key still has that create revision (etcd's own election recipe, ``Proclaim``, guards
the leader's writes the same way), so a deposed leader that runs on (paused past its lease, its keepalive not yet
aware) writes nothing and gets :class:`~.etcd.NotLeader` instead. etcd3gw's ``Lease`` revokes the lease (the grant and
the keepalive are posted directly: to learn the TTL granted, and to bound each refresh by the time left); its ``Lock`` is not used: it keeps locks under a fixed
``/locks/`` prefix rather than the job's, grants a new lease at every attempt, neither waits nor keeps its lease
alive.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from datetime import timedelta

from titan_recover.recover.stores.etcd import (EtcdCluster, EtcdStore, Fence, first_kv, if_absent, put_op,
                                               read_op, REARM_S)

logger = logging.getLogger(__name__)

REFRESH_EVERY = 1 / 4
"""The keepalive refreshes the lease this fraction of its TTL after the last refresh that succeeded."""
LOST_AFTER = 3 / 4
"""...and gives up (``lost``) this fraction of the TTL after that refresh was sent (etcd keeps the lease a whole
TTL after it received it)."""
RETRY_S = 0.05
"""Pause between tries of a refresh that failed at once (a refused connection)."""


class LeaderElection:
    """One candidate for the role held in ``key`` of ``store`` (an :class:`EtcdStore`), as ``identity``.

    ``ttl_s`` is the lease's time to live in whole seconds; etcd raises a shorter one to its minimum (1.5 x its
    election timeout: 2 s with etcd's defaults), and ``ttl_s`` then holds the granted one.
    """

    def __init__(self, store: EtcdStore, key: str, identity: str, *, ttl_s: int = 2):
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be at least 1 s, got {ttl_s}")
        self.key, self.identity, self.ttl_s = key, identity, ttl_s
        self._key = store.etcd_key(key)
        self._store = store
        self._cluster = store.cluster
        self._refresher = EtcdCluster(store.cluster.endpoints, ttl_s * LOST_AFTER)
        self.lost = threading.Event()
        """Set when the lease could not be refreshed (or was revoked): this candidate may no longer lead."""
        self.lost_reason = ""
        """Why ``lost`` was set."""
        self._granted_at = 0.0
        self.term: int | None = None
        """The etcd revision at which this candidate took the key; None until it leads."""
        self._lease: int | None = None
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None

    @property
    def lease(self) -> int | None:
        """The id of this candidate's lease; None before it campaigns and after it resigns."""
        return self._lease

    @property
    def is_leader(self) -> bool:
        return self.term is not None and not self.lost.is_set()

    def fenced(self) -> EtcdStore:
        """A client of the election's store whose every write applies only while this candidate holds the key at
        its ``term`` (:class:`~.etcd.NotLeader` otherwise, nothing written); RuntimeError before it leads."""
        if self.term is None:
            raise RuntimeError(f"{self.identity}: fenced() needs the leadership of {self.key}; campaign first")
        return self._store.fenced(Fence(self._key, self.term, self.identity))

    def campaign(self, timeout: timedelta = timedelta(seconds=300)) -> None:
        """Block until this candidate leads; TimeoutError (naming the leader) after ``timeout``, RuntimeError if
        the lease is lost first. The lease is granted (and kept alive) at the first call; calling again after a
        timeout goes on campaigning with it."""
        if self.lost.is_set():
            raise RuntimeError(f"{self.identity}: the lease was lost; campaign with a new LeaderElection")
        if self._lease is None:
            self._grant()
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            reply = self._cluster.txn([if_absent(self._key)], [put_op(self._key, self.identity.encode(), self._lease)],
                                      [read_op(self._key)])
            if reply.get("succeeded"):
                self.term = int(reply["header"]["revision"])
                logger.info("%s leads %s (term %d)", self.identity, self.key, self.term)
                return
            holder = first_kv(reply["responses"][0])
            if holder is not None and int(holder.get("lease", 0)) == self._lease:  # an earlier try got through
                self.term = int(holder["create_revision"])
                logger.info("%s leads %s (term %d)", self.identity, self.key, self.term)
                return
            if self.lost.is_set():
                raise RuntimeError(f"{self.identity}: the lease was lost while campaigning for {self.key}")
            left = deadline - time.monotonic()
            if left <= 0:
                held_by = base64.b64decode(holder.get("value", "")).decode() if holder else "nobody"
                raise TimeoutError(f"{self.identity}: {self.key} still held by {held_by} after {timeout}")
            if holder is not None:
                self._cluster.watch_once(self._key, int(reply["header"]["revision"]) + 1, min(left, REARM_S))

    def resign(self) -> None:
        """Stop the keepalive and revoke the lease (etcd deletes the key if this candidate held it). If etcd
        cannot be reached, the key expires with the lease instead."""
        self._stop.set()
        if self._keepalive is not None:
            self._keepalive.join()
        if self._lease is not None:
            try:
                self._cluster.call(lambda c: self._lease_of(c).revoke())
            except Exception as e:  # noqa: BLE001 - the lease expires by itself
                logger.warning("%s: could not revoke the lease of %s (%s); it expires in %d s", self.identity,
                               self.key, e, self.ttl_s)
        self._lease, self.term = None, None

    # ---- the lease -----------------------------------------------------------------------------------------
    def _lease_of(self, client):
        from etcd3gw.lease import Lease

        return Lease(self._lease, client=client)

    def _grant(self) -> None:
        self._granted_at = time.monotonic()
        granted = self._cluster.call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": self.ttl_s, "ID": 0}))
        self._lease, self.ttl_s = int(granted["ID"]), int(granted["TTL"])
        self._stop.clear()
        self._keepalive = threading.Thread(target=self._keep_alive, name=f"lease-{self.key}", daemon=True)
        self._keepalive.start()

    def _keep_alive(self) -> None:
        last_ok = self._granted_at
        while not self._stop.wait(max(0.0, last_ok + self.ttl_s * REFRESH_EVERY - time.monotonic())):
            deadline = last_ok + self.ttl_s * LOST_AFTER
            reason = "no refresh was answered"
            while True:
                sent = time.monotonic()
                if sent >= deadline:
                    self._lose(f"{reason}, {self.ttl_s * LOST_AFTER:.1f} s after the last one that was")
                    return
                try:
                    left = self._refresher.call(lambda c: self._refresh(c, (deadline - sent) / len(self._refresher.endpoints)))
                except Exception as e:  # noqa: BLE001 - tried again until the deadline
                    reason = f"no refresh was answered (the last try: {e})"
                    if self._stop.wait(min(RETRY_S, max(0.0, deadline - time.monotonic()))):
                        return
                    continue
                if left <= 0:
                    self._lose("the lease is gone (expired or revoked)")
                    return
                last_ok = sent
                break

    def _refresh(self, client, timeout_s: float) -> int:
        """One keepalive of the lease, answered within ``timeout_s``: the TTL left (-1: the lease is gone)."""
        reply = client.session.post(client.get_url("/lease/keepalive"), json={"ID": self._lease}, timeout=timeout_s)
        reply.raise_for_status()
        return int(reply.json()["result"].get("TTL", -1))

    def _lose(self, reason: str) -> None:
        logger.warning("%s: lost the lease of %s: %s", self.identity, self.key, reason)
        self.lost_reason = reason
        self.lost.set()
