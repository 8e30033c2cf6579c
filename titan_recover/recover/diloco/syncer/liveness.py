"""Which learners the syncer still expects deltas from (docs/diloco.md, "Liveness"): alive while no rank's
heartbeat (relayed by the learner's leader rank) in the coordinator's store stayed unchanged for
``heartbeat_timeout_s``, and no rank's main-thread progress stamp in it for ``progress_timeout_s`` (a learner
stuck while its heartbeat thread beats), on the syncer's own clock (only over time it was watching); and not
reported done. A learner whose heartbeat itself stayed unchanged for ``progress_timeout_s`` is stopped."""

from __future__ import annotations

import math
import time

from titan_recover.recover.groups.keys import GroupKeys
from titan_recover.recover.groups.liveness import absent_beat, decode_group_beat, judge_liveness, LivenessWatch
from titan_recover.recover.stores import read_keys

LIVENESS_EVERY_S = 0.2


class LearnerLiveness:
    def __init__(self, coordinator, *, learners: int, ranks: int, heartbeat_timeout_s: float,
                 progress_timeout_s: float = math.inf):
        self.coordinator, self.learners, self.ranks = coordinator, learners, ranks
        self.watch = LivenessWatch(heartbeat_timeout_s, progress_timeout_s, max_gap_s=2 * LIVENESS_EVERY_S)
        self.incarnation: dict[int, int] = {}
        """Each learner's start last judged alive (what the syncer gives back for, once it is lost)."""
        self.reasons: dict[int, str] = {}
        """Why each learner with a beat was last judged not alive (no heartbeat, or no progress)."""
        self.hung: set[int] = set()
        """Learners last judged with a rank whose heartbeat beats but whose main thread made no progress."""
        self.stopped: dict[int, int] = {}
        """Learner -> its start, for learners last judged with a rank whose heartbeat itself stayed unchanged for
        ``progress_timeout_s``: the whole process is stopped (SIGSTOP, a freeze) or stuck beyond its heartbeat
        thread, and will not come back by itself. Not a learner some of whose ranks reported done: its leader rank
        stops relaying the beats when it finishes, while the others may still wait for their last deltas to leave."""

    def judge(self) -> tuple[set[int], set[int]]:
        """(learners alive, learners done: every rank reported done)."""
        alive, done, beats = set(), set(), {}
        ranks = range(self.ranks)
        done_keys = [GroupKeys.done(learner, rank) for learner in range(self.learners) for rank in ranks]
        beat_keys = [GroupKeys.heartbeat(learner) for learner in range(self.learners)]  # relayed by its leader rank
        values = read_keys(self.coordinator, done_keys + beat_keys)  # one request on etcd
        finishing = set()
        for learner in range(self.learners):
            reported = values[learner * self.ranks : (learner + 1) * self.ranks]
            if None not in reported:
                done.add(learner)
                continue
            if any(v is not None for v in reported):  # its leader stops relaying beats once it reported done
                finishing.add(learner)
            beat = values[len(done_keys) + learner]
            relayed = decode_group_beat(beat) if beat is not None else {}
            if 0 in relayed:
                incarnation = relayed[0].incarnation
                beats[learner] = [relayed.get(rank) or absent_beat(incarnation) for rank in range(self.ranks)]
        # judged on the syncer's own clock, over the time it watched (a merge that kept it busy is not held against
        # the learners); any start of a learner counts: its restart is alive
        self.watch.look(time.monotonic(),
                        {(learner, rank): b for learner, bs in beats.items() for rank, b in enumerate(bs)})
        watch = self.watch
        for learner, bs in beats.items():
            ages = watch.ages(learner, ranks, bs[0].incarnation)  # once: the verdict and the stop read the same
            verdict = judge_liveness(learner, ages, watch.heartbeat_timeout_s, watch.progress_timeout_s)
            if verdict.alive:
                alive.add(learner)
                self.incarnation[learner] = bs[0].incarnation
            else:
                self.reasons[learner] = verdict.reason("learner")
            if verdict.hung_ranks:
                self.hung.add(learner)
            else:
                self.hung.discard(learner)
            quiet = [a[0] for a in ages.values() if a is not None]
            if learner not in finishing and any(q > watch.progress_timeout_s for q in quiet):
                self.stopped[learner] = bs[0].incarnation
            else:
                self.stopped.pop(learner, None)
        return alive, done
