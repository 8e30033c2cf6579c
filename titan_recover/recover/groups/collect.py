"""Deleting the protocol's keys that no member can read any more (docs/replica_groups.md "Keys deleted").

The rank that stores a commit decision (the last group in at the commit barrier: one writer per commit) then
deletes, through :class:`KeyCollector`:

* the keys of the step before, in the same epoch (``reduced/e{e}/s{t-1}``, ``decision/e{e}/s{t-1}``): a commit of
  step ``t`` in epoch ``e`` needs every member's leader to have counted in at ``t``, so every member is past the
  barrier of ``t - 1``; ranks other than the leader read the decision in their group's own store. On every store.
* with a store that deletes key prefixes (etcd: ``EtcdStore.delete_keys``), every key of the epochs before ``e``
  (``GroupKeys.of_epoch``): the same commit puts every member's main thread in epoch ``e``, past every older epoch's
  members, flag, joins, admissions, step keys and fault-tolerant groups. The embedded TCPStore cannot delete
  gloo's rendezvous keys by prefix and lives only as long as the job: it keeps old epochs' keys.

Nobody waits on a deleted key: members are past it, and a joiner reads only the newest epoch (and looks for older
admissions with ``check``, which reads a deleted key as absent). A process that was dropped meanwhile may still
write into an old epoch (a late fault flag or join): such a key is not read by anyone; it stays until a later
collection by a process that starts from epoch 0 (each process collects from 0 at its first commit).
"""

from __future__ import annotations

import logging

from torch.distributed import DistError, Store

from titan_recover.recover.groups.keys import GroupKeys

logger = logging.getLogger(__name__)


def step_keys(epoch: int, step: int | str) -> list[str]:
    """The keys of one step's commit barrier in the job's store."""
    return [GroupKeys.reduced(epoch, step), GroupKeys.decision(epoch, step)]


class KeyCollector:
    """One rank's deletions, run after each commit decision it stored (:meth:`after_commit`)."""

    def __init__(self, store: Store):
        self.store = store
        self.by_prefix = callable(getattr(store, "delete_keys", None))
        """The store deletes key prefixes (etcd): old epochs are collected too."""
        self.collected_below = 0
        """Every epoch below this one has been collected by this rank."""

    def after_commit(self, epoch: int, step: int | str) -> int:
        """This rank stored the commit of ``step`` in ``epoch``: delete what no member can read any more. A store
        error is logged, not raised (the step committed; the keys are deleted at a later commit). Returns how many
        keys were deleted (-1: not known, on a store without prefix deletes)."""
        keys = step_keys(epoch, step - 1) if isinstance(step, int) and step > 0 else []
        prefixes: list[str] = []
        collect_below = epoch if self.by_prefix else self.collected_below
        for old in range(self.collected_below, collect_below):
            more_keys, more_prefixes = GroupKeys.of_epoch(old)
            keys, prefixes = keys + more_keys, prefixes + more_prefixes
        try:
            if self.by_prefix:
                deleted = self.store.delete_keys(keys, prefixes)
            else:
                for key in keys:
                    self.store.delete_key(key)
                deleted = -1
        except DistError as error:
            logger.warning("epoch %d step %s: could not delete the protocol's old keys (%s); a later commit will",
                           epoch, step, error)
            return 0
        self.collected_below = collect_below
        return deleted
