"""What learners and the syncer exchange through the syncer's store (docs/diloco.md), both sides of each message.

* a parameter offer ``init/{learner}/{rank}``: a rank's local shards as one float32 payload, with names,
  shapes and fragment ranges (the initial global model), deleted by the syncer once it built the global model and by
  its learner once it adopted it;
* a hello ``hello/{learner}/{rank}``: the incarnation sending from this rank (it numbers its deltas from
  0 in every syncer store);
* a delta ``delta/{learner}/{incarnation}/{rank}/{number}``: one fragment's progress, its tokens, inner step
  and the global version it was computed from;
* a global fragment ``global/{fragment}/{rank}/{version}``.

Payloads are blobs (:mod:`titan_recover.recover.groups.blobs`: pieces under the store's 8 MB message limit); the
``/meta`` key is written last and marks a message complete.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from titan_recover.recover.diloco.rules import DilocoKeys, Version
from titan_recover.recover.groups.blobs import delete_blob, get_blob, put_blob
from titan_recover.recover.phoenix.state_transfer import bytes_view
from titan_recover.recover.stores import read_keys


def offer_parameters(store, learner: int, rank: int, names: list[str], tensors: list[torch.Tensor],
                     ranges: list[tuple[int, int]], global_shapes: list[list[int]] | None = None) -> int:
    """Offer this rank's parameters (its local shards) as the initial global model (the syncer takes the first
    learner whose every rank offered). ``global_shapes``: the whole parameters' shapes, if sharded. Returns the
    payload's size in bytes (what :func:`withdraw_offer` needs)."""
    payload = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    prefix = DilocoKeys.init(learner, rank)
    nbytes = put_blob(store, prefix, bytes_view(payload))
    shapes = [list(t.shape) for t in tensors]
    store.set(DilocoKeys.meta(prefix), json.dumps({
        "bytes": nbytes, "names": names, "shapes": shapes, "ranges": ranges,
        "global_shapes": global_shapes or shapes}))
    return nbytes


def withdraw_offer(store, learner: int, rank: int, nbytes: int | None = None) -> None:
    """Delete a rank's offer (a whole model's float32 bytes per learner): the syncer once it built the global model
    from the offers, a learner once the global model exists (its offer is then never read; it may have been
    written after the syncer's deletions). ``nbytes``: the payload's size, which the offerer knows even when its
    completion mark was never written; otherwise read from the mark (no mark: nothing to delete). The mark goes
    first, so that no reader takes a half-deleted offer for a complete one."""
    prefix = DilocoKeys.init(learner, rank)
    mark = DilocoKeys.meta(prefix)
    if nbytes is None:
        if not store.check([mark]):
            return
        nbytes = json.loads(store.get(mark))["bytes"]
    store.delete_key(mark)
    delete_blob(store, prefix, nbytes)


def read_offer(store, learner: int, ranks: int) -> tuple[list[dict], list[torch.Tensor]] | None:
    """Every rank's offer of ``learner`` (metadata, flat float32 payload), or None while one is missing."""
    keys = [DilocoKeys.meta(DilocoKeys.init(learner, p)) for p in range(ranks)]
    if not all(store.check([k]) for k in keys):
        return None
    metas = [json.loads(store.get(k)) for k in keys]
    flats = [get_blob(store, DilocoKeys.init(learner, p), m["bytes"]).view(torch.float32)
             for p, m in enumerate(metas)]
    return metas, flats


@dataclass
class DeltaMessage:
    """One rank's delta of one fragment, as the syncer reads it."""

    fragment: int
    step: int
    tokens: int
    base: Version
    data: torch.Tensor  # float32, flat


def announce_sender(store, learner: int, rank: int, incarnation: int) -> None:
    store.set(DilocoKeys.hello(learner, rank), str(incarnation))


def read_sender(store, learner: int, rank: int) -> int | None:
    """The incarnation sending from ``(learner, rank)``, or None before its first hello."""
    hello = read_keys(store, [DilocoKeys.hello(learner, rank)])[0]
    return None if hello is None else int(hello)


def write_delta(store, learner: int, incarnation: int, rank: int, number: int, *, fragment: int, step: int,
                tokens: int, base: Version, data: torch.Tensor) -> None:
    prefix = DilocoKeys.delta(learner, incarnation, rank, number)
    nbytes = put_blob(store, prefix, bytes_view(data))
    store.set(DilocoKeys.meta(prefix), json.dumps({
        "fragment": fragment, "step": step, "tokens": tokens, "base": list(base), "bytes": nbytes,
        "sent_at": time.time()}))


def take_delta(store, learner: int, incarnation: int, rank: int, number: int) -> DeltaMessage | None:
    """Read and delete the ``number``-th delta of this sender; None while it is not complete."""
    prefix = DilocoKeys.delta(learner, incarnation, rank, number)
    if not store.check([DilocoKeys.meta(prefix)]):
        return None
    meta = json.loads(store.get(DilocoKeys.meta(prefix)))
    data = get_blob(store, prefix, meta["bytes"]).view(torch.float32).clone()
    delete_blob(store, prefix, meta["bytes"])
    store.delete_key(DilocoKeys.meta(prefix))
    return DeltaMessage(meta["fragment"], meta["step"], meta["tokens"], tuple(meta["base"]), data)


def publish_fragment(store, fragment: int, rank: int, version: int, data: torch.Tensor) -> None:
    """Publish a global fragment's ``version`` and delete ``version - 2`` (a learner may still be reading the
    previous one)."""
    prefix = DilocoKeys.fragment(fragment, rank, version)
    nbytes = put_blob(store, prefix, bytes_view(data))
    store.set(DilocoKeys.meta(prefix), str(nbytes))
    old = DilocoKeys.fragment(fragment, rank, version - 2)
    if version >= 2 and store.check([DilocoKeys.meta(old)]):
        delete_blob(store, old, int(store.get(DilocoKeys.meta(old))))
        store.delete_key(DilocoKeys.meta(old))


def read_fragment(store, fragment: int, rank: int, version: int) -> torch.Tensor | None:
    """A published global fragment, or None when it was already replaced by a newer one."""
    prefix = DilocoKeys.fragment(fragment, rank, version)
    if not store.check([DilocoKeys.meta(prefix)]):
        return None
    nbytes = int(store.get(DilocoKeys.meta(prefix)))
    return get_blob(store, prefix, nbytes).view(torch.float32).clone()
