"""The job's store as each node's launcher finds it (docs/deploy.md "Running on many nodes").

* Embedded (``[recover] store = ""``): node 0's launcher hosts a ``TCPStore`` (it listens on every interface of
  node 0) at ``--rdzv-endpoint``, or at ``127.0.0.1:coordinator_port`` on one node; the other nodes' launchers
  wait for it (:func:`join_embedded`), bounded by ``startup_timeout_s``.
* etcd (``[recover] store = "etcd://..."``): nobody hosts anything. Node 0's launcher picks the job's name (the run
  folder's name, then its start time) and announces it under the run folder's prefix, bound to a lease it keeps
  alive (:func:`announce_job`). The other nodes read it (:func:`announced_job`) and keep it too, as standby
  candidates of the same key with the same name (:class:`Announcement`): the announcement lives as long as any
  launcher of the job, node 0's or not, so another node never joins a job that is over, a second job on the same
  run folder is refused while any node of the first one lives, and a launcher started in place of a lost node,
  node 0 included, finds the running job and joins it (:func:`running_job`). Each launcher holds its node's key
  (:func:`claim_node`): a second launcher for a node that still runs is refused. Every process of the job then
  opens :func:`~.stores.job_url`.

Then node 0 publishes its resolved config (:func:`publish_config`) and every other node refuses to start with a
different one (:func:`agree_config`, ``ConfigMismatch`` naming the first differing key).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta

from torch.distributed import DistError, Store, TCPStore

from titan_recover.recover.groups.keys import GroupKeys
from titan_recover.recover.nodes import first_difference, NodeKeys
from titan_recover.recover.stores import host_port, job_url, open_store
from titan_recover.recover.stores.bounded import BoundedStore

logger = logging.getLogger(__name__)

ANNOUNCEMENT = "launcher"
"""Under the run folder's etcd prefix: the name of the job some launcher of which lives (a lease-bound key)."""
ANNOUNCE_TTL_S = 2
RECAMPAIGN_S = 1.0
"""A standby of the announcement campaigns in turns this long, looking between them whether it should stop."""


class NoJobStore(RuntimeError):
    """The job's store (or, on etcd, node 0's announcement of the job) did not appear in time."""


class NodeReplaced(RuntimeError):
    """Another launcher took this node's place in the job (this one was stopped or cut off meanwhile)."""


class ConfigMismatch(ValueError):
    """This node's resolved config differs from node 0's."""


def host_embedded(host: str, port: int, timeout_s: float) -> tuple[TCPStore, str]:
    """The job's store in this process (node 0's launcher), and the ``HOST:PORT`` its clients use. The server
    listens on every interface; ``host`` is the address the other processes reach it at."""
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return store, host_port(host, store.port)


def join_embedded(host: str, port: int, wait_s: float, timeout_s: float) -> tuple[BoundedStore, str]:
    """A client of node 0's embedded store, waiting up to ``wait_s`` for node 0's launcher to host it; NoJobStore
    after that. Each of its requests is bounded (:class:`~.stores.bounded.BoundedStore`)."""
    try:
        store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=wait_s))
    except DistError as e:
        raise NoJobStore(f"no job store at {host}:{port} after {wait_s:g} s: is node 0's launcher running (with "
                         f"the same --rdzv-endpoint)? ({str(e).splitlines()[0]})") from None
    store.set_timeout(timedelta(seconds=timeout_s))
    address = host_port(host, port)
    return BoundedStore(store, address), address  # an IPv6 host in brackets, as every process parses it


def run_segment(run_dir: str) -> str:
    """The run folder's name: the etcd prefix under which its jobs are announced."""
    return os.path.basename(os.path.normpath(run_dir)) or "run"


def new_job_name(now: float | None = None) -> str:
    """A job's name, unique per start of node 0's launcher: its start time (UTC) and process id."""
    now = time.time() if now is None else now
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"-{int(now * 1000) % 1000:03d}-{os.getpid()}"


