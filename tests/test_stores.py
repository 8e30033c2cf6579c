"""The job's store: one contract run against TCPStore and EtcdStore (what the protocols rely on, TCPStore's answers
being the reference), the store URL, gloo's rendezvous over etcd, and leader election with a lease.

The etcd cases need an etcd server (the session's ``etcd_server``, skipped without the binary) and are in the
multiprocess tier; the TCPStore cases and the URL rules are fast.
"""

from __future__ import annotations

import http.server
import multiprocessing as mp
import socket
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
from torch.distributed import DistNetworkError, DistStoreError, HashStore, PrefixStore, TCPStore

from titan_recover.recover.groups.keys import raise_fault_flag
from titan_recover.recover.stores import etcd_prefix, open_store, parse_store_url, read_keys, StoreAddress, URL_FORMS
from titan_recover.recover.stores.etcd import EtcdCluster, EtcdStore

TIMEOUT = timedelta(seconds=0.25)
CONNECT_TIMEOUT = timedelta(seconds=30)


class Backend:
    """A fresh job's store, and more clients of the same store (one per thread, as the project uses them)."""

    def __init__(self, kind: str, request):
        self.kind = kind
        if kind == "tcp":
            # the server's own client connects to it too: with the longer bound, as every client here does
            self.server = open_store("127.0.0.1:0", timeout=CONNECT_TIMEOUT, is_server=True)
            self.server.set_timeout(TIMEOUT)
            self.url, self.prefix = f"127.0.0.1:{self.server.port}", None
        else:
            self.url, self.prefix = f"etcd://{request.getfixturevalue('etcd_server')}", f"test-{uuid.uuid4().hex}"
        self.store = self.client()

    def client(self, timeout: timedelta = TIMEOUT):
        """A client held to ``timeout``, connected with a longer one: a busy host may take more than 250 ms to accept
        a connection (seen in the fast tier: a setup failed to connect to the server it had just started)."""
        store = open_store(self.url, timeout=max(timeout, CONNECT_TIMEOUT), prefix=self.prefix)
        store.set_timeout(timeout)
        return store


@pytest.fixture(params=["tcp", pytest.param("etcd", marks=pytest.mark.multiprocess)])
def backend(request) -> Backend:
    return Backend(request.param, request)


def later(seconds: float, fn) -> threading.Thread:
    thread = threading.Timer(seconds, fn)
    thread.start()
    return thread


# ---- the contract ------------------------------------------------------------------------------------------
def test_set_and_get_keep_bytes(backend):
    store = backend.store
    store.set("text", "épsilon")
    store.set("raw", b"\x00\x01\xff")
    store.set("empty", "")
    assert store.get("text") == "épsilon".encode() and store.get("raw") == b"\x00\x01\xff"
    assert store.get("empty") == b""
    store.set("text", "again")
    assert backend.client().get("text") == b"again"


def test_get_of_a_missing_key_raises_the_stores_error_after_its_timeout(backend):
    """The error names the timeout that ended the wait (the store's, then the one set later); the wait lasted at
    least that long. No upper bound on the machine's speed: the message says which timeout fired."""
    store = backend.store
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="wait timeout after 250ms, keys: .*never"):
        store.get("never")
    assert time.monotonic() - start >= 0.24  # a clock tick of slack: the timeout cannot fire early
    store.set_timeout(timedelta(seconds=0.15))
    assert store.timeout == timedelta(seconds=0.15)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="wait timeout after 150ms"):
        store.multi_get(["never"])
    assert time.monotonic() - start >= 0.14


def test_add_is_atomic_across_clients(backend):
    assert backend.store.add("counter", 5) == 5  # a missing key starts at 0
    assert backend.store.add("counter", -5) == 0
    seen: list[int] = []

    def adder():
        client = backend.client(timeout=timedelta(seconds=30))
        seen.extend(client.add("counter", 1) for _ in range(50))

    threads = [threading.Thread(target=adder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 201))  # every add saw its own new value: none lost, none doubled
    assert backend.store.get("counter") == b"200"


