"""The data-block protocol in the coordinator's store (docs/diloco.md, "A learner", its **Data**).

A data block is one inner step's replica microbatches. Learners claim blocks from the job's counter, record the
block they train and the blocks they finished; the block of a learner that died or hung is given back (by the syncer on
losing it, or by the learner's restart) and the next claim of any learner takes it first. Every decision that two
processes may race for (a hold given back or finished, take a given-back block, count a block trained) is a
compare-and-set on an absent key, so it happens once: a learner taken for lost that comes back finds its block
given away and ends, rather than send progress on data another learner trains. Used by the learner and the
syncer; talks only to the store passed in.
"""

from __future__ import annotations

import uuid

from titan_recover.recover.diloco.rules import DilocoKeys
from titan_recover.recover.groups.member import wait_for_key, wait_slices


def set_once(store, key: str, who: str) -> bool:
    """Compare-and-set on an absent key: True for the one call whose value landed (each call writes a value of
    its own, so a caller that already holds the key does not take it again)."""
    token = f"{who}/{uuid.uuid4().hex}"
    return store.compare_set(key, "", token) == token.encode()


def claim_block(coordinator, who: str) -> int:
    """The next block to train: one given back by a dead learner if any is free, else the next of the counter
    (past the budget once it is all claimed: the caller compares)."""
    block = claim_requeued(coordinator, who)
    return block if block is not None else coordinator.add(DilocoKeys.NEXT_BLOCK, 1) - 1


def record_training(coordinator, learner: int, block: int, step: int, incarnation: int) -> None:
    """``learner``'s start ``incarnation`` trains ``block`` at inner step ``step`` (what is given back if it dies
    now)."""
    coordinator.set(DilocoKeys.block(learner), f"{block} {step} {incarnation}")


def record_trained(coordinator, learner: int, block: int, step: int, incarnation: int, who: str) -> bool:
    """``learner``'s start ``incarnation`` finished ``block`` at inner step ``step``, unless its hold of the block was
    given back meanwhile (it was taken for lost: no heartbeat, or no progress); False then, and the caller must not
    send the block's progress (another learner trains the block: sent too, its data would count twice).

    The hold ends once, one way: this start's compare-and-set on the hold's key (:meth:`DilocoKeys.hold`) against
    the giver's (:func:`requeue_block`). Then the block counts as trained once, whoever finished it first, and
    nothing is to be given back. In that order: whoever reads the learner's key as done finds the block's done key
    written (:func:`collect_done` relies on it)."""
    if not set_once(coordinator, DilocoKeys.hold(block, learner, incarnation), f"trained:{who}"):
        return False
    if set_once(coordinator, DilocoKeys.done_of(block), who):
        coordinator.add(DilocoKeys.BLOCKS_DONE, 1)
    coordinator.set(DilocoKeys.block(learner), f"done {step} {incarnation}")
    return True


def held(coordinator, learner: int) -> tuple[str, int, int] | None:
    """What ``learner``'s key says (:func:`record_training`, :func:`record_trained`): its block, or ``"done"``; the
    inner step; the start that wrote it. None before its first claim."""
    key = DilocoKeys.block(learner)
    if not coordinator.check([key]):
        return None
    block, step, incarnation = coordinator.get(key).decode().split()
    return block, int(step), int(incarnation)


def collect_done(coordinator, learners: int) -> int:
    """Delete the done keys (and their finishers' hold keys) of blocks nobody can finish again, so that they do not
    grow with the job; returns the block below which they are collected. Called by the syncer only, in the thread
    that gives blocks back.

    A block given back (its learner taken for lost, maybe wrongly) keeps its keys, a few per failure: the learner
    may come back and try to finish it, and its hold's key must still say given back. Any other block was trained
    by its claimer alone; once no learner's key names it, it can no longer be given back (giving back reads the
    learner's key, here or at a restart of a dead learner), so its keys are never read again. The watermark
    is the lowest block a learner's key names as in training (and that was not given back), or the claim counter as
    the previous pass read it (a block claimed since may not be named by its learner's key yet); both kept in the
    coordinator's store, so a restarted syncer goes on from them."""
    start = int(coordinator.add(DilocoKeys.COLLECTED_BELOW, 0))
    claimed = int(coordinator.add(DilocoKeys.NEXT_BLOCK, 0))
    # a block claimed since the previous pass may not be named by its learner's key yet: not collected before then
    end = int(coordinator.add(DilocoKeys.COLLECT_CLAIMED, 0))
    coordinator.add(DilocoKeys.COLLECT_CLAIMED, claimed - end)
    for learner in range(learners):
        record = held(coordinator, learner)
        # a block given back is kept whatever the watermark: its former holder, which can no longer finish it, does
        # not hold the watermark
        if record is not None and record[0] != "done":
            if not coordinator.check([DilocoKeys.requeued_of(int(record[0]))]):
                end = min(end, int(record[0]))
    for block in range(start, end):
        if not coordinator.check([DilocoKeys.requeued_of(block)]):
            _collect_block(coordinator, block)
    if end > start:
        coordinator.add(DilocoKeys.COLLECTED_BELOW, end - start)
    return max(start, end)


