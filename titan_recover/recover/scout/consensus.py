"""Localisation by consensus among replicas (SCOUT, docs/scout.md): the pure parts.

Replicas that should hold identical state are witnesses of each other. This module decides from what they report;
it sends nothing and holds no process state, so every decision here is unit-tested without processes:

* :func:`fingerprint`: a 32-bit signature of a rank's tensors (an integer sum of their bit patterns: any single
  flipped bit changes it), computed where the tensors live, one scalar read back;
* :func:`vote`: strict-majority decision over the witnesses' signatures, with the evidence and the reason;
* :func:`replay_plan`: which microbatch a step replays and on which replicas;
* :func:`robust_z` and :class:`StragglerDetector`: stragglers from per-replica compute time per microbatch
  (median / MAD over replicas), confirmed over several steps and cleared when they recover.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping, Sequence

import torch

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PRIME = 2**32 - 5
"""Signatures are residues modulo this prime: a flipped bit changes a word sum by +-2**k (modulo 2**64), never a
multiple of it."""
_EVEN_WEIGHT = 2**16 + 1
_COLUMNS = 16
"""Words per row of the column sums: even, so that each column holds only even- or only odd-indexed words."""


def _add_word_columns(acc: torch.Tensor, t: torch.Tensor) -> None:
    """Add ``t``'s bytes, read as int64 words in rows of ``_COLUMNS``, to ``acc`` column by column (int64 on its
    device, wrapping): an even column holds only even-indexed words. The last words that fill no row go into the
    first columns (they start at an even index); the few trailing elements that fill no word, as words of their
    own size, into column 0. One reduction and one addition for most tensors: cheap for many small tensors too."""
    flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1)
    per = 8 // t.element_size()
    bulk = flat.numel() // per * per
    body = flat[:bulk]
    if body.storage_offset() % per:
        body = body.clone()  # int64 words start at element 0, wherever the tensor lies in its storage
    words = body.view(torch.int64)
    rows = words.numel() // _COLUMNS * _COLUMNS
    if rows:
        acc += words[:rows].view(-1, _COLUMNS).sum(0)
    if rows < words.numel():
        acc[: words.numel() - rows] += words[rows:]
    if bulk < flat.numel():
        acc[0] += flat[bulk:].view(_WORDS[t.element_size()]).to(torch.int64).sum()


def _wrap(value: int) -> int:
    """``value`` wrapped to int64 (two's complement), as the device's int64 sums wrap."""
    return (value + 2**63) % 2**64 - 2**63


def fingerprint(tensors: Iterable[torch.Tensor], extra: Iterable[float] = ()) -> int:
    """A 32-bit signature of ``tensors`` (and of the float64 bit patterns of ``extra``, e.g. a loss).

    Each tensor's bytes are read as int64 words and summed (all of them, and the even-indexed ones) in int64 on
    the tensor's device, wrapping modulo ``2**64``: a flipped bit ``k`` changes a sum by ``+-2**k`` modulo
    ``2**64``, and no such change of the two sums is a multiple of the prime near ``2**32`` the signature is a
    residue of (``tests/test_consensus.py`` checks every bit and wrap). Copies nothing but ``_COLUMNS`` integers
    per device."""
    columns: dict[torch.device, torch.Tensor] = {}
    for t in tensors:
        t = t.detach()
        if t.numel() == 0:
            continue
        acc = columns.get(t.device)
        if acc is None:
            acc = columns[t.device] = torch.zeros(_COLUMNS, dtype=torch.int64, device=t.device)
        _add_word_columns(acc, t)
    total_all, total_even = 0, 0
    for acc in columns.values():
        values = acc.tolist()
        total_all, total_even = total_all + _wrap(sum(values)), total_even + _wrap(sum(values[::2]))
    for value in extra:
        word = torch.tensor([float(value)], dtype=torch.float64).view(torch.int64).item()
        total_all, total_even = total_all + word, total_even + word
    return (total_all + _EVEN_WEIGHT * total_even) % _PRIME


def split_signature(value: int) -> tuple[float, float]:
    """A signature as two 16-bit halves: integers every float dtype of a reduction buffer holds exactly."""
    return float(value & 0xFFFF), float(value >> 16)


def join_signature(low: float, high: float) -> int:
    return int(round(low)) | (int(round(high)) << 16)


@dataclass(frozen=True)
class Verdict:
    """A vote's outcome. ``decision``: ``agree`` (every witness the same), ``attributed`` (a strict majority and
    outliers), ``inconclusive`` (disagreement without a strict majority: nobody is blamed)."""

    decision: str
    outliers: tuple[Hashable, ...]
    majority: int | None
    evidence: dict[Hashable, int]
    reason: str

    @property
    def clean(self) -> bool:
        return self.decision == "agree"


def vote(signatures: Mapping[Hashable, int], what: str = "signatures") -> Verdict:
    """Strict-majority vote: the value held by more than half of the witnesses (``count > N // 2``) is the truth,
    every witness with another value is an outlier. No such value: inconclusive."""
    evidence = dict(signatures)
    n = len(evidence)
    if n == 0:
        return Verdict("inconclusive", (), None, evidence, f"{what}: no witnesses")
    counts: dict[int, list[Hashable]] = {}
    for witness, value in evidence.items():
        counts.setdefault(value, []).append(witness)
    value, holders = max(counts.items(), key=lambda item: len(item[1]))
    if len(counts) == 1:
        return Verdict("agree", (), value, evidence, f"{what}: all {n} witnesses agree")
    if len(holders) > n // 2:
        outliers = tuple(sorted((w for w in evidence if evidence[w] != value), key=str))
        return Verdict("attributed", outliers, value, evidence,
                       f"{what}: {len(holders)} of {n} witnesses agree, {list(outliers)} differ")
    groups = sorted((sorted(ws, key=str) for ws in counts.values()), key=str)
    return Verdict("inconclusive", (), None, evidence,
                   f"{what}: no strict majority among {n} witnesses (groups {groups}); nobody is attributed")


@dataclass(frozen=True)
class ReplayPlan:
    step: int
    microbatch: int
    holder: int
    replayers: tuple[int, ...]

    @property
    def witnesses(self) -> tuple[int, ...]:
        return (self.holder, *self.replayers)


def replay_plan(step: int, seed: int, step_ids: Sequence[int], holder_of: Mapping[int, int],
                members: Sequence[int], replayers: int = 2) -> ReplayPlan | None:
    """The step's sampled microbatch (a function of seed and step, identical on every rank), its holder in the
    step's plan, and the next ``replayers`` members after the holder in ring order. None if nobody else is there."""
    if not step_ids:
        return None
    draw = int.from_bytes(hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest(), "little")
    microbatch = step_ids[draw % len(step_ids)]
    holder = holder_of[microbatch]
    ring = sorted(members)
    others = [ring[(ring.index(holder) + k) % len(ring)] for k in range(1, len(ring))]
    chosen = tuple(others[:replayers])
    if not chosen:
        return None
    return ReplayPlan(step, microbatch, holder, chosen)


def robust_z(values: Mapping[Hashable, float], min_spread: float = 0.05) -> dict[Hashable, float]:
    """Robust z-score of every value: ``(x - median) / (1.4826 * MAD)``. The MAD is floored at ``min_spread``
    times the median, so replicas within a few percent of each other never look like outliers."""
    if not values:
        return {}
    median = statistics.median(values.values())
    mad = statistics.median(abs(v - median) for v in values.values())
    scale = 1.4826 * max(mad, min_spread * abs(median), 1e-12)
    return {k: (v - median) / scale for k, v in values.items()}


@dataclass(frozen=True)
class StragglerChange:
    replica: int
    state: str
    """``confirmed`` or ``recovered``."""
    step: int
    z: float
    seconds_per_microbatch: float
    median: float


@dataclass
class StragglerDetector:
    """Per-replica time per microbatch, judged every step; a replica is confirmed a straggler after
    ``confirm_steps`` consecutive steps with robust z above ``threshold``, and recovered after as many below. A step
    that cannot judge (fewer than 3 replicas report) breaks every run of steps; a replica that reports nothing in a
    step (it left, or computed nothing) loses its run, and its straggler mark."""

    threshold: float = 3.5
    confirm_steps: int = 3
    min_spread: float = 0.05
    stragglers: set[int] = field(default_factory=set)
    _above: dict[int, int] = field(default_factory=dict)
    _below: dict[int, int] = field(default_factory=dict)

    def observe(self, step: int, seconds_per_microbatch: Mapping[int, float]) -> list[StragglerChange]:
        times = {r: t for r, t in seconds_per_microbatch.items() if t > 0}
        if len(times) < 3:  # two replicas cannot tell which one is slow
            self._above.clear()
            self._below.clear()
            return []
        for replica in (set(self._above) | set(self._below) | self.stragglers) - set(times):
            self._above.pop(replica, None)
            self._below.pop(replica, None)
            self.stragglers.discard(replica)
        z = robust_z(times, self.min_spread)
        median = statistics.median(times.values())
        changes = []
        for replica, score in sorted(z.items()):
            if score > self.threshold:
                self._above[replica] = self._above.get(replica, 0) + 1
                self._below[replica] = 0
                if replica not in self.stragglers and self._above[replica] >= self.confirm_steps:
                    self.stragglers.add(replica)
                    changes.append(StragglerChange(replica, "confirmed", step, score, times[replica], median))
            else:
                self._below[replica] = self._below.get(replica, 0) + 1
                self._above[replica] = 0
                if replica in self.stragglers and self._below[replica] >= self.confirm_steps:
                    self.stragglers.discard(replica)
                    changes.append(StragglerChange(replica, "recovered", step, score, times[replica], median))
        return changes