def test_adding_zero_reads_the_counter(backend):
    """``add(key, 0)``, the counters' read: the value, 0 for a missing key (etcd: without a write, which would stay
    in its history until compacted)."""
    assert backend.store.add("zero", 0) == 0
    assert backend.store.add("zero", 3) == 3 and backend.store.add("zero", 0) == 3
    if backend.kind == "etcd":
        assert not backend.store.check(["never"]) and backend.store.add("never", 0) == 0
        assert not backend.store.check(["never"])  # read, not written
        before = backend.store.cluster.txn([], [])["header"]["revision"]
        backend.store.add("zero", 0)
        assert backend.store.cluster.txn([], [])["header"]["revision"] == before  # no write: no new revision


COMPARE_SET = [  # (key, expected, desired) -> the value returned, and the key's value after (None: absent)
    (("a", "", "v1"), b"v1", b"v1"),  # absent, "" expected: set
    (("a", "", "v2"), b"v1", b"v1"),  # present: "" does not match
    (("a", "v1", "v3"), b"v3", b"v3"),  # match: set
    (("a", "zz", "v4"), b"v3", b"v3"),  # mismatch: the current value
    (("b", "x", "v5"), b"x", None),  # absent, something expected: TCPStore answers the expected value, sets nothing
    (("e", "", "v6"), b"v6", b"v6"),  # "e" holds b"": "" matches it
    (("c", b"", b"\x00\xff"), b"\x00\xff", b"\x00\xff"),
]


def test_compare_set_answers_as_tcpstore_does(backend):
    store = backend.store
    store.set("e", "")
    for (key, expected, desired), answer, after in COMPARE_SET:
        assert store.compare_set(key, expected, desired) == answer, (key, expected, desired)
        assert (store.get(key) if store.check([key]) else None) == after, (key, expected, desired)


