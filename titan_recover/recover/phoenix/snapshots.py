"""In-memory snapshots of a job without replicas, the ranks' side: take and restore (docs/phoenix.md "Buddy
snapshots"). The keeper process that holds them is :mod:`titan_recover.recover.phoenix.keeper`.

With one replica (FSDP2 / TP / PP inside one torchrun) the training state exists once. torchrun's
``--max-restarts`` restarts every worker of the job when one dies, so a snapshot cannot live in a worker: it lives
in a **keeper**, a small process per node that holds bytes in host memory. Every ``[recover.snapshot] interval``
steps, after the optimizer step, each rank records the small state (step, schedule, RNG) and copies its shard's
tensors (parameters and optimizer state: what a state transfer sends) into one host buffer, reused between
snapshots, while the next step's forward and backward run, which only read them: on CPU a background thread makes
the copy and the next optimizer step waits for it if it is not done (``blocked_s``); on CUDA the copy runs on a
dedicated stream into a pinned buffer, the next optimizer step's kernels queue after its event, and the thread
waits for the event before it reads the bytes. The thread then sends the copy to the keeper of its buddy node (``node + 1``);
a snapshot still being sent when the next one is due is skipped, never waited for. Each rank keeps two slots on
its keeper and marks a slot complete (its ``meta``: step, size, xxHash3) only after the bytes are stored, having
deleted the mark before overwriting: a rank dying mid-send leaves its previous snapshot intact.

When the job starts (first start or a restart), after TorchTitan's checkpointer loaded whatever durable checkpoint
exists, every rank reads every rank's complete slots, picks the newest step that every rank holds
(:func:`restore_step`), if it is newer than the durable checkpoint's, and reads its own payload (size and xxHash3
checked). The ranks then agree (one all-reduce of two integers, :func:`agreed_step`): they restore that step only
if every rank picked it and read it whole; otherwise every rank resumes from the durable checkpoint, as TorchTitan
does (a keeper one rank cannot reach, a damaged payload, ranks that read the keepers at different moments). Keys
are named by the job (:func:`snapshot_job`: the checkpoint folder and torchrun's run id), so keepers that outlive a
job never hand its snapshots to another. The project's checkpoint manager
(:class:`titan_recover.checkpoint.RecoverCheckpointManager`) builds the :class:`Snapshots` of a rank and restores
them in its ``load``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from titan_recover.platform import bind_thread
from titan_recover.recover.groups.agree import extremes
from titan_recover.recover.groups.blobs import delete_blob, get_blob, put_blob
from titan_recover.recover.phoenix.staging import copies_for, CopyEvent, HostCopies
from titan_recover.recover.phoenix.state_transfer import bytes_view, checksum, StateMismatch, tensor_spec, TrainingState
from titan_recover.recover.stores.bounded import BoundedStore

logger = logging.getLogger(__name__)

CONNECT_S = 5.0
"""How long a keeper's host may take to accept a connection before the keeper counts as gone (a live one accepts in
well under a millisecond on a cluster network; a closed port refuses at once)."""
KEEPERS_ENV = "TITAN_RECOVER_SNAPSHOT_KEEPERS"
"""Comma-separated HOST:PORT of the keepers, one per node in node order (set by the launcher's
:func:`titan_recover.recover.phoenix.keeper.run_with_keeper` on one node)."""

NODE_KEEPER_ENV = "TITAN_RECOVER_SNAPSHOT_NODE_KEEPER"
"""HOST:PORT of this node's keeper as the other nodes reach it (set by the launcher of each node of a multi-node
job): the ranks gather every node's into the keepers in node order (:func:`keeper_addresses`)."""


