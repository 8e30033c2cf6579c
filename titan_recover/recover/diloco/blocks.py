"""The data-block protocol in the coordinator's store (docs/diloco.md, "A learner: Data").

A data block is one inner step's replica microbatches. Learners claim blocks from the job's counter, record the
block they train and the blocks they finished; the block of a learner that died is given back (by the syncer on
losing it, or by the learner's restart) and the next claim of any learner takes it first. Every decision that two
processes may race for (give back, take a given-back block, count a block trained) is a compare-and-set on an
absent key, so it happens once. Used by the learner and the syncer; talks only to the store passed in.
"""

from __future__ import annotations

import uuid

from titan_recover.recover.diloco.rules import DilocoKeys


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


def record_trained(coordinator, learner: int, block: int, step: int, incarnation: int, who: str) -> None:
    """``learner`` finished ``block`` at inner step ``step``: the block counts as trained once, whoever finished it
    first; then nothing is to be given back. In that order: whoever reads the learner's key as done finds the
    block's done key written (:func:`collect_done` relies on it)."""
    if set_once(coordinator, DilocoKeys.done_of(block), who):
        coordinator.add(DilocoKeys.BLOCKS_DONE, 1)
    coordinator.set(DilocoKeys.block(learner), f"done {step} {incarnation}")


def held(coordinator, learner: int) -> tuple[str, int, int] | None:
    """What ``learner``'s key says (:func:`record_training`, :func:`record_trained`): its block, or ``"done"``; the
    inner step; the start that wrote it. None before its first claim."""
    key = DilocoKeys.block(learner)
    if not coordinator.check([key]):
        return None
    block, step, incarnation = coordinator.get(key).decode().split()
    return block, int(step), int(incarnation)


def collect_done(coordinator, learners: int) -> int:
    """Delete the done keys of blocks nobody can finish again, so that they do not grow with the job; returns the
    block below which they are collected. Called by the syncer only, in the thread that gives blocks back.

    A block's done key decides who counts it when two learners may finish it, which happens only to a block given
    back (its learner taken for dead, maybe wrongly): those keep theirs, one per failure. Any other block was trained
    by its claimer alone; once no learner's key names it, it can no longer be given back (giving back reads the
    learner's key, here or at a restart of a dead learner), so its done key is never read again. The watermark
    is the lowest block a learner's key names as in training, or the claim counter read before those keys (a block
    claimed since is above it); kept in the coordinator's store, so a restarted syncer goes on from it."""
    start = int(coordinator.add(DilocoKeys.COLLECTED_BELOW, 0))
    end = int(coordinator.add(DilocoKeys.NEXT_BLOCK, 0))
    for learner in range(learners):
        record = held(coordinator, learner)
        if record is not None and record[0] != "done":
            end = min(end, int(record[0]))
    for block in range(start, end):
        if not coordinator.check([DilocoKeys.requeued_of(block)]):
            coordinator.delete_key(DilocoKeys.done_of(block))
    if end > start:
        coordinator.add(DilocoKeys.COLLECTED_BELOW, end - start)
    return max(start, end)


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


def read_claim(coordinator, learner: int, incarnation: int, count: int) -> int:
    """Waits (the store's timeout) for rank 0's ``count``-th claim."""
    return int(coordinator.get(DilocoKeys.claim(learner, incarnation, count)))


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
    if not set_once(coordinator, DilocoKeys.give_back(int(block), learner, incarnation), who):
        return None
    coordinator.set(DilocoKeys.requeued_of(int(block)), who)  # before the learner's key can name another block
    number = coordinator.add(DilocoKeys.REQUEUED, 1) - 1
    coordinator.set(DilocoKeys.requeue(number), block)
    return int(block)


def claim_requeued(coordinator, who: str) -> int | None:
    """Take a block given back by a dead learner, if any is free."""
    for number in range(coordinator.add(DilocoKeys.REQUEUED, 0)):
        key = DilocoKeys.requeue(number)
        if coordinator.check([key]) and set_once(coordinator, DilocoKeys.requeue_owner(number), who):
            return int(coordinator.get(key))
    return None
