"""The ``[chaos]`` section: the faults to inject, at an exact (replica, rank, step, phase) or a wall-clock offset.

A fault's ``kind`` names a registered fault (:mod:`~titan_recover.recover.chaos.kinds`). A seeded random schedule
(``random_faults``) expands to the same list of faults on every rank.

    [[chaos.faults]]
    kind = "kill"          # kill | hang | stall | raise | slow | bitflip | desync
    replica = 1
    rank = 0
    step = 3
    phase = "reduction"    # forward | backward | reduction | commit | rebuild | optimizer | transfer | collective
                           # | block_end | stop_save (sync mode: right before this replica writes a stop's checkpoint)

    [[chaos.faults]]       # at a wall-clock offset: 40 s after the job started, at the next forward of replica 2,
    kind = "kill"          # whichever start of it is running then; once per job (benchmarks' failure schedules)
    replica = 2
    at_s = 40.0

    [[chaos.faults]]       # silent data corruption: one bit of one element, at the phase or right after it
    kind = "bitflip"
    target = "gradient"    # parameter (at the phase) | gradient (after that microbatch's backward) | activation
    bit = 22               # (the next forward's first layer output)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from titan_recover.recover.chaos.kinds import fault_kinds, FAULTS

JOB_START_ENV = "TITAN_RECOVER_JOB_START"
"""Wall-clock time (``time.time()``) the job was launched: set by the launcher for every process it starts
(torchrun's restarts inherit it), the origin of time-triggered faults."""

STEP_PHASES = ("forward", "backward", "reduction", "commit", "rebuild", "optimizer")
"""Phases every step passes (a seeded random schedule draws from these)."""
FLIP_TARGETS = ("parameter", "gradient", "activation")
TRAINER_PHASES = (*STEP_PHASES, "transfer", "collective", "block_end", "stop_save")
PROCESS_PHASES = {"trainer": TRAINER_PHASES, "syncer": ("merge",), "coordinator": ("step", "epoch", "publish")}
"""The phases at which each process can be hit."""
PHASES = tuple(phase for phases in PROCESS_PHASES.values() for phase in phases)
PROCESSES = tuple(PROCESS_PHASES)
PROCESS_KINDS = ("kill", "hang", "stall", "raise")
"""Fault kinds that act on a process, not on training state: the ones the diloco syncer and the coordinator can
be given."""

@dataclass(kw_only=True, slots=True)
class FaultSpec:
    """One scheduled fault."""

    kind: str
    """Registered fault kind: kill, hang (SIGSTOP), stall (stuck main thread), raise, slow (straggler), bitflip
    (one bit of a parameter, gradient or activation), desync (another collective than the peers', at phase
    ``collective``)."""
    replica: int = 0
    """Replica group to hit."""
    rank: int = 0
    """Rank inside the replica."""
    step: int = 1
    """Training step (1-based)."""
    phase: str = "forward"
    """forward | backward | reduction | commit | optimizer, rebuild: right after entering a new epoch (a failure
    during recovery), transfer: in the middle of a state transfer to a joining replica (the step is the one
    the joiner enters), or collective: just before the rank issues its replica's own collective of the step (the
    speed agreement of the ``throughput`` policy; ``stall`` there hangs in it, ``desync`` issues another one), or
    block_end (diloco mode only): after a learner counted the step's block and sent what was due, before it claims
    the next, so that it holds no block, or stop_save (sync mode with replica groups): after a stop, right before
    this replica writes the stop's checkpoint (its turn, docs/replica_groups.md "Checkpoints"); ``step`` is the
    stop's, the last committed one."""
    factor: float = 2.0
    """``slow``: compute-time multiplier from ``step`` on (apply it to every rank of the replica)."""
    incarnation: int = 0
    """Which start of the replica group it hits (0: the first; a restarted replica is a later incarnation)."""
    target: str = "parameter"
    """``bitflip``: parameter | gradient | activation."""
    bit: int = 22
    """``bitflip``: which bit of the element (float32: 0-22 mantissa, 23-30 exponent, 31 sign)."""
    element: int = 0
    """``bitflip``: which element of the tensor (modulo its size)."""
    at_s: float | None = None
    """Fire at a wall-clock offset instead of a step: at the first ``phase`` reached ``at_s`` seconds or more after
    the job was launched (``TITAN_RECOVER_JOB_START``), by whichever start of the replica group runs then (``step``
    and ``incarnation`` are ignored), once per job (a marker file in the run folder: a restarted job does not fire
    it again). Failure schedules of benchmarks that compare jobs over wall time."""
    process: str = "trainer"
    """``trainer``: a rank of a replica group (or learner). ``syncer``: the diloco syncer (``replica`` and
    ``rank`` ignored, ``incarnation``: which syncer of the job, its generation - 1, on whichever node it runs);
    ``step`` counts its merges and ``phase`` is ``merge``: the fault fires right after that merge was published.
    ``coordinator`` (``replica`` and ``rank`` ignored, ``incarnation``: which start of the coordinator): phase
    ``step`` fires once every member it watches is at ``step`` or later (mid-step), ``epoch`` once it noticed a
    fault and is about to form epoch ``step``, ``publish`` after it wrote epoch ``step``'s state ahead and before
    members can read the epoch."""

    def __post_init__(self) -> None:
        FAULTS.get(self.kind)  # raises, naming the registered kinds
        if self.target not in FLIP_TARGETS:
            raise ValueError(f"chaos fault target {self.target!r} must be one of {', '.join(FLIP_TARGETS)}")
        if not 0 <= self.bit < 64 or self.element < 0:
            raise ValueError(f"chaos fault bit must be in [0, 64) and element >= 0, got {self.bit} and {self.element}")
        if self.process not in PROCESSES:
            raise ValueError(f"chaos fault process {self.process!r} must be one of {', '.join(PROCESSES)}")
        if self.phase not in PROCESS_PHASES[self.process]:
            raise ValueError(f"chaos fault phase {self.phase!r} must be one of "
                             f"{', '.join(PROCESS_PHASES[self.process])} (the phases of process = {self.process!r})")
        if self.process != "trainer" and self.kind not in PROCESS_KINDS:
            raise ValueError(f"chaos fault kind {self.kind!r} cannot hit the {self.process} (no training there): use "
                             f"one of {', '.join(PROCESS_KINDS)}")
        if self.factor < 1:
            raise ValueError(f"chaos fault factor must be >= 1, got {self.factor}")
        if self.at_s is not None and (self.at_s < 0 or self.process != "trainer"):
            raise ValueError(f"chaos fault at_s must be >= 0 and hit a trainer (process = \"trainer\"), got "
                             f"at_s = {self.at_s}, process = {self.process!r}")
        if self.step < 1 or self.replica < 0 or self.rank < 0:
            raise ValueError(f"chaos fault needs step >= 1, replica >= 0, rank >= 0: {self}")


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    """``[chaos]``: faults to inject (for tests and benchmarks)."""

    faults: list[FaultSpec] = field(default_factory=list)
    """Explicit schedule (``[[chaos.faults]]`` tables)."""

    random_faults: int = 0
    """Additional faults drawn from ``seed``: kind from ``random_kinds``, uniform replica / rank / step / phase."""

    seed: int = 0
    """Seed of the random schedule."""

    random_kinds: list[str] = field(default_factory=lambda: ["kill"])
    """Fault kinds the random schedule draws from."""

    random_steps: list[int] = field(default_factory=lambda: [1, 10])
    """Inclusive step range the random schedule draws from."""

    def __post_init__(self) -> None:
        for spec in self.faults:
            spec.__post_init__()
        if self.random_faults < 0:
            raise ValueError("chaos.random_faults must be >= 0")
        unknown = [k for k in self.random_kinds if k not in FAULTS]
        if unknown:
            raise ValueError(f"chaos.random_kinds {unknown} not registered; registered: {', '.join(fault_kinds())}")
        if len(self.random_steps) != 2 or not 1 <= self.random_steps[0] <= self.random_steps[1]:
            raise ValueError(f"chaos.random_steps must be [first, last] with 1 <= first <= last, got {self.random_steps}")

    def schedule(self, replicas: int, ranks_per_replica: int) -> list[FaultSpec]:
        """The full schedule: explicit faults, then the seeded random ones (identical on every rank)."""
        rng = random.Random(self.seed)
        drawn = [
            FaultSpec(
                kind=rng.choice(self.random_kinds),
                replica=rng.randrange(replicas),
                rank=rng.randrange(ranks_per_replica),
                step=rng.randint(*self.random_steps),
                phase=rng.choice(STEP_PHASES),
            )
            for _ in range(self.random_faults)
        ]
        return [*self.faults, *drawn]