@dataclass(kw_only=True, slots=True)
class SnapshotConfig:
    """``[recover.snapshot]``: in-memory snapshots of a job without replicas (docs/phoenix.md)."""

    interval: int = 0
    """Every this many steps each rank's state goes to the host memory of its buddy node's keeper (0: off). For
    ``[recover] replicas = 1`` (replicas restore from each other); with ``max_restarts > 0`` torchrun restarts the
    job after a rank dies and every rank refills from the keepers instead of from disk."""

    keepers: list[str] = field(default_factory=list)
    """Keeper addresses ``HOST:PORT`` in node order for multi-node jobs (start ``python -m
    titan_recover.recover.phoenix.keeper --port P`` on every node); empty: the launcher starts one on this node."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"recover.snapshot.interval must be >= 0 (0: off), got {self.interval}")
        bad = [k for k in self.keepers if not k.rpartition(":")[2].isdigit() or not k.rpartition(":")[0]]
        if bad:
            raise ValueError(f"recover.snapshot.keepers must be HOST:PORT addresses, got {bad}")


def keeper_addresses(config: SnapshotConfig, environ=os.environ, gather=None, local_ranks: int = 1) -> list[str]:
    """The keepers of this job in node order: ``[recover.snapshot] keepers`` if listed, else the one the launcher
    started on a single node, else every node's, which the launchers of a multi-node job started: ``gather`` (every
    rank's value in rank order, a collective: :func:`gather_from_ranks`) collects each rank's own node's keeper and
    :func:`node_keepers` orders them by torchrun's node ranks. An error that says how to get keepers if none."""
    keepers = list(config.keepers) or [k for k in environ.get(KEEPERS_ENV, "").split(",") if k]
    if not keepers and environ.get(NODE_KEEPER_ENV) and gather is not None:
        keepers = node_keepers(gather(environ[NODE_KEEPER_ENV]), local_ranks)
    if not keepers:
        raise RuntimeError(
            f"[recover.snapshot] interval = {config.interval} but no snapshot keeper: start the job with "
            f"./run_train.sh (it starts one per node) or list them in recover.snapshot.keepers"
        )
    return keepers


def node_keepers(own: list[str], local_ranks: int) -> list[str]:
    """Every node's keeper in node order from each rank's own node's keeper in rank order (torchrun numbers the
    ranks node by node: node = rank // local_ranks). ValueError where a node's ranks name different keepers or two
    nodes name the same one (a buddy on its own node would lose the snapshots with it)."""
    nodes = [own[start:start + local_ranks] for start in range(0, len(own), local_ranks)]
    for node, named in enumerate(nodes):
        if len(set(named)) != 1:
            raise ValueError(f"the ranks of node {node} name different snapshot keepers {sorted(set(named))}: "
                             "every node's ranks must come from one launcher")
    keepers = [named[0] for named in nodes]
    shared = sorted({k for k in keepers if keepers.count(k) > 1})
    if shared:
        raise ValueError(f"several nodes name the same snapshot keeper {shared}: a node's name must reach that "
                         "node from the others (socket.getfqdn(), as torchrun names it, or TITAN_RECOVER_NODE_ADDRESS); or "
                         "list the keepers in recover.snapshot.keepers")
    return keepers


def gather_from_ranks(value: str) -> list[str]:
    """``value`` of every rank of the job, in rank order (one all-gather over the job's default group)."""
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def buddy_node(node: int, nodes: int) -> int:
    """The node whose keeper holds ``node``'s snapshots: the next one (itself on a single node)."""
    return (node + 1) % nodes


def agreed_step(lowest: int, highest: int) -> int | None:
    """The step every rank restores, from the lowest and highest of the ranks' picks (-1: none): the pick, only if
    every rank made the same one."""
    return lowest if lowest == highest and lowest >= 0 else None


def snapshot_job(folder: str, environ=os.environ) -> str:
    """The name of a job's snapshots in the keepers: its checkpoint folder (as configured, the same text on every
    rank) and torchrun's run id (``--rdzv-id``; a new one per ``--standalone`` launch, the same across torchrun's
    restarts)."""
    text = f"{folder}|{environ.get('TORCHELASTIC_RUN_ID', '')}"
    return f"{zlib.crc32(text.encode()):08x}"