def _collect_block(coordinator, block: int) -> None:
    """Delete the done key of a block trained by its claimer alone, and that claimer's hold key (its value names
    the finisher, ``who`` = ``learner.incarnation``)."""
    key = DilocoKeys.done_of(block)
    if not coordinator.check([key]):
        return
    finisher = coordinator.get(key).decode().split("/")[0]
    learner, _, incarnation = finisher.partition(".")
    if learner.isdigit() and incarnation.isdigit():
        coordinator.delete_key(DilocoKeys.hold(block, int(learner), int(incarnation)))
    coordinator.delete_key(key)


def blocks_trained(coordinator) -> int:
    return int(coordinator.add(DilocoKeys.BLOCKS_DONE, 0))


def last_step(coordinator, learner: int) -> int | None:
    """The inner step of the block ``learner`` trained or finished last (its restart continues from it), or None
    before its first claim."""
    record = held(coordinator, learner)
    return None if record is None else record[1]


def share_claim(coordinator, learner: int, incarnation: int, count: int, block: int) -> None:
    """Rank 0's ``count``-th claim, for the learner's other ranks (:func:`read_claim`). The claim two before is
    deleted: every rank read it before the inner step it names, whose collectives rank 0 has been through since,
    so the keys of a learner's claims stay two however long the job runs."""
    coordinator.set(DilocoKeys.claim(learner, incarnation, count), str(block))
    if count >= 2:
        coordinator.delete_key(DilocoKeys.claim(learner, incarnation, count - 2))


def read_claim(coordinator, learner: int, incarnation: int, count: int, waiting=lambda: None,
               most_s: float = 4.0) -> int:
    """Rank 0's ``count``-th claim, once it is there: a blocking wait, in slices of at most ``most_s`` (``waiting``
    is called between them): rank 0 may wait at the end of the budget for a block to come back, longer than the
    store's timeout."""
    key = DilocoKeys.claim(learner, incarnation, count)
    for slice_s in wait_slices(min(1.0, most_s), most_s):
        if wait_for_key(coordinator, key, slice_s):
            return int(coordinator.get(key))
        waiting()


def requeue_block(coordinator, learner: int, who: str, *, incarnation_at_most: int | None = None) -> int | None:
    """Give back the block a dead learner was training, unless it finished it or someone gave back that hold of it
    already; returns the block given back. The syncer (on losing the learner) and the learner's restart both try.

    ``incarnation_at_most``: the start of the learner the caller saw die. The syncer judges a learner lost from
    heartbeats that may be a moment old; by the time it reads the learner's key a restart may have claimed a new
    block there, which is not the dead start's to give back (it would be trained twice). The restart gave back its
    predecessor's block before its first claim."""
    record = held(coordinator, learner)
    if record is None:
        return None
    block, _, incarnation = record
    if block == "done" or incarnation_at_most is not None and incarnation > incarnation_at_most:
        return None
    # once per hold: a block given back, taken by another learner that dies too, is given back again
    if not set_once(coordinator, DilocoKeys.hold(int(block), learner, incarnation), who):
        _count_for_holder(coordinator, int(block), learner, incarnation, who)
        return None  # given back already, or the holder finished it
    coordinator.set(DilocoKeys.requeued_of(int(block)), who)  # before the learner's key can name another block
    number = coordinator.add(DilocoKeys.REQUEUED, 1) - 1
    coordinator.set(DilocoKeys.requeue(number), block)
    return int(block)


def _count_for_holder(coordinator, block: int, learner: int, incarnation: int, who: str) -> None:
    """The hold ended trained, but its holder may have stopped between the two writes of :func:`record_trained`
    (the hold's, then the count): count the block for it, once. Its keys are kept from then on (the holder's key may
    name the block for ever, and the holder, if it only hung, counts it again: its done key must still be there)."""
    value = coordinator.get(DilocoKeys.hold(block, learner, incarnation)).decode()
    if value.startswith("trained:") and not coordinator.check([DilocoKeys.done_of(block)]):
        coordinator.set(DilocoKeys.requeued_of(block), who)
        if set_once(coordinator, DilocoKeys.done_of(block), f"{learner}.{incarnation}"):
            coordinator.add(DilocoKeys.BLOCKS_DONE, 1)


def claim_requeued(coordinator, who: str) -> int | None:
    """Take a block given back by a dead learner, if any is free."""
    for number in range(coordinator.add(DilocoKeys.REQUEUED, 0)):
        key = DilocoKeys.requeue(number)
        if coordinator.check([key]) and set_once(coordinator, DilocoKeys.requeue_owner(number), who):
            return int(coordinator.get(key))
    return None