class Announcement:
    """One launcher's hold on the run folder's announcement of its job: node 0 of a new job takes the key at once
    (:meth:`take`); every other launcher of the job campaigns for it on a thread (:meth:`stand_by`), with the same
    name, and takes it when the holder's lease lapses (the holder's launcher was lost). :meth:`resign` at the end."""

    def __init__(self, url: str, run: str, job: str, timeout_s: float):
        from titan_recover.recover.stores.leader import LeaderElection

        self.url, self.run, self.job = url, run, job
        self.store = open_store(job_url(url, run), timeout=timedelta(seconds=timeout_s))
        self.election = LeaderElection(self.store, ANNOUNCEMENT, job, ttl_s=ANNOUNCE_TTL_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> None:
        """Hold the announcement now; NoJobStore naming the job that holds it after twice the lease's time to live
        (a launcher killed just before releases it within that)."""
        held = _take_or_name_holder(self.election, self.store, ANNOUNCEMENT, 2 * self.election.ttl_s + 1)
        if held is not None:
            raise NoJobStore(f"job {held} of run folder {self.run!r} is still running on {self.url} (a launcher of "
                             f"it holds {job_url(self.url, self.run)}/{ANNOUNCEMENT}): wait for it, start this "
                             "launcher with the same config to replace one of its nodes, or use another "
                             "dump_folder")

    def stand_by(self) -> "Announcement":
        """Campaign on a thread until this launcher holds the announcement or resigns."""
        self._thread = threading.Thread(target=self._campaign, name="announcement", daemon=True)
        self._thread.start()
        return self

    def _campaign(self) -> None:
        while not self._stop.is_set() and not self.election.is_leader:
            try:
                self.election.campaign(timedelta(seconds=RECAMPAIGN_S))
            except TimeoutError:
                continue
            except Exception as error:  # noqa: BLE001 - the job runs on; only a replacement's lookup needs it
                logger.warning("this launcher stopped keeping the announcement of job %s: %s", self.job, error)
                return

    def resign(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=RECAMPAIGN_S + 10)
        self.election.resign()


def _take_or_name_holder(election, store, key: str, wait_s: float) -> str | None:
    """Campaign ``election`` for ``key`` up to ``wait_s``: None once it holds it, else (resigned) who holds it."""
    try:
        election.campaign(timedelta(seconds=wait_s))
        return None
    except TimeoutError:
        election.resign()
        return store.get(key).decode() if store.check([key]) else "?"


def announce_job(url: str, run: str, job: str, timeout_s: float) -> Announcement:
    """Node 0 of a new job on etcd: hold the run folder's announcement key with the job's name (NoJobStore if
    another job's launcher holds it). ``timeout_s``: the store's."""
    announcement = Announcement(url, run, job, timeout_s)
    announcement.take()
    return announcement


def running_job(url: str, run: str, timeout_s: float) -> str | None:
    """The job announced for the run folder now (no wait), unless it has finished (its verdict recorded: its
    launchers are ending); None if none."""
    store = open_store(job_url(url, run), timeout=timedelta(seconds=timeout_s))
    if not store.check([ANNOUNCEMENT]):
        return None
    job = store.get(ANNOUNCEMENT).decode()
    finished = open_store(job_url(url, run, job), timeout=timedelta(seconds=timeout_s)).check([GroupKeys.FINISHED])
    return None if finished else job


def announced_job(url: str, run: str, wait_s: float) -> str:
    """Another node on etcd: the name of the job announced for the run folder, waiting up to ``wait_s`` for node
    0's launcher to announce it; NoJobStore after that."""
    where = job_url(url, run)
    try:
        store = open_store(where, timeout=timedelta(seconds=wait_s))
        return store.get(ANNOUNCEMENT).decode()
    except DistError as e:
        raise NoJobStore(f"no job announced at {where}/{ANNOUNCEMENT} after {wait_s:g} s: is node 0's launcher "
                         f"running, with the same dump_folder and recover.store? ({str(e).splitlines()[0]})") from None


def launcher_identity() -> str:
    """How a launcher names itself in its node's key (``NodeKeys.launcher``): its host and process id."""
    return f"{socket.gethostname()}/pid{os.getpid()}"


def claim_node(url: str, rank: int, timeout_s: float, wait_s: float = 2 * ANNOUNCE_TTL_S + 1):
    """etcd: hold node ``rank``'s key in the job's store (``url``) while this launcher lives, naming its host and
    process; NoJobStore naming the holder if another launcher of that node still runs after ``wait_s`` (default
    twice the lease's time to live: a launcher lost just before releases it within that). Returns the election
    (``resign()``)."""
    from titan_recover.recover.stores.leader import LeaderElection

    store = open_store(url, timeout=timedelta(seconds=timeout_s))
    election = LeaderElection(store, NodeKeys.launcher(rank), launcher_identity(), ttl_s=ANNOUNCE_TTL_S)
    held = _take_or_name_holder(election, store, NodeKeys.launcher(rank), wait_s)
    if held is not None:
        raise NoJobStore(f"node {rank} of this job is still running (its launcher: {held}): one launcher per "
                         "--node-rank; start a replacement only once the node's launcher is gone")
    return election


def publish_config(store: Store, config_text: str, start: str) -> None:
    """Node 0: its resolved config and start time, for the other nodes to check and adopt."""
    store.set(NodeKeys.START, start)
    store.set(NodeKeys.CONFIG, config_text)


def agree_config(store: Store, config_text: str, wait_s: float) -> str:
    """Another node: compare this node's resolved config with node 0's (waiting up to ``wait_s`` for it to be
    published); ConfigMismatch naming the first difference. Returns node 0's start time."""
    try:
        store.wait([NodeKeys.CONFIG], timedelta(seconds=wait_s))
    except DistError:
        raise NoJobStore(f"node 0 published no config in the job's store within {wait_s:g} s") from None
    reference = store.get(NodeKeys.CONFIG).decode()
    difference = first_difference(reference, config_text)
    if difference is not None:
        raise ConfigMismatch(f"this node's resolved config differs from node 0's ({socket.gethostname()} vs the job "
                             f"store's): {difference}; start every node's launcher with the same config and "
                             "overrides (--print-config shows what each resolves to)")
    return store.get(NodeKeys.START).decode()


def await_acks(store: Store, nnodes: int, timeout_s: float) -> list[int]:
    """Node 0 with the embedded store: keep it up until every other node's launcher acknowledged the verdict, at
    most ``timeout_s``. Returns the nodes that did not."""
    deadline = time.monotonic() + timeout_s
    missing = list(range(1, nnodes))
    while missing and time.monotonic() < deadline:
        missing = [node for node in missing if not store.check([NodeKeys.ack(node)])]
        if missing:
            time.sleep(0.1)
    return missing