def restore_step(complete: dict[int, set[int]], ranks: int, durable_step: int) -> int | None:
    """The step to restore from memory: the newest one every rank holds a complete snapshot of, if newer than the
    durable checkpoint's (``durable_step``, 0 for none). None: train on from the durable checkpoint (or from
    scratch)."""
    if sorted(complete) != list(range(ranks)):
        return None
    common = set.intersection(*complete.values()) if complete else set()
    newest = max(common, default=None)
    return newest if newest is not None and newest > durable_step else None


class SnapshotKeys:
    @staticmethod
    def data(job: str, rank: int, slot: int) -> str:
        return f"snapshot/{job}/{rank}/{slot}/data"

    @staticmethod
    def meta(job: str, rank: int, slot: int) -> str:
        return f"snapshot/{job}/{rank}/{slot}/meta"

    @staticmethod
    def owner(rank: int) -> str:
        return f"snapshot/owner/{rank}"  # the job whose snapshots of this rank the keeper holds


def _connect(address: str, timeout_s: float, connect_s: float = CONNECT_S):
    """A client of the keeper at ``address``, ``timeout_s`` for each request. A keeper that is gone is told at
    once (a closed port refuses the connection) or after ``connect_s`` (a host that does not answer): ConnectionError.
    The TCPStore client alone would retry a refused connection until ``timeout_s``, and once more after a back-off:
    a restore from a lost node's keeper waited a minute and more before the job went on from its durable
    checkpoint. Each request is bounded (:class:`~titan_recover.recover.stores.bounded.BoundedStore`)."""
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 host, as store URLs write it
    try:
        socket.create_connection((host, int(port)), timeout=min(timeout_s, connect_s)).close()
    except OSError as error:
        raise ConnectionError(f"snapshot keeper at {address} unreachable: {error}") from None
    keeper = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return BoundedStore(keeper, f"snapshot keeper at {address}")  # a keeper's host cut off: no answer, ever


def _byte_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [bytes_view(t) for t in tensors]