def test_the_first_fault_flag_wins_a_race(backend):
    answers: list[str] = []
    barrier = threading.Barrier(4)

    def raiser(n):
        client = backend.client(timeout=timedelta(seconds=30))
        barrier.wait()
        answers.append(raise_fault_flag(client, 7, f"rank {n}"))

    threads = [threading.Thread(target=raiser, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(answers)) == 1 and answers[0] == backend.store.get("fault/e7").decode()


def test_check_multi_get_and_multi_set(backend):
    store = backend.store
    assert store.check([])
    store.multi_set(["x", "y"], ["1", b"2"])
    assert store.check(["x"]) and store.check(["x", "y"]) and not store.check(["x", "z"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]
    with pytest.raises(DistStoreError):
        store.multi_get(["x", "z"])


def test_read_keys_answers_for_present_and_absent_keys_at_once(backend, monkeypatch):
    """``read_keys`` gives each key's value or None, in order, without waiting for a missing key (the store's
    timeout here is 30 s); on etcd all of them in one transaction (the launcher's pass of its loop reads its keys
    so)."""
    store = backend.client(timeout=timedelta(seconds=30))
    store.multi_set(["a", "empty"], ["1", ""])
    assert read_keys(store, []) == []
    if backend.kind == "etcd":
        requests = []
        txn = store.cluster.txn
        monkeypatch.setattr(store.cluster, "txn", lambda *a, **k: requests.append(a) or txn(*a, **k))
    start = time.monotonic()
    assert read_keys(store, ["a", "never", "empty", "a"]) == [b"1", None, b"", b"1"]
    assert time.monotonic() - start < 15  # answered, not waited out
    if backend.kind == "etcd":
        assert len(requests) == 1, requests


def test_wait_wakes_when_another_client_sets_the_key(backend):
    """``wait`` returns once another client set the last missing key: not before the set began (it waited for
    it) and without its 10 s timeout expiring (the set woke it). ``wait`` with its own timeout ends after that one,
    before the store's. Only orderings and the configured timeouts are compared: no bound on the machine's speed."""
    other = backend.client()
    setting = []

    def set_k2():
        setting.append(time.monotonic())
        other.set("k2", "v")

    timeout_s = 10.0
    store = backend.client(timeout=timedelta(seconds=timeout_s))
    store.set("k1", "v")
    later(0.1, set_k2)
    start = time.monotonic()
    store.wait(["k1", "k2"])  # a timeout would raise
    returned = time.monotonic()
    assert setting and setting[0] <= returned and returned - start < timeout_s
    later(0.1, lambda: other.set("k3", "v"))
    assert store.get("k3") == b"v"  # get blocks as wait does
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="wait timeout after 150ms"):
        store.wait(["k4"], timedelta(seconds=0.15))  # its own timeout, not the store's 10 s
    assert 0.15 <= time.monotonic() - start < timeout_s


def test_delete_and_num_keys(backend):
    store = backend.store
    for key in ("p", "q", "r"):
        store.set(key, "1")
    assert store.num_keys() == 3
    assert store.delete_key("q") is True and store.delete_key("q") is False
    assert not store.check(["q"]) and store.num_keys() == 2


def test_a_prefix_store_over_it_forwards_every_call(backend):
    """As gloo's rendezvous and the fault-tolerant groups use it: C++ calls the store through the PrefixStore."""
    group = PrefixStore("grp", backend.store)
    group.set("k", "v")
    group.multi_set(["m1", "m2"], ["1", "2"])
    assert group.get("k") == b"v" and backend.store.get("grp/k") == b"v"
    assert group.add("n", 2) == 2 and group.compare_set("f", "", "up") == b"up"
    assert group.check(["k", "n"]) and group.multi_get(["m2", "m1"]) == [b"2", b"1"]
    group.wait(["k"])
    group.wait(["k"], timedelta(seconds=1))
    assert group.num_keys() == 5 and group.delete_key("k") and not group.check(["k"])
    with pytest.raises(DistStoreError):
        group.get("never")


# ---- the store URL and the factory ---------------------------------------------------------------------------
@pytest.mark.parametrize("url, kind, endpoints, path", [
    ("node7:29500", "tcp", (("node7", 29500),), ""),
    ("tcp://10.0.0.2:0", "tcp", (("10.0.0.2", 0),), ""),
    ("etcd://e1:2379", "etcd", (("e1", 2379),), ""),
    ("etcd://e1:2379,e2:2379,[::1]:2381/jobs/run-42/", "etcd", (("e1", 2379), ("e2", 2379), ("::1", 2381)),
     "/jobs/run-42"),
])
def test_store_urls(url, kind, endpoints, path):
    assert parse_store_url(url) == StoreAddress(kind, endpoints, path)


@pytest.mark.parametrize("url, what", [
    ("", "empty"),
    ("node7", "'node7' is not HOST:PORT"),
    ("http://node7:2379", "unknown scheme 'http://'"),
    ("tcp://node7:29500/job", "a TCPStore URL has no path"),
    ("node7:1,node8:1", "a TCPStore has one server"),
    ("etcd://e1:0", "port 0 out of range"),
    ("etcd://e1:2379,", "an empty HOST:PORT"),
    ("etcd://e1:2379//job", "an empty segment in the key prefix '//job'"),
    ("tcp://node7:70000", "port 70000 out of range"),
])
def test_a_bad_store_url_says_what_is_wrong_and_the_accepted_forms(url, what):
    with pytest.raises(ValueError) as error:
        parse_store_url(url)
    assert str(error.value) == f"store URL {url!r}: {what}; accepted forms: {URL_FORMS}"


def test_every_job_has_its_own_etcd_prefix():
    assert etcd_prefix(parse_store_url("etcd://e:1"), "run-42") == "/titan_recover/run-42/"
    assert etcd_prefix(parse_store_url("etcd://e:1/jobs/run-42"), None) == "/jobs/run-42/"
    assert etcd_prefix(parse_store_url("etcd://e:1/jobs"), "run-42") == "/jobs/run-42/"
    with pytest.raises(ValueError, match="needs a per-job key prefix"):
        etcd_prefix(parse_store_url("etcd://e:1"), None)


def test_open_store_tcp():
    server = open_store("tcp://127.0.0.1:0", timeout=CONNECT_TIMEOUT, is_server=True, prefix="run-42")
    assert isinstance(server, PrefixStore) and isinstance(server.underlying_store, TCPStore)
    client = open_store(f"127.0.0.1:{server.underlying_store.port}", timeout=CONNECT_TIMEOUT)
    server.set("k", "v")
    assert client.get("run-42/k") == b"v"
    with pytest.raises(ValueError, match="port 0 .* only for the process that hosts the store"):
        open_store("127.0.0.1:0", timeout=TIMEOUT)


def test_an_unreachable_etcd_fails_after_the_timeout():
    """A member that refuses the connection is named in the error (the store gives up rather than waiting for
    one forever: the test's own timeout guards that)."""
    with pytest.raises(DistNetworkError, match="no etcd member answered: 127.0.0.1:1: "):
        EtcdStore([("127.0.0.1", 1)], "/titan_recover/job", timeout=timedelta(seconds=0.1))
    with pytest.raises(ValueError, match="needs a key prefix naming the job"):
        EtcdStore([("127.0.0.1", 1)], "/")


def test_a_request_that_may_have_been_applied_is_not_sent_again():
    """``add`` is not idempotent: after a member took the request and did not answer, it fails instead of being
    sent to the next member; a request no member received goes on to the next."""
    with socket.socket() as silent, socket.socket() as closed:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connects, never answers
        closed.bind(("127.0.0.1", 0))  # refuses: nobody listens
        members = [("127.0.0.1", closed.getsockname()[1]), ("127.0.0.1", silent.getsockname()[1])]
        cluster = EtcdCluster(members, request_timeout_s=0.1)
        status = lambda client: client.status()  # noqa: E731
        with pytest.raises(DistNetworkError, match="may or may not have been applied"):
            cluster.call(status, idempotent=False)  # the refused one is skipped, the silent one took it
        assert cluster.member == members[0]  # the next request tries the other member first
        with pytest.raises(DistNetworkError, match="no etcd member answered"):
            cluster.call(status)


def test_a_server_that_is_not_an_etcd_v3_gateway_is_named():
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"404 page not found")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        with pytest.raises(DistNetworkError, match=r"does not serve etcd's v3 gateway at /v3/ \(etcd >= 3.4 does\)"):
            EtcdStore([("127.0.0.1", server.server_address[1])], "/titan_recover/job", timeout=TIMEOUT)
    finally:
        server.shutdown()
        server.server_close()


