"""The hang observer: an out-of-band process per replica group that names who hangs (docs/scout.md).

    python -m titan_recover.recover.scout.observer --run-dir DIR --replica I --incarnation N --ranks W --threshold-s T
        [--end-hung]

Started by the launcher next to every start of a replica group's torchrun (``[recover.localize] hang_threshold_s
> 0``). It is not a thread of the trainer, so it works while every trainer thread is blocked in a collective. It
only reads the ranks' beacons (:mod:`titan_recover.recover.scout.beacon`, shared memory on the node): a healthy run sends
nothing beyond them. When some rank's beacon has not moved for ``T`` seconds, :func:`diagnose` names the rank
that is behind or whose collective diverged; the observer writes ``hang_report_replica{I}_start{N}.json`` to the
run folder, emits ``hang_detected``, and with ``--end-hung`` ends the replica's processes, so that the
fault-tolerant group treats the replica as failed (and the launcher may restart it).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

from titan_recover.process_exit import pid_alive
from titan_recover.recover.scout.beacon import beacon_path, BeaconRecord, read_beacon
from titan_recover.recover.events import EventLog
from titan_recover.recover.notice import NoticeFile, SigtermTriage

logger = logging.getLogger("titan_recover.observer")

IGNORED_PHASES = ("startup", "done", "reduction", "commit", "rebuild", "transfer", "rejoin_wait")
"""Not judged: a rank building its model (no beacon yet updated), finished, or waiting for other replicas (the
cross-replica phases: the fault-tolerant group's deadlines and the coordinator cover those, and a wait there can
block without a beacon update, e.g. while a new epoch's gloo group connects to a peer that hangs elsewhere)."""


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    """``behind`` (some ranks never entered the collective the others wait in), ``diverged`` (ranks in the same
    collective number issued different collectives), ``left_behind_inside`` (some ranks completed the collective
    the others still show themselves inside: those are stuck after it), ``stuck_in_collective`` (every rank inside the same
    collective: the hang is in the collective or a peer outside the group), ``stalled`` (no collective involved)."""
    ranks: tuple[int, ...]
    """The ranks named (empty when nobody in the group can be blamed)."""
    reason: str
    stalled_s: float


def diagnose(beacons: dict[int, BeaconRecord | None], now: float, threshold_s: float) -> Diagnosis | None:
    """Pure: who hangs, from the ranks' latest beacons; None while every judged rank moved within ``threshold_s``."""
    live = {r: b for r, b in beacons.items() if b is not None and b.phase not in IGNORED_PHASES}
    stale = {r: now - b.time for r, b in live.items() if now - b.time > threshold_s}
    if not stale:
        return None
    stalled_s = max(stale.values())

    def where(r: int) -> str:
        b = live[r]
        inside = f" inside collective #{b.seq} {b.op}" if b.phase == "collective" else f" after collective #{b.seq}"
        return f"rank {r}: step {b.step} {b.phase}{inside}, {now - b.time:.1f} s ago"

    inside = {r: b for r, b in live.items() if b.phase == "collective"}
    if inside:
        newest = max(b.seq for b in inside.values())
        waiting = {r: b for r, b in inside.items() if b.seq == newest}
        by_op = collections.defaultdict(list)
        for r, b in waiting.items():
            by_op[(b.op_fingerprint, b.op)].append(r)
        if len(by_op) > 1:
            (_, common), holders = max(by_op.items(), key=lambda item: len(item[1]))
            strict = len(holders) > len(waiting) // 2
            odd = tuple(sorted(r for r in waiting if r not in holders)) if strict else tuple(sorted(waiting))
            issued = "; ".join(f"ranks {sorted(rs)} issued {op}" for (_, op), rs in sorted(by_op.items()))
            reason = (f"collective #{newest} diverged: {issued}"
                      + (f"; ranks {list(odd)} differ from the majority ({common})" if strict else
                         "; no majority says which is wrong"))
            return Diagnosis("diverged", odd, reason, stalled_s)
        op = next(iter(by_op))[1]
        behind = tuple(sorted(r for r in live if r not in waiting and live[r].seq < newest))
        if behind:
            reason = (f"ranks {sorted(waiting)} wait in collective #{newest} {op}; ranks {list(behind)} never entered "
                      "it: " + "; ".join(where(r) for r in behind))
            return Diagnosis("behind", behind, reason, stalled_s)
        past = sorted(r for r in live if r not in waiting)
        if past:  # they completed the collective the others still show themselves inside: those others are stuck
            stuck = tuple(sorted(waiting))
            reason = (f"ranks {past} completed collective #{newest} {op}; ranks {list(stuck)} still show themselves "
                      "inside it: " + "; ".join(where(r) for r in stuck))
            return Diagnosis("left_behind_inside", stuck, reason, stalled_s)
        return Diagnosis("stuck_in_collective", (), f"every rank is inside collective #{newest} {op} for "
                         f"{stalled_s:.1f} s: the collective itself, or a peer outside this group, hangs", stalled_s)
    ranks = tuple(sorted(stale))
    return Diagnosis("stalled", ranks, "no progress: " + "; ".join(where(r) for r in ranks), stalled_s)


class Observer:
    def __init__(self, run_dir: str, replica: int, incarnation: int, ranks: int, threshold_s: float, end_hung: bool):
        self.run_dir, self.replica, self.incarnation, self.ranks = run_dir, replica, incarnation, ranks
        self.threshold_s, self.end_hung = threshold_s, end_hung
        self.paths = {r: beacon_path(run_dir, replica, r, incarnation) for r in range(ranks)}
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), f"observer/{replica}", replica=replica)
        self._stop = False
        self.started = time.time()
        """Beacons written before this (by a job that ran earlier in the same run folder, whose ranks' PIDs are
        gone or, worse, reused) are not this start's: read as not written yet."""

    def request_stop(self, *_args) -> None:
        self._stop = True

    def run(self) -> int:
        tick = min(0.25, self.threshold_s / 10)
        while not self._stop:
            beacons = {r: read_beacon(p) for r, p in self.paths.items()}
            beacons = {r: b if b is not None and b.time >= self.started else None for r, b in beacons.items()}
            # a rank that exited is the fault-tolerant group's business, not a hang: no longer judged
            beacons = {r: b for r, b in beacons.items() if b is None or b.phase == "done" or pid_alive(b.pid)}
            if not beacons or all(b is not None and b.phase == "done" for b in beacons.values()):
                return 0
            diagnosis = diagnose(beacons, time.time(), self.threshold_s)
            if diagnosis is not None:
                self.report(diagnosis, beacons)
                return 0
            time.sleep(tick)
        return 0

    def report(self, diagnosis: Diagnosis, beacons: dict[int, BeaconRecord | None]) -> None:
        path = os.path.join(self.run_dir, f"hang_report_replica{self.replica}_start{self.incarnation}.json")
        body = {
            "replica": self.replica, "incarnation": self.incarnation, "detected_at": time.time(),
            "threshold_s": self.threshold_s, **asdict(diagnosis),
            "beacons": {str(r): (asdict(b) if b is not None else None) for r, b in beacons.items()},
            "action": "ended the replica" if self.end_hung else "reported only",
        }
        with open(path + ".tmp", "w") as fh:
            json.dump(body, fh, indent=2)
        os.replace(path + ".tmp", path)
        self.events.emit("hang_detected", incarnation=self.incarnation, kind=diagnosis.kind,
                         ranks=list(diagnosis.ranks), reason=diagnosis.reason, stalled_s=diagnosis.stalled_s,
                         report=path, ended=self.end_hung)
        logger.error("replica %d: %s (%s)", self.replica, diagnosis.reason, path)
        if self.end_hung:
            pids = {b.pid for b in beacons.values() if b is not None}
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--threshold-s", type=float, required=True)
    parser.add_argument("--end-hung", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[observer {args.replica}] %(asctime)s %(message)s")
    observer = Observer(args.run_dir, args.replica, args.incarnation, args.ranks, args.threshold_s, args.end_hung)
    notice = NoticeFile.inherited()  # a preemption grace: the node's notice reaches every process (SLURM)
    signal.signal(signal.SIGTERM, observer.request_stop if notice is None else
                  SigtermTriage(notice, observer.request_stop, "titan_recover observer"))
    signal.signal(signal.SIGINT, observer.request_stop)
    return observer.run()


if __name__ == "__main__":
    sys.exit(main())
