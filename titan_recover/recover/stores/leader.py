"""Leader election on the job's etcd store, for a standby coordinator.

The leader of a role is the candidate whose identity is in the role's key (``store.get(key)`` names it). A
candidate creates the key only if it is absent, bound to a lease of ``ttl_s`` seconds that a keepalive thread
refreshes every ``ttl_s / 3``. If the leader stops (killed, partitioned, stalled), its lease expires ``ttl_s``
after the last refresh, etcd deletes the key at its next check of expired leases (every 500 ms), and a waiting
candidate, watching the key, creates it then.

A refresh that fails (no answer from any member within ``ttl_s / 3`` in all, or the lease is gone) sets ``lost``:
at most ``2/3 ttl_s`` after the last refresh that succeeded, so before etcd can let another candidate in (if the
two clocks run at the same rate). ``term`` (the revision at which a leader took the key, larger for every later
leader) lets writes be fenced by whoever reads them. etcd3gw's ``Lease`` refreshes and revokes the lease (the
grant is posted directly, to learn the TTL granted); its ``Lock`` is not used: it keeps locks under a fixed
``/locks/`` prefix rather than the job's, grants a new lease at every attempt, neither waits nor keeps its lease
alive.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from datetime import timedelta

from titan_recover.recover.stores.etcd import (EtcdCluster, EtcdStore, first_kv, if_absent, put_op,
                                               read_op, REARM_S)

logger = logging.getLogger(__name__)


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
        self._cluster = store.cluster
        self._refresher = EtcdCluster(store.cluster.endpoints, ttl_s / 3 / len(store.cluster.endpoints))
        self.lost = threading.Event()
        """Set when the lease could not be refreshed (or was revoked): this candidate may no longer lead."""
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
        granted = self._cluster.call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": self.ttl_s, "ID": 0}))
        self._lease, self.ttl_s = int(granted["ID"]), int(granted["TTL"])
        self._stop.clear()
        self._keepalive = threading.Thread(target=self._keep_alive, name=f"lease-{self.key}", daemon=True)
        self._keepalive.start()

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                left = self._refresher.call(lambda c: self._lease_of(c).refresh())
            except Exception as e:  # noqa: BLE001 - any failure means the lease may expire unrefreshed
                left, reason = -1, str(e)
            else:
                reason = "the lease is gone (expired or revoked)"
            if left <= 0:
                logger.warning("%s: lost the lease of %s: %s", self.identity, self.key, reason)
                self.lost.set()
                return