# ---- etcd: gloo's rendezvous, a second member of the cluster, leader election --------------------------------
def _gloo_member(url: str, prefix: str, replica: int, results) -> None:
    from titan_recover.recover.ftpg.base import build_group, FTPGConfig

    store = open_store(url, timeout=timedelta(seconds=60), prefix=prefix)
    group = build_group(FTPGConfig(), store, epoch=0, members=(0, 1), replica=replica, rank=0, timeout_s=30.0)
    tensor = torch.full((1000,), float(replica + 1))
    group.allreduce_sum_(tensor)
    results.put((replica, tensor.tolist()))


@pytest.mark.multiprocess
def test_a_gloo_group_rendezvous_over_etcd(etcd_server):
    """The fault-tolerant group's gloo backend builds its process group over ``PrefixStore(..., EtcdStore)``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    url, prefix = f"etcd://{etcd_server}", f"gloo-{uuid.uuid4().hex}"
    procs = [ctx.Process(target=_gloo_member, args=(url, prefix, r, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got == {0: [3.0] * 1000, 1: [3.0] * 1000}
    store = open_store(url, timeout=TIMEOUT, prefix=prefix)
    assert store.num_keys() > 0 and store.check(["ftpg/e0/p0/0/0"])  # gloo's own keys, under the job's prefix


@pytest.mark.multiprocess
def test_a_value_over_etcds_request_limit_is_refused_with_the_reason(etcd_server):
    store = open_store(f"etcd://{etcd_server}", timeout=TIMEOUT, prefix=f"big-{uuid.uuid4().hex}")
    store.set("fits", b"x" * 2**20)
    with pytest.raises(DistStoreError, match="etcdserver: request is too large"):
        store.set("too-big", b"x" * (2 * 2**20 - 2**10))  # etcd's --max-request-bytes: 1.5 MiB by default


@pytest.mark.multiprocess
def test_a_member_that_cannot_be_reached_is_skipped(etcd_server):
    host, port = etcd_server.rsplit(":", 1)
    store = EtcdStore([("127.0.0.1", 1), (host, int(port))], f"/t/{uuid.uuid4().hex}", timeout=TIMEOUT)
    store.set("k", "v")
    assert store.get("k") == b"v" and store.cluster.member == (host, int(port))


def _candidate(url: str, prefix: str, identity: str, events) -> None:
    from titan_recover.recover.stores.leader import LeaderElection

    election = LeaderElection(open_store(url, timeout=timedelta(seconds=30), prefix=prefix), "coordinator", identity)
    election.campaign(timedelta(seconds=60))
    events.put((identity, election.term, election.ttl_s))
    time.sleep(120)  # leads until killed


def test_a_standby_whose_lease_lapsed_stands_by_again_with_a_new_one(monkeypatch):
    """etcd out of reach longer than the lease while a candidate stands by: its campaign raises (lease lost); the
    candidate resigns that election and campaigns with a new one, instead of ending its process (which the
    launcher would count against the role's restarts)."""
    import threading as _threading

    from titan_recover.recover import standby
    from titan_recover.recover.stores import leader

    made = []

    class Election:
        def __init__(self, store, key, identity, ttl_s):
            self.identity, self.lost, self.lost_reason, self.resigned = identity, _threading.Event(), "", False
            self.first = not made
            made.append(self)

        def campaign(self, timeout):
            if self.first:
                self.lost_reason = "no refresh answered for 1.5 s"
                self.lost.set()
                raise RuntimeError(f"{self.identity}: the lease was lost while campaigning")

        def resign(self):
            self.resigned = True

    monkeypatch.setattr(leader, "LeaderElection", Election)
    store = HashStore()
    elected = standby.lead(store, "coordinator/leader", "node1/coordinator0", over_key="finished")
    assert elected is made[1] and made[0].resigned and not made[1].resigned


@pytest.mark.multiprocess
def test_a_standby_takes_over_when_the_leader_dies(etcd_server):
    """The leader's process is killed (its keepalive with it): the standby leads within the lease's TTL + 1 s."""
    from titan_recover.recover.stores.leader import LeaderElection

    url, prefix = f"etcd://{etcd_server}", f"leader-{uuid.uuid4().hex}"
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    leader = ctx.Process(target=_candidate, args=(url, prefix, "coordinator-a", events))
    leader.start()
    try:
        _, first_term, ttl_s = events.get(timeout=60)
        store = open_store(url, timeout=TIMEOUT, prefix=prefix)
        standby = LeaderElection(store, "coordinator", "coordinator-b")
        with pytest.raises(TimeoutError, match="coordinator still held by coordinator-a"):
            standby.campaign(timedelta(seconds=0.3))
        leader.kill()
        killed = time.monotonic()
        standby.campaign(timedelta(seconds=30))
        takeover = time.monotonic() - killed
    finally:
        leader.kill()
        leader.join(10)
    print(f"takeover after the leader was killed: {takeover:.2f} s (lease TTL {ttl_s} s)")
    assert standby.is_leader and standby.term > first_term and store.get("coordinator") == b"coordinator-b"
    assert ttl_s - ttl_s / 3 - 0.5 < takeover < ttl_s + 1.0
    standby.resign()
    assert not store.check(["coordinator"])


@pytest.mark.multiprocess
def test_a_jobs_announcement_outlives_node_0s_launcher_so_a_replacement_finds_the_running_job(etcd_server):
    """etcd: node 0 announces its job; node 1's launcher keeps the announcement as a standby. Node 0's launcher
    goes (its lease revoked): node 1's takes the key with the same name, so a node 0 started in its place finds the
    job running and joins it, instead of naming a second job on the same run folder. A job whose verdict is recorded
    is not running (its launchers are ending). One launcher per node: a second claim of a node that is held is
    refused, naming the holder; once the holder resigns, it succeeds."""
    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.job_store import (announce_job, Announcement, claim_node, NoJobStore, running_job)
    from titan_recover.recover.stores import job_url

    url, run = f"etcd://{etcd_server}", f"run-{uuid.uuid4().hex}"
    assert running_job(url, run, 5) is None
    node0 = announce_job(url, run, "job-a", 5)
    node1 = Announcement(url, run, "job-a", 5).stand_by()
    try:
        assert running_job(url, run, 5) == "job-a" and not node1.election.is_leader
        node0.resign()  # node 0's launcher is gone (a killed one's lease lapses within its TTL instead)
        deadline = time.monotonic() + 10
        while not node1.election.is_leader and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node1.election.is_leader and running_job(url, run, 5) == "job-a"
        job = job_url(url, run, "job-a")
        claim = claim_node(job, 0, 5)
        with pytest.raises(NoJobStore, match=r"node 0 of this job is still running \(its launcher: .*/pid\d+\): one "
                                             r"launcher per --node-rank"):
            claim_node(job, 0, 5, wait_s=0.3)
        claim.resign()
        claim_node(job, 0, 5, wait_s=5).resign()
        open_store(job, timeout=TIMEOUT).set(GroupKeys.FINISHED, "trained")
        assert running_job(url, run, 5) is None
    finally:
        node1.resign()
    assert not open_store(job_url(url, run), timeout=TIMEOUT).check(["launcher"])


@pytest.mark.multiprocess
def test_a_leader_whose_lease_is_revoked_knows_it_and_resigning_hands_over_at_once(etcd_server):
    from etcd3gw.lease import Lease

    from titan_recover.recover.stores.leader import LeaderElection

    store = open_store(f"etcd://{etcd_server}", timeout=TIMEOUT, prefix=f"leader-{uuid.uuid4().hex}")
    a, b, c = (LeaderElection(store, "coordinator", name) for name in ("a", "b", "c"))
    a.campaign(timedelta(seconds=5))
    assert a.is_leader and store.get("coordinator") == b"a"
    refreshes = _FlakyRefresher(a._refresher, failures=0)  # counts a's refreshes, fails none
    a._refresher = refreshes
    store.cluster.call(lambda client: Lease(a.lease, client=client).revoke())  # as if it expired
    revoked_at = refreshes.calls
    b.campaign(timedelta(seconds=5))
    assert a.lost.wait(30 * a.ttl_s) and not a.is_leader  # the wait only guards against a leader that never knows
    # the first refresh that reached etcd after the revoke told it: at most one was sent after the revoke
    assert refreshes.calls - revoked_at <= 1, (revoked_at, refreshes.calls)
    with pytest.raises(RuntimeError, match="the lease was lost"):
        a.campaign(timedelta(seconds=1))
    standby = threading.Thread(target=c.campaign, args=(timedelta(seconds=5),))
    standby.start()
    _wait_for(lambda: c.lease is not None)  # c campaigns with a lease of its own
    lease_of_b = b.lease
    b.resign()
    # resigning revoked b's lease (etcd answers TTL -1 for a lease it no longer has): nothing for c to wait out
    remaining = store.cluster.call(lambda client: Lease(lease_of_b, client=client).ttl())
    assert remaining == -1, remaining
    standby.join()
    assert c.is_leader and store.get("coordinator") == b"c"
    c.resign()


def _wait_for(condition, guard_s: float = 60.0) -> None:
    """Until ``condition()``; ``guard_s`` only ends a wait for something that never happens."""
    deadline = time.monotonic() + guard_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


class _FlakyRefresher:
    """The election's refresher, failing its first ``failures`` calls (``None``: every call) as a lost answer."""

    def __init__(self, real, failures=None):
        self.real, self.failures, self.calls = real, failures, 0
        self.endpoints = real.endpoints

    def call(self, op, **kwargs):
        self.calls += 1
        if self.failures is None or self.calls <= self.failures:
            raise ConnectionError(f"refresh {self.calls} not answered")
        return self.real.call(op, **kwargs)


@pytest.mark.multiprocess
def test_a_refresh_that_fails_is_tried_again_and_the_lease_is_lost_only_before_it_can_expire(etcd_server):
    """Two refreshes in a row go unanswered: the keepalive tries again within the same quarter TTL and keeps the
    lease. When no refresh is answered, ``lost`` is set 3/4 TTL after the last answered one, while the key (and
    the lease) are still held: no other candidate can lead before this one knows it may not."""
    from titan_recover.recover.stores.leader import LeaderElection

    store = open_store(f"etcd://{etcd_server}", timeout=TIMEOUT, prefix=f"leader-{uuid.uuid4().hex}")
    flaky = LeaderElection(store, "coordinator", "flaky")
    flaky.campaign(timedelta(seconds=5))
    flaky._refresher = _FlakyRefresher(flaky._refresher, failures=2)
    time.sleep(2 * flaky.ttl_s)
    assert not flaky.lost.is_set() and flaky._refresher.calls > 3 and store.get("coordinator") == b"flaky"
    flaky.resign()

    dead = LeaderElection(store, "coordinator", "dead")
    dead.campaign(timedelta(seconds=5))
    answered = time.monotonic()  # no later than the last answered refresh was sent
    dead._refresher = _FlakyRefresher(dead._refresher)
    assert dead.lost.wait(2 * dead.ttl_s)
    lost_after = time.monotonic() - answered
    assert store.get("coordinator") == b"dead"  # still held: etcd has not expired the lease yet
    assert lost_after < dead.ttl_s, lost_after
    assert "not answered" in dead.lost_reason and not dead.is_leader
    dead.resign()


# ---- etcd: fencing a leader's writes by its term --------------------------------------------------------------
def _job_keys(store: EtcdStore) -> dict[bytes, bytes]:
    """Every key of the store's job and its value, read straight from etcd."""
    import base64

    prefix = store.etcd_key("")
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    reply = store.cluster.call(lambda c: c.post(c.get_url("/kv/range"), json={
        "key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}))
    return {base64.b64decode(kv["key"])[len(prefix):]: base64.b64decode(kv.get("value", ""))
            for kv in reply.get("kvs", [])}


@pytest.mark.multiprocess
def test_a_deposed_leaders_writes_are_refused_and_change_nothing(etcd_server):
    """Two leaders in turn. The first is deposed as if it had been paused past its lease (the lease revoked, its
    process never told): every kind of write through its fenced store raises NotLeader, naming who leads, and
    leaves every key as it was; the new leader's writes go through."""
    from etcd3gw.lease import Lease

    from titan_recover.recover.stores.etcd import NotLeader
    from titan_recover.recover.stores.leader import LeaderElection

    store = open_store(f"etcd://{etcd_server}", timeout=TIMEOUT, prefix=f"fence-{uuid.uuid4().hex}")
    a, b = LeaderElection(store, "coordinator/leader", "a"), LeaderElection(store, "coordinator/leader", "b")
    with pytest.raises(RuntimeError, match="campaign first"):
        a.fenced()
    a.campaign(timedelta(seconds=5))
    fenced_a = a.fenced()
    fenced_a.set("epoch", "0")
    fenced_a.multi_set(["epoch/0/members", "coordinator/state"], ["0,1|registered", "state-a"])
    assert fenced_a.add("coordinator/starts", 1) == 1 and fenced_a.compare_set("fault/e0", "", "a") == b"a"
    assert fenced_a.delete_keys(["absent"], ["nothing/"]) == 0

    store.cluster.call(lambda client: Lease(a.lease, client=client).revoke())  # as if it expired during a pause
    with pytest.raises(NotLeader, match="nobody holds it"):
        fenced_a.set("epoch", "1")
    b.campaign(timedelta(seconds=5))
    fenced_b = b.fenced()
    fenced_b.set("epoch", "1")
    fenced_b.set("epoch/1/members", "0|replica 1 lost")
    before = _job_keys(store)
    refused = {
        "set": lambda: fenced_a.set("epoch/1/members", "0,1|the deposed one's view"),
        "multi_set": lambda: fenced_a.multi_set(["epoch", "coordinator/state"], ["2", "state-a2"]),
        "add": lambda: fenced_a.add("coordinator/starts", 1),
        "compare_set (it holds the expected value)": lambda: fenced_a.compare_set("fault/e0", "a", "a2"),
        "compare_set (absent)": lambda: fenced_a.compare_set("fault/e1", "", "a"),
        "delete_key": lambda: fenced_a.delete_key("epoch"),
        "delete_keys": lambda: fenced_a.delete_keys(["coordinator/state"], ["epoch/"]),
    }
    for name, write in refused.items():
        with pytest.raises(NotLeader, match=r"write refused, a no longer holds .*coordinator/leader.* \(b holds it"):
            write()
        assert _job_keys(store) == before, name
    assert before[b"epoch"] == b"1" and before[b"epoch/1/members"] == b"0|replica 1 lost"
    assert fenced_b.add("coordinator/starts", 1) == 2 and fenced_b.compare_set("fault/e0", "a", "b") == b"b"
    assert fenced_b.delete_keys(["fault/e0"], ["epoch/"]) == 3
    b.resign()
    a.resign()


@pytest.mark.multiprocess
def test_a_deposed_coordinator_cannot_publish_an_epoch(etcd_server, tmp_path):
    """The coordinator's own writes, fenced as a standby coordinator's are (coordinator_process.py): coordinator A
    publishes epoch 0 and is deposed; B leads, resumes and forms epoch 1 without replica 1. A, still running
    with its old view, tries to publish a different epoch 1: refused before it writes anything, and members read
    B's epoch."""
    from etcd3gw.lease import Lease

    from titan_recover.recover.config import RecoverConfig
    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.protocol import decode_members
    from titan_recover.recover.stores.etcd import NotLeader
    from titan_recover.recover.stores.leader import LeaderElection

    store = open_store(f"etcd://{etcd_server}", timeout=timedelta(seconds=5), prefix=f"fence-{uuid.uuid4().hex}")
    config = RecoverConfig(replicas=2, join_window_s=0.3)
    a = LeaderElection(store, GroupKeys.COORDINATOR_LEADER, "a")
    a.campaign(timedelta(seconds=5))
    first = Coordinator(config, a.fenced(), replicas=2, ranks_per_replica=1, run_dir=str(tmp_path))
    first.incarnation = {0: 0, 1: 0}
    first._publish(0, (0, 1), (), "all replicas registered", timing={})
    store.cluster.call(lambda client: Lease(a.lease, client=client).revoke())  # a pause past its lease

    b = LeaderElection(store, GroupKeys.COORDINATOR_LEADER, "b")
    b.campaign(timedelta(seconds=5))
    second = Coordinator(config, b.fenced(), replicas=2, ranks_per_replica=1, run_dir=str(tmp_path))
    assert second._resume() and second.epoch == 0
    store.set(GroupKeys.fault(0), "1.0|replica 1 rank 0: collective failed")
    store.set(GroupKeys.join(1, 0), "0")
    second._form_next_epoch()
    assert second.members == (0,)
    before = _job_keys(store)
    with pytest.raises(NotLeader, match="b holds it"):
        first._publish(1, (0, 1), (), "the deposed coordinator's view", timing={})
    with pytest.raises(NotLeader):
        first._beat()
    assert _job_keys(store) == before
    assert decode_members(store.get(GroupKeys.members(1)))[0] == (0,) and int(store.get(GroupKeys.EPOCH)) == 1
    b.resign()
    a.resign()
