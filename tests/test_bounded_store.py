"""Every request to the job's store has a deadline (titan_recover/recover/stores/bounded.py): a TCPStore client
behind a relay that goes silent, as a host cut from the network does (bytes dropped, no reset)."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import DistNetworkError, DistStoreError, TCPStore

from titan_recover.recover.ftpg.polled import rendezvous_client
from titan_recover.recover.stores.bounded import BoundedStore, unbounded


class Relay:
    """Forwards TCP between its clients and ``port`` until :meth:`silence`; then reads and drops everything, never
    answering and never closing (what a peer whose host is cut off looks like from here)."""

    def __init__(self, port: int):
        self.target, self.silent, self.sockets = port, threading.Event(), []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self.listener.accept()
            except OSError:
                return
            outbound = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [inbound, outbound]
            for src, dst in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not self.silent.is_set():
                dst.sendall(data)

    def silence(self) -> None:
        self.silent.set()

    def close(self) -> None:
        for s in (self.listener, *self.sockets):
            s.close()


@pytest.fixture
def relayed():
    """(a TCPStore server, a BoundedStore client of it through a :class:`Relay` (0.4 s store timeout, 0.5 s a
    request), the relay)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    relay = Relay(server.port)
    client = TCPStore("127.0.0.1", relay.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=0.4))
    yield server, BoundedStore(client, f"127.0.0.1:{relay.port}", request_timeout_s=0.5), relay
    relay.close()  # the request left unanswered ends (its connection closed): no thread stays in a read


def test_a_request_a_silent_store_never_answers_raises_after_its_bound_and_every_later_one_at_once(relayed):
    server, store, relay = relayed
    store.set("a", "1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.check(["a"]) and not store.check(["b"])
    assert store.compare_set("a", "1", "2") == b"2" and server.get("a") == b"2"
    relay.silence()
    started = time.monotonic()
    with pytest.raises(DistNetworkError, match=rf"no answer to a check from 127.0.0.1:{relay.port} in [0-9.]+ s: its "
                                               "host is gone or this one is cut off from it"):
        store.check(["a"])
    assert 0.5 <= time.monotonic() - started < 2.0
    started = time.monotonic()
    with pytest.raises(DistNetworkError, match="no answer to a check"):  # the client's connection holds the first
        store.set("b", "1")
    assert time.monotonic() - started < 0.1


def test_a_get_that_waits_for_its_key_is_bounded_by_its_wait_then_the_request_bound(relayed):
    """A ``get`` of a key nobody set waits the store's timeout (0.4 s) and fails as the store's own timeout; the
    request bound (0.5 s) counts only beyond that wait, so a long wait for a key is never taken for a lost store."""
    _, store, _ = relayed
    started = time.monotonic()
    with pytest.raises(DistStoreError) as raised:
        store.get("never")
    assert not isinstance(raised.value, DistNetworkError) and store.silent is None
    assert 0.4 <= time.monotonic() - started < 0.9  # the wait, then less than the request bound
    store.add("n", 1)
    store.wait(["n"], timedelta(seconds=0.2))  # a key that is there: answered at once
    assert store.get("n") == b"1"


def test_a_groups_rendezvous_client_is_a_connection_of_its_own_without_the_bound(relayed):
    """gloo's and NCCL's rendezvous waits for peers on a client of its own, bounded by the group's own deadline and
    fault flag (titan_recover/recover/ftpg/polled.py), not by the request bound."""
    _, store, _ = relayed
    clone = rendezvous_client(store)
    assert isinstance(clone, TCPStore) and clone is not unbounded(store)
    clone.set("c", "1")
    assert store.get("c") == b"1"


def test_the_bound_follows_the_stores_timeout_when_none_is_given():
    """Opened with a short timeout to probe a server, then given a longer one for its work (as a learner's link to
    the syncer is): its requests get the longer one."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=1))
    store = BoundedStore(client, "x")
    assert store.request_timeout_s == 1.0
    store.set_timeout(timedelta(seconds=10))
    assert store.request_timeout_s == 10.0 and store.inner.timeout == timedelta(seconds=10)
    assert BoundedStore(client, "x", request_timeout_s=0.5).request_timeout_s == 0.5


def test_a_store_let_go_is_freed_and_its_request_thread_ends():
    import gc
    import weakref

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store = BoundedStore(TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=10)), "x")
    store.set("k", "v")
    thread, freed = store._thread, weakref.ref(store)
    del store
    gc.collect()
    thread.join(timeout=5)
    assert freed() is None and not thread.is_alive()
