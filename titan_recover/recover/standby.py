"""Standing by for a role of the job on its etcd store: the coordinator's (docs/deploy.md "Standby coordinators")
and the diloco syncer's (docs/diloco.md "Standby syncers").

With an etcd store every node's launcher runs a candidate for each role. A candidate waits in a
:class:`~titan_recover.recover.stores.leader.LeaderElection` on the role's key and takes the role only once it
leads; it writes to the job's store only through the election's fenced store, and it ends its process the moment
its leadership is lost (:func:`exit_when_lost`, exit code :data:`EXIT_LOST`), after which its launcher starts it
again as a candidate.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta

logger = logging.getLogger(__name__)

EXIT_LOST = 76
"""Exit code of a leader whose leadership was lost (its lease could not be refreshed, or a write was refused)."""
LEADER_TTL_S = 2
"""The leader's lease (etcd's minimum with its default election timeout): a candidate takes over about this long
after the leader stopped refreshing it."""
CAMPAIGN_SLICE_S = 2.0
"""A candidate looks whether the job is over this often while it waits to lead."""


def lead(store, key: str, identity: str, *, over_key: str):
    """Stand by until this process leads the role held in ``key`` (a ``LeaderElection``); None when the job is over
    (``over_key`` is set) before that: nothing is left to lead."""
    from titan_recover.recover.stores.leader import LeaderElection

    election = LeaderElection(store, key, identity, ttl_s=LEADER_TTL_S)
    logger.info("%s: standing by for %s", identity, key)
    while not store.check([over_key]):
        try:
            election.campaign(timedelta(seconds=CAMPAIGN_SLICE_S))
        except TimeoutError:
            continue
        except RuntimeError:  # its lease lapsed while standing by (etcd out of reach a while): a new candidacy
            if not election.lost.is_set():
                raise
            logger.warning("%s: the standby's lease was lost (%s); standing by again with a new one", identity,
                           election.lost_reason)
            election.resign()
            election = LeaderElection(store, key, identity, ttl_s=LEADER_TTL_S)
            continue
        if not store.check([over_key]):
            return election
        break  # led only because the last leader ended the job and resigned
    election.resign()
    return None


def took_office(election, events, role: str) -> None:
    """Record that this candidate leads (event ``<role>_elected``) and end the process the moment it no longer
    does (:func:`exit_when_lost`)."""
    events.emit(f"{role}_elected", identity=election.identity, term=election.term)
    exit_when_lost(election, events, role)


def refused(election, events, role: str, error: Exception) -> int:
    """A write of this leader was refused (``NotLeader``: another candidate leads, nothing was written): say so,
    record it (event ``<role>_lost_leadership``, when ``events`` exists yet) and return the exit code."""
    logger.error("%s: %s: exiting", election.identity, error)
    if events is not None:
        events.emit(f"{role}_lost_leadership", identity=election.identity, term=election.term,
                    reason=f"a write was refused: {error}")
    return EXIT_LOST


def exit_when_lost(election, events, role: str) -> None:
    """A thread that ends this process the moment its leadership is lost (event ``<role>_lost_leadership``):
    another candidate may lead ``ttl`` later, and two leaders of a role must never act at once (the window that
    remains is in docs/deploy.md "Fenced writes")."""
    def watch() -> None:
        election.lost.wait()
        events.emit(f"{role}_lost_leadership", identity=election.identity, term=election.term,
                    reason=election.lost_reason)
        logger.error("%s lost the leadership (term %s: %s): exiting", election.identity, election.term,
                     election.lost_reason)
        os._exit(EXIT_LOST)

    threading.Thread(target=watch, name="leadership", daemon=True).start()