def _into(payload: torch.Tensor, views: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(payload slice, tensor bytes) of every tensor: the tensors' bytes one after the other."""
    pairs, at = [], 0
    for v in views:
        pairs.append((payload[at : at + v.numel()], v))
        at += v.numel()
    return pairs


def _pack(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes, one after the other, in one host buffer (``out`` if given, of the right size)."""
    views = _byte_views(tensors)
    payload = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8) if out is None else out
    for dst, src in _into(payload, views):
        dst.copy_(src)
    return payload


def _unpack(payload: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Write ``payload`` (as :func:`_pack` made it) into ``tensors`` in place."""
    at = 0
    with torch.no_grad():
        for t in tensors:
            view = bytes_view(t)
            view.copy_(payload[at : at + view.numel()].view_as(view))
            at += view.numel()


class Snapshots:
    """One rank's snapshots: :meth:`take` after a step (and :meth:`before_optimizer` before every optimizer step),
    :meth:`restore` at start, :meth:`wait` at the end.

    The copy into host memory goes into one payload buffer, reused from snapshot to snapshot (the next one is only
    taken once the previous one was sent). ``copies`` (default: :func:`copies_for` the tensors) decides how: CPU
    tensors are copied by the sending thread while the next step's forward and backward run; CUDA tensors are
    copied by :meth:`take` onto a dedicated stream into a pinned payload (``non_blocking``, an event after the
    copies), which overlaps the next step's compute, and the sending thread hashes and publishes the payload only
    after that event completed."""

    def __init__(self, state: TrainingState, *, keepers: list[str], rank: int, ranks: int, local_ranks: int,
                 events=None, timeout_s: float = 60.0, copies: HostCopies | None = None, job: str = "job",
                 agree=None):
        self.state, self.rank, self.ranks, self.events = state, rank, ranks, events
        self.job = job
        """The job's name in the keepers' keys (:func:`snapshot_job`)."""
        self._agree = agree
        """(lowest, highest) of the ranks' picks (default: :func:`extremes` over the job's group; not called with one
        rank)."""
        self.timeout_s = timeout_s
        self.keepers = keepers
        self.buddy = buddy_node(rank // local_ranks, len(keepers))
        """The node (index into ``keepers``) whose keeper holds this rank's snapshots."""
        self._store = None
        """The buddy keeper's client, connected at first use (:attr:`store`): a keeper that is gone leaves a start
        without snapshots, not a failed start."""
        self._peer_stores = {}
        self._local_ranks = local_ranks
        self._slot = 0
        self._claimed = False
        """This rank's keeper slots are this job's (:meth:`_claim_keeper`, before the first snapshot is sent)."""
        self._sender: threading.Thread | None = None
        self._copied: threading.Event | None = None
        self._copies = copies
        self._payload: torch.Tensor | None = None
        self._device_copy: CopyEvent | None = None
        """The event of the device copy the next optimizer step must come after (CUDA)."""
        self.blocked_s = 0.0
        """Time optimizer steps waited for a snapshot's copy (the only cost on the training thread)."""
        self.skipped = 0
        self.taken = 0

    @property
    def store(self):
        """The client of this rank's buddy keeper (connected now if it is not yet)."""
        if self._store is None:
            self._store = _connect(self.keepers[self.buddy], self.timeout_s)
        return self._store

    @store.setter
    def store(self, value) -> None:
        self._store = value

    def _store_of(self, rank: int):
        node = buddy_node(rank // self._local_ranks, len(self.keepers))
        if rank == self.rank:
            return self.store
        if node not in self._peer_stores:
            self._peer_stores[node] = _connect(self.keepers[node], self.timeout_s)
        return self._peer_stores[node]

    # ---- taking ------------------------------------------------------------------------------------------
    def take(self, step: int) -> bool:
        """Copy this rank's state and send it in the background. False: skipped, because the previous snapshot is
        still being sent."""
        if self._sender is not None and self._sender.is_alive():
            self.skipped += 1
            if self.events is not None:
                self.events.emit("snapshot_skipped", step=step, reason="the previous snapshot is still being sent")
            return False
        tensors = self.state.tensors()
        # the small state (step, schedule, RNG) now; the tensors are copied while the next step's forward and
        # backward run, which only read them: the next optimizer step comes after that copy
        meta = {"step": step, "meta": self.state.metadata(), "spec": tensor_spec(tensors)}
        slot = self._slot
        self._slot = 1 - self._slot
        if self._copies is None:
            self._copies = copies_for(tensors)
        payload = self._reused_payload(tensors)
        if self._copies.asynchronous:
            self._device_copy = self._copies.copy(_into(payload, _byte_views(tensors)))
            target, args = self._wait_and_send, (slot, payload, self._device_copy, meta)
        else:
            self._copied = threading.Event()
            target, args = self._copy_and_send, (slot, tensors, payload, meta, self._copied)
        self._sender = threading.Thread(target=target, args=args, daemon=True, name="titan-recover-snapshot")
        self._sender.start()
        self.taken += 1
        return True

    def _reused_payload(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The host buffer of the snapshot: the previous one's (no longer read: its sender is done) if the size is
        the same, else a new one from ``copies`` (pinned on CUDA)."""
        nbytes = sum(bytes_view(t).numel() for t in tensors)
        if self._payload is None or self._payload.numel() != nbytes:
            self._payload = self._copies.host_buffer(nbytes)
        return self._payload

    def before_optimizer(self) -> None:
        """Called before every optimizer step: the parameters and optimizer state may only change once the
        snapshot being taken has copied them (CUDA: the step's kernels queue after the copy's event, the host
        does not wait; CPU: the training thread waits for the sending thread's copy)."""
        if self._device_copy is not None:
            self._copies.wait_on_device(self._device_copy)
            self._device_copy = None
            return
        if self._copied is not None and not self._copied.is_set():
            started = time.perf_counter()
            self._copied.wait()
            self.blocked_s += time.perf_counter() - started

    def _copy_and_send(self, slot: int, tensors: list[torch.Tensor], payload: torch.Tensor, meta: dict,
                       copied: threading.Event) -> None:
        """The sending thread on CPU: copy, let the optimizer go on, send."""
        started = time.perf_counter()
        try:
            _pack(tensors, out=payload)
        finally:
            copied.set()
        self._send(slot, payload, meta, started, copy_s=time.perf_counter() - started)

    def _wait_and_send(self, slot: int, payload: torch.Tensor, copy: CopyEvent, meta: dict) -> None:
        """The sending thread on CUDA: wait for the side stream's copy to complete, then send."""
        bind_thread(self._copies.device)  # before the wait: a new thread's device is 0
        started = time.perf_counter()
        copy.synchronize()  # the payload holds the step's bytes only from here
        self._send(slot, payload, meta, started, copy_s=time.perf_counter() - started)

    def _send(self, slot: int, payload: torch.Tensor, meta: dict, started: float, copy_s: float) -> None:
        """Hash the copied payload and store it in ``slot`` on the buddy's keeper, marking it complete last."""
        meta["bytes"] = payload.numel()
        try:
            if not self._claimed:
                self._claim_keeper()
            meta["xxh3"] = checksum(payload)
            # the slot is not complete while it is rewritten
            self.store.delete_key(SnapshotKeys.meta(self.job, self.rank, slot))
            put_blob(self.store, SnapshotKeys.data(self.job, self.rank, slot), payload)
            self.store.set(SnapshotKeys.meta(self.job, self.rank, slot), json.dumps(meta))
        except Exception as error:  # the keeper is gone: training goes on, the durable checkpoint remains
            logger.warning("rank %d: snapshot of step %d not stored: %s", self.rank, meta["step"], error)
            return
        if self.events is not None and self.rank == 0:
            self.events.emit("snapshot_stored", step=meta["step"], bytes=meta["bytes"], copy_s=copy_s,
                             send_s=time.perf_counter() - started - copy_s, blocked_s=self.blocked_s)

    def wait(self) -> None:
        """Block until the snapshot being sent is stored (end of training)."""
        if self._sender is not None:
            self._sender.join(self.timeout_s)

    # ---- restoring ---------------------------------------------------------------------------------------
    def _complete(self, rank: int) -> dict[int, tuple[int, dict]]:
        store = self._store_of(rank)
        found = {}
        for slot in (0, 1):
            key = SnapshotKeys.meta(self.job, rank, slot)
            if store.check([key]):
                meta = json.loads(store.get(key))
                found[meta["step"]] = (slot, meta)
        return found

    def restore(self, durable_step: int) -> int | None:
        """Load the newest snapshot every rank holds whole, if newer than ``durable_step`` and every rank picked it;
        returns its step or None. A collective: every rank of the job calls it."""
        found = self._pick(durable_step)
        pick = -1 if found is None else found[0]
        lowest, highest = (pick, pick) if self.ranks == 1 else self._agreed(pick)
        step = agreed_step(lowest, highest)
        if step is None:
            if highest >= 0:  # some rank could have restored: say why none does
                logger.warning("rank %d: the ranks picked different snapshots (steps %d to %d; -1: none whole); "
                               "resuming from the durable checkpoint (step %d)", self.rank, lowest, highest,
                               durable_step)
                if self.events is not None and self.rank == 0:
                    self.events.emit("snapshot_not_restored", lowest=lowest, highest=highest,
                                     durable_step=durable_step)
            return None
        _, slot, meta, payload = found
        started = time.perf_counter()
        self._load(step, payload, meta)
        self._slot = 1 - slot  # the next snapshot goes to the other slot: the one restored stays whole until then
        if self.events is not None:
            self.events.emit("snapshot_restored", step=step, rank=self.rank, bytes=meta["bytes"],
                             durable_step=durable_step, seconds=time.perf_counter() - started,
                             keeper=self.keepers[self.buddy])
        return step

    def _agreed(self, pick: int) -> tuple[int, int]:
        if self._agree is not None:
            return self._agree(pick)
        tensors = self.state.parameter_tensors()
        (lowest,), (highest,) = extremes([pick], tensors[0].device if tensors else torch.device("cpu"))
        return lowest, highest

    def discard(self) -> None:
        """Delete this rank's snapshots of this job from its keeper (a job that rolls back to an earlier step by
        name: its snapshots belong to the timeline it left)."""
        try:
            for slot in (0, 1):
                self._delete_slot(self.store, self.job, slot)
        except Exception as error:  # the keeper is gone: so are the snapshots
            logger.warning("rank %d: snapshots not discarded (%s)", self.rank, error)

    def _delete_slot(self, store, job: str, slot: int) -> None:
        """Delete one slot of ``job`` of this rank: its completion mark first, then its payload's pieces."""
        key = SnapshotKeys.meta(job, self.rank, slot)
        if store.check([key]):
            nbytes = json.loads(store.get(key))["bytes"]
            store.delete_key(key)
            delete_blob(store, SnapshotKeys.data(job, self.rank, slot), nbytes)

    def _claim_keeper(self) -> None:
        """Before this process's first snapshot: the keeper holds one job's snapshots per rank. Another job's (the
        rank's previous owner, ``snapshot/owner/<rank>``) are deleted, so that keepers kept across jobs do not grow
        with every job run on them."""
        owner_key = SnapshotKeys.owner(self.rank)
        store = self.store
        if store.check([owner_key]):
            previous = store.get(owner_key).decode()
            if previous != self.job:
                for slot in (0, 1):
                    self._delete_slot(store, previous, slot)
        store.set(owner_key, self.job)
        self._claimed = True

    def _pick(self, durable_step: int) -> tuple[int, int, dict, torch.Tensor] | None:
        """This rank's pick: (step, slot, meta, payload) of the newest step every rank holds complete, newer than
        ``durable_step``, with this rank's payload read whole; None if there is none (or a keeper is unreachable,
        or the payload is damaged: said in the log)."""
        try:
            complete = {r: self._complete(r) for r in range(self.ranks)}
        except Exception as error:  # a keeper is unreachable: its snapshots are gone
            logger.warning("rank %d: snapshots unreachable (%s); resuming from the durable checkpoint", self.rank,
                           error)
            return None
        step = restore_step({r: set(c) for r, c in complete.items() if c}, self.ranks, durable_step)
        if step is None:
            return None
        slot, meta = complete[self.rank][step]
        params = tensor_spec(self.state.parameter_tensors())
        if meta["spec"][: len(params)] != params:  # another model or sharding: another job under the same name
            logger.warning("rank %d: the snapshot of step %d has other parameters than this job (another job's, "
                           "under the same checkpoint folder and run id); resuming from the durable checkpoint",
                           self.rank, step)
            return None
        try:
            return step, slot, meta, self._read(step, slot, meta)
        except Exception as error:  # damaged, or the keeper went away while it was read
            logger.warning("%s", error)
            return None

    def _read(self, step: int, slot: int, meta: dict) -> torch.Tensor:
        """This rank's payload of ``step`` from its keeper, size and xxHash3 checked."""
        try:
            payload = get_blob(self.store, SnapshotKeys.data(self.job, self.rank, slot), meta["bytes"])
        except ValueError:
            payload = None
        if payload is None or checksum(payload) != meta["xxh3"]:
            raise RuntimeError(f"rank {self.rank}: the snapshot of step {step} in the keeper is damaged (size or "
                               "xxHash3 differs); resuming from the durable checkpoint")
        return payload

    def _load(self, step: int, payload: torch.Tensor, meta: dict) -> None:
        """Write ``payload`` into this rank's tensors (layout checked) and load the step's metadata."""
        if not self.state.tensors():
            raise StateMismatch("nothing to restore into")
        self.state.ensure_optimizer_state()
        tensors = self.state.tensors()
        if meta["spec"] != tensor_spec(tensors):
            raise StateMismatch(f"rank {self.rank}: the snapshot of step {step} has another layout than this job "
                                "(a different model, sharding or optimizer config)")
        _unpack(payload, tensors)
        self.state.load_metadata(meta["meta"])
