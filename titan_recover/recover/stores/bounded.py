"""A client of the job's store whose every request has a deadline (docs/deploy.md "A host cut from the network").

torch's ``TCPStore`` client reads each answer with a blocking read that has no timeout, except while a ``wait`` (and
so a ``get``) waits for its keys: a ``check``, ``set``, ``add`` or ``compare_set`` sent to a server that went silent
(its host cut from the network or powered off: no reset ever comes back) blocks for as long as the kernel
retransmits (Linux's ``net.ipv4.tcp_retries2``). Seen with two network namespaces (tests/netns.py): a launcher cut
from node 0's store sat in one ``check``, saying nothing, until the run was stopped minutes later. An etcd store
bounds each request itself (10 s, :mod:`.etcd`).

:class:`BoundedStore` makes each request of the client it wraps on a thread of its own and waits for it up to a
bound that follows progress, not size: the store's timeout (the ``timeout`` it was opened with: every process of a
job opens the job's store with ``agree_timeout_s``, 60 s by default) for a request that a live server answers at
once (a value is at most 4 MB, :mod:`..groups.blobs`), that plus the wait's own timeout for one that waits for keys.
The store's timeout, not a shorter bound: a live server can stall for seconds (the embedded store looks up the
host name of every client that connects on the thread that answers everyone, docs/deploy.md "Network interfaces"),
and a client that gave up on a live server would end a healthy process. A request past its bound raises
:class:`~torch.distributed.DistNetworkError` naming the store, the request and how long it went unanswered, as an
etcd request does after its timeout; the caller handles it as a lost store (each process says so and ends: its job
has dropped it, or ends without its store). The client is then broken, its connection still holding the unanswered
request: every later request raises the same at once. The thread stays in the unanswered read until TCP gives up;
it holds nothing of the process.

May import: nothing of the project.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import DistNetworkError, Store

T = TypeVar("T")


class BoundedStore(Store):
    """``inner`` (a store client) with a deadline on each request; ``name`` says which store in errors;
    ``request_timeout_s``: how long a request may go unanswered beyond its wait for keys (default: the store's
    timeout, as it is at the request: ``set_timeout`` moves it)."""

    def __init__(self, inner: Store, name: str, request_timeout_s: float | None = None):
        super().__init__()
        self.inner, self.name, self._request_timeout_s = inner, name, request_timeout_s
        super().set_timeout(inner.timeout)
        self.silent: str | None = None
        """Why the store counts as lost (a request went unanswered past its bound), or None."""
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._requests,), name="titan-recover-store-request",
                                        daemon=True)  # holds the queue, not the store: a store let go is freed
        self._thread.start()

    def __del__(self) -> None:
        self._requests.put(None)  # its thread ends (once a request it is in, if any, returns)

    @property
    def request_timeout_s(self) -> float:
        if self._request_timeout_s is not None:
            return self._request_timeout_s
        return self.inner.timeout.total_seconds()

    def __repr__(self) -> str:
        return f"BoundedStore({self.name}, {self.request_timeout_s:g} s a request)"

    def _request(self, what: str, call: Callable[[], T], waits_s: float = 0.0) -> T:
        if self.silent is not None:
            raise DistNetworkError(self.silent)
        done: Future = Future()
        started = time.monotonic()
        self._requests.put((call, done))
        bound = waits_s + self.request_timeout_s
        try:
            return done.result(timeout=bound)
        except FutureTimeout:
            self.silent = (f"no answer to a {what} from {self.name} in {time.monotonic() - started:.1f} s: its host "
                           f"is gone or this one is cut off from it")
            raise DistNetworkError(self.silent) from None

    def _waits_s(self, timeout: timedelta | None = None) -> float:
        return (timeout if timeout is not None else self.inner.timeout).total_seconds()

    # ---- the Store interface, each request bounded ----------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._request("set", lambda: self.inner.set(key, value))

    def get(self, key: str) -> bytes:
        return self._request("get", lambda: self.inner.get(key), self._waits_s())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._request("multi_get", lambda: self.inner.multi_get(keys), self._waits_s())

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._request("multi_set", lambda: self.inner.multi_set(keys, values))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        call = (lambda: self.inner.wait(keys)) if timeout is None else (lambda: self.inner.wait(keys, timeout))
        self._request("wait", call, self._waits_s(timeout))

    def check(self, keys: list[str]) -> bool:
        return self._request("check", lambda: self.inner.check(keys))

    def add(self, key: str, amount: int) -> int:
        return self._request("add", lambda: self.inner.add(key, amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._request("compare_set", lambda: self.inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        return self._request("delete_key", lambda: self.inner.delete_key(key))

    def num_keys(self) -> int:
        return self._request("num_keys", self.inner.num_keys)

    def append(self, key: str, value: str | bytes) -> None:
        self._request("append", lambda: self.inner.append(key, value))

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
        super().set_timeout(timeout)

    def clone(self) -> BoundedStore:
        """A client of the same store with a connection (and a request thread) of its own."""
        return BoundedStore(self.inner.clone(), self.name, self._request_timeout_s)


def _serve(requests: queue.SimpleQueue) -> None:
    """A store's request thread: each ``(call, future)`` in turn, until None."""
    while (request := requests.get()) is not None:
        call, done = request
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(call())
        except BaseException as error:  # noqa: BLE001 - handed to the caller as it is
            done.set_exception(error)
        del call, done, request  # nothing of the last request (its store included) stays referenced here


def unbounded(store: Any) -> Any:
    """The client a :class:`BoundedStore` wraps, or ``store`` itself."""
    return store.inner if isinstance(store, BoundedStore) else store
