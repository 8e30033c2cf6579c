"""A c10d Store over etcd's v3 API, reached through etcd's HTTP gateway with the ``etcd3gw`` client.

:class:`EtcdStore` keeps the semantics the project relies on from ``TCPStore`` (pinned by tests/test_stores.py,
which runs one contract against both): ``get`` and ``wait`` block until the keys exist or the store's timeout
passes, then raise :class:`torch.distributed.DistStoreError`; ``add`` is atomic and starts a missing key at 0;
``compare_set`` answers exactly as TCPStore does. A ``PrefixStore`` over it backs a gloo process group.

torch ships ``torch.distributed.elastic.rendezvous.etcd_store.EtcdStore``, but it speaks etcd's v2 API
(python-etcd): etcd 3.4 serves v2 only with ``--enable-v2`` and etcd 3.6 removed it. This one speaks v3 (needs
etcd >= 3.4, whose gateway is at ``/v3/``). etcd3gw is a plain HTTP/JSON client (requests), so there is no gRPC
dependency.

Every key lives under the store's ``prefix`` (one per job, e.g. ``/titan_recover/<job>/``). A blocked ``get`` or
``wait`` reads the keys and, while one is missing, watches it from the revision of that read (nothing written in
between is missed); each watch is re-armed after :data:`REARM_S`, so a watch the server cancelled or a stream that
broke silently delays a wake-up by at most that. Requests go to one member of the cluster; one that cannot reach
it moves to the next member (:class:`EtcdCluster`), except an ``add`` that may have reached it. etcd refuses a
request above its ``--max-request-bytes`` (1.5 MiB by default): such a ``set`` raises :class:`DistStoreError`.

A store can be **fenced** (:class:`Fence`, :meth:`EtcdStore.fenced`): each of its writes is then a transaction that
applies only while a leader key still has the create revision its holder took it at (etcd's election recipe:
``Compare(CreateRevision(leaderKey), "=", leaderRev)``), and raises :class:`NotLeader` otherwise, writing nothing.
:meth:`EtcdStore.delete_keys` deletes keys and whole key prefixes in one transaction (the protocol's collection of
keys nobody can read any more, docs/deploy.md "Keys deleted").
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import DistNetworkError, DistStoreError, Store

API_PATH = "/v3/"
"""Where etcd >= 3.4 serves the v3 gateway (3.3 served ``/v3beta/``)."""
REARM_S = 5.0
"""A blocked read's watch is re-armed (the keys read again) at least this often."""
MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: reads and ``multi_set`` go in transactions of at most this many keys."""

T = TypeVar("T")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


# ---- the pieces of a transaction (the gateway's JSON: keys and values in base64) ------------------------------
def read_op(key: bytes) -> dict:
    return {"request_range": {"key": _b64(key)}}


def put_op(key: bytes, value: bytes, lease: int | None = None) -> dict:
    put = {"key": _b64(key), "value": _b64(value)}
    return {"request_put": put | ({"lease": lease} if lease else {})}


def delete_op(key: bytes, prefix: bool = False) -> dict:
    """Delete ``key``, or with ``prefix`` every key that starts with it."""
    return {"request_delete_range": {"key": _b64(key)} | ({"range_end": _b64(prefix_end(key))} if prefix else {})}


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of every key that starts with ``prefix`` (etcd's ``range_end``)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def if_absent(key: bytes) -> dict:
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}


def if_holds(key: bytes, value: bytes) -> dict:
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}


def if_unchanged(key: bytes, mod_revision: int) -> dict:
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


def if_created_at(key: bytes, create_revision: int) -> dict:
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": create_revision}


def first_kv(response: dict) -> dict | None:
    """The key-value record a transaction's range read (value base64, revisions as strings), or None if absent."""
    kvs = response["response_range"].get("kvs", [])
    return kvs[0] if kvs else None


def kv_of(response: dict) -> tuple[bytes, int] | None:
    """``(value, mod_revision)`` of the key a transaction's range read, or None if it is absent."""
    kv = first_kv(response)
    return None if kv is None else (base64.b64decode(kv.get("value", "")), int(kv["mod_revision"]))


class NotLeader(RuntimeError):
    """A fenced store's write was refused: the leader key it is fenced by is no longer held at its term (another
    candidate leads, or the lease lapsed). Nothing was written; the writer has lost the role and must stop."""


@dataclass(frozen=True)
class Fence:
    """The leader key (its full etcd key) and the create revision (``term``) its holder took it at: a fenced
    store's writes apply only while the key still has that create revision."""

    key: bytes
    term: int
    holder: str = ""
    """Who took the key at ``term`` (for messages)."""

    def compare(self) -> dict:
        return if_created_at(self.key, self.term)


class EtcdCluster:
    """Clients of one etcd cluster: one per thread (a requests session is not shared between threads), all on the
    member that last answered. ``request_timeout_s`` bounds every request (a watch: its connection)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], request_timeout_s: float = 10.0):
        if not endpoints:
            raise ValueError("an etcd cluster needs at least one HOST:PORT")
        import etcd3gw
        import requests

        self._etcd3gw, self._requests = etcd3gw, requests
        self.endpoints = tuple(endpoints)
        self.request_timeout_s = request_timeout_s
        self.unreachable = (etcd3gw.exceptions.ConnectionFailedError, etcd3gw.exceptions.ConnectionTimeoutError,
                            requests.exceptions.ConnectionError, requests.exceptions.Timeout)
        self._current = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def member(self) -> tuple[str, int]:
        """The member requests go to now."""
        return self.endpoints[self._current]

    def describe(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)

    def _client(self):
        local = self._local
        if getattr(local, "at", None) != self._current:
            if getattr(local, "client", None) is not None:
                local.client.session.close()
            host, port = self.endpoints[self._current]
            local.client = self._etcd3gw.client(host=host, port=port, timeout=self.request_timeout_s,
                                                api_path=API_PATH)
            local.at = self._current
        return local.client

    def _never_sent(self, error: Exception) -> bool:
        """Whether the request failed before reaching the member (no connection was made)."""
        import urllib3

        cause = error if isinstance(error, self._requests.RequestException) else error.__context__
        if isinstance(cause, self._requests.exceptions.ConnectTimeout):
            return True
        reason = getattr(cause.args[0], "reason", None) if cause is not None and cause.args else None
        return isinstance(reason, urllib3.exceptions.NewConnectionError)

    def call(self, op: Callable[[Any], T], *, idempotent: bool = True) -> T:
        """``op(client)`` on the current member, then once on each other member while they cannot be reached;
        :class:`DistNetworkError` naming every failure if none answered. A request that is not ``idempotent`` is
        sent elsewhere only if it never reached the member: one that failed after may have been applied."""
        failures = []
        for _ in self.endpoints:
            at = self._current
            try:
                return op(self._client())
            except self.unreachable as e:
                failures.append(f"{self.endpoints[at][0]}:{self.endpoints[at][1]}: {str(e) or type(e).__name__} "
                                f"(request timeout {self.request_timeout_s:g} s)")
                with self._lock:
                    if self._current == at:
                        self._current = (at + 1) % len(self.endpoints)
                if not idempotent and not self._never_sent(e):
                    raise DistNetworkError(f"{failures[-1]} (the request may or may not have been applied)") from e
            except self._etcd3gw.exceptions.Etcd3Exception as e:  # an answer, not a lost connection
                raise DistStoreError(f"etcd at {self.describe()} refused a request: {' '.join(map(str, e.args))}: "
                                     f"{(e.detail_text or '').strip()}") from e
        raise DistNetworkError("no etcd member answered: " + "; ".join(failures))

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] = (), *,
            idempotent: bool = True) -> dict:
        return self.call(lambda c: c.transaction({"compare": compare, "success": success, "failure": list(failure)}),
                         idempotent=idempotent)

    def watch_once(self, key: bytes, start_revision: int, timeout_s: float) -> None:
        """Return at the first change of ``key`` at or after ``start_revision``, at the end of the watch (the
        member cancelled it), or after ``timeout_s``.

        The gateway's watch stream is read here rather than through ``Etcd3Client.watch_once``, whose request has
        no timeout (a member that stops answering would hold the caller past ``timeout_s``) and which starts a
        thread pool for every watch."""
        request = {"create_request": {"key": _b64(key), "start_revision": start_revision}}

        def watch(c) -> None:
            import urllib3

            try:
                with c.session.post(c.get_url("/watch"), json=request, stream=True,
                                    timeout=(self.request_timeout_s, timeout_s)) as reply:
                    reply.raise_for_status()
                    for line in reply.iter_lines(chunk_size=None):
                        result = json.loads(line).get("result", {}) if line.strip() else {}
                        if result.get("events") or result.get("canceled"):
                            return
            except self._requests.exceptions.ReadTimeout:
                return  # no answer to the request within timeout_s
            except self._requests.exceptions.ConnectionError as e:  # how requests reports a stream's read timeout
                if not (e.args and isinstance(e.args[0], urllib3.exceptions.ReadTimeoutError)):
                    raise

        self.call(watch)


class EtcdStore(Store):
    """A c10d Store whose keys are etcd keys under ``prefix``, on the cluster of ``endpoints`` (``(host, port)``
    of its members' client URLs, plain HTTP).

    Construction waits up to ``timeout`` for a member to answer (as a TCPStore client waits for its server), then
    raises :class:`DistNetworkError`. ``timeout`` is the store's: ``get``, ``multi_get`` and ``wait`` without
    their own raise :class:`DistStoreError` after it (``set_timeout`` changes it). Values are bytes; str keys and
    values are encoded as UTF-8.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], prefix: str, *,
                 timeout: timedelta = timedelta(seconds=300), request_timeout: timedelta = timedelta(seconds=10),
                 fence: Fence | None = None):
        super().__init__()
        self.fence = fence
        """With a :class:`Fence`, every write applies only while its leader key is held at its term
        (:class:`NotLeader` otherwise); reads are not fenced."""
        if not prefix.strip("/"):
            raise ValueError(f"an etcd store needs a key prefix naming the job, got {prefix!r}")
        self.prefix = "/" + prefix.strip("/") + "/"
        self._prefix = self.prefix.encode()
        self.set_timeout(timeout)
        self.cluster = EtcdCluster(endpoints, request_timeout.total_seconds())
        self._wait_for_cluster(timeout)

    def __repr__(self) -> str:
        fenced = f", fenced by {self.fence.key.decode()!r} at term {self.fence.term}" if self.fence else ""
        return f"EtcdStore({self.cluster.describe()}, prefix={self.prefix!r}{fenced})"

    def fenced(self, fence: Fence) -> EtcdStore:
        """A client of the same keys whose writes are fenced by ``fence`` (its own connections)."""
        return EtcdStore(self.cluster.endpoints, self.prefix, timeout=self.timeout,
                         request_timeout=timedelta(seconds=self.cluster.request_timeout_s), fence=fence)

    def _write(self, compare: list[dict], success: list[dict], failure: list[dict] = (), *,
               idempotent: bool = True) -> dict:
        """A write transaction, fenced when the store is: the fence's compare joins ``compare`` and a read of the
        leader key ends ``failure``; a transaction that failed because of the fence raises :class:`NotLeader`.
        The reply's responses are those of ``success`` or ``failure`` as given (the fence's read removed)."""
        if self.fence is None:
            return self.cluster.txn(compare, success, failure, idempotent=idempotent)
        reply = self.cluster.txn([*compare, self.fence.compare()], success, [*failure, read_op(self.fence.key)],
                                 idempotent=idempotent)
        if not reply.get("succeeded"):
            holder = first_kv(reply["responses"][-1])
            if holder is None or int(holder["create_revision"]) != self.fence.term:
                now = ("nobody holds it" if holder is None else
                       f"{base64.b64decode(holder.get('value', '')).decode(errors='replace')} holds it since "
                       f"revision {holder['create_revision']}")
                raise NotLeader(f"{self!r}: write refused, {self.fence.holder or 'this writer'} no longer holds "
                                f"{self.fence.key.decode()!r} at term {self.fence.term} ({now})")
            reply["responses"] = reply["responses"][:-1]
        return reply

    def etcd_key(self, key: str | bytes) -> bytes:
        """The etcd key that holds the store's ``key``."""
        return self._prefix + _as_bytes(key)

    def _wait_for_cluster(self, timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                version = self.cluster.call(lambda c: c.status())["version"]
                break
            except DistNetworkError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            except DistStoreError as e:
                raise DistNetworkError(f"{self.cluster.describe()} does not serve etcd's v3 gateway at {API_PATH} "
                                       f"(etcd >= 3.4 does): {e}") from e
        if tuple(int(p) for p in version.split(".")[:2]) < (3, 4):
            raise DistNetworkError(f"etcd {version} at {self.cluster.describe()}: the store needs etcd >= 3.4")

    # ---- reads ---------------------------------------------------------------------------------------------
    def _read(self, keys: Sequence[str]) -> tuple[list[bytes | None], int]:
        """The keys' values (None: absent) and, if one is absent, the revision at which the first absent one was
        read (0 otherwise)."""
        values: list[bytes | None] = []
        missing_at = 0
        for at in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[at : at + MAX_TXN_OPS]
            reply = self.cluster.txn([], [read_op(self.etcd_key(k)) for k in chunk])
            read = [kv_of(r) for r in reply.get("responses", [])]
            if not missing_at and any(kv is None for kv in read):
                missing_at = int(reply["header"]["revision"])
            values += [None if kv is None else kv[0] for kv in read]
        return values, missing_at

    def _wait_values(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            values, revision = self._read(keys)
            if not revision:
                return values
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistStoreError(f"wait timeout after {round(timeout.total_seconds() * 1000)}ms, keys: "
                                     f"{', '.join(keys)} ({self!r})")
            missing = keys[values.index(None)]
            self.cluster.watch_once(self.etcd_key(missing), revision + 1, min(left, REARM_S))

    def get(self, key: str) -> bytes:
        return self._wait_values([key], self.timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_values(list(keys), self.timeout)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_values(list(keys), self.timeout if timeout is None else timeout)

    def read_present(self, keys: Sequence[str]) -> list[bytes | None]:
        """The keys' values now, None for an absent one (no waiting): one transaction per :data:`MAX_TXN_OPS`
        keys (:func:`titan_recover.recover.stores.read_keys`)."""
        return self._read(list(keys))[0]

    def check(self, keys: list[str]) -> bool:
        """True if every key exists now (no waiting)."""
        return not self._read(list(keys))[1]

    def num_keys(self) -> int:
        end = prefix_end(self._prefix)
        reply = self.cluster.call(lambda c: c.post(c.get_url("/kv/range"), json={
            "key": _b64(self._prefix), "range_end": _b64(end), "count_only": True}))
        return int(reply.get("count", 0))

    # ---- writes --------------------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        if self.fence is None:
            self.cluster.call(lambda c: c.put(self.etcd_key(key), _as_bytes(value)))
        else:
            self._write([], [put_op(self.etcd_key(key), _as_bytes(value))])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set each key; the writes of up to :data:`MAX_TXN_OPS` keys are one transaction (seen all or none)."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        latest = {self.etcd_key(k): _as_bytes(v) for k, v in zip(keys, values)}  # etcd: one write per key per txn
        puts = [put_op(k, v) for k, v in latest.items()]
        for at in range(0, len(puts), MAX_TXN_OPS):
            self._write([], puts[at : at + MAX_TXN_OPS])

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; False if it did not exist."""
        return self.delete_keys([key]) > 0

    def delete_keys(self, keys: Sequence[str] = (), prefixes: Sequence[str] = ()) -> int:
        """Delete ``keys`` and every key that starts with one of ``prefixes`` (store keys; a prefix is matched as
        text: end it with ``/`` to mean a folder). One transaction per :data:`MAX_TXN_OPS` of them. Returns how
        many keys were deleted."""
        if any(not p for p in prefixes):
            raise ValueError("delete_keys: an empty prefix would delete every key of the store")
        ops = ([delete_op(self.etcd_key(k)) for k in keys]
               + [delete_op(self.etcd_key(p), prefix=True) for p in prefixes])
        deleted = 0
        for at in range(0, len(ops), MAX_TXN_OPS):
            reply = self._write([], ops[at : at + MAX_TXN_OPS])
            deleted += sum(int(r["response_delete_range"].get("deleted", 0)) for r in reply.get("responses", []))
        return deleted

    # torch's trampoline for Python stores looks these two up by their C++ names when C++ calls them (a
    # PrefixStore over this store does); the other methods it looks up by their Python names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer in ``key`` (a missing key holds 0) and return the sum: a transaction
        that writes only if the key is unchanged since it was read, repeated until one does (bounded by the
        store's timeout). ``amount = 0`` is a read (the counters' readers call it often; every write stays in
        etcd's history until compacted): a missing key reads 0 and stays missing."""
        if amount == 0:
            value = self._read([key])[0][0]
            try:
                return 0 if value is None else int(value)
            except ValueError:
                raise ValueError(f"add: key {key!r} holds {value!r}, not an integer") from None
        full = self.etcd_key(key)
        guard, base = if_absent(full), 0
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            reply = self._write([guard], [put_op(full, str(base + amount).encode())], [read_op(full)],
                                idempotent=False)
            if reply.get("succeeded"):
                return base + amount
            current = kv_of(reply["responses"][0])
            if current is None:
                guard, base = if_absent(full), 0
            else:
                value, mod_revision = current
                try:
                    guard, base = if_unchanged(full, mod_revision), int(value)
                except ValueError:
                    raise ValueError(f"add: key {key!r} holds {value!r}, not an integer") from None
            if time.monotonic() > deadline:
                raise DistStoreError(f"add: key {key!r} changed under every attempt for {self.timeout} ({self!r})")

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's compare-and-set: write ``desired`` if ``key`` holds ``expected``, or if it is absent and
        ``expected`` is empty. Returns the key's value after the call, except that an absent key with a non-empty
        ``expected`` stays absent and the call returns ``expected``."""
        full, expected, desired = self.etcd_key(key), _as_bytes(expected), _as_bytes(desired)
        guard = if_holds(full, expected) if expected else if_absent(full)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            reply = self._write([guard], [put_op(full, desired)], [read_op(full)])
            if reply.get("succeeded"):
                return desired
            current = kv_of(reply["responses"][0])
            if current is None:
                if expected:
                    return expected
                guard = if_absent(full)
            elif current[0] != expected:
                return current[0]
            else:  # it holds the expected value now (or holds b"" and b"" was expected): write unless it changes
                guard = if_unchanged(full, current[1])
            if time.monotonic() > deadline:
                raise DistStoreError(f"compare_set: key {key!r} changed under every attempt for {self.timeout} "
                                     f"({self!r})")
