"""Deterministic fault injection (``[chaos]``): kill, hang or raise at an exact (replica, rank, step, phase).

Faults are components registered by name (:func:`register_fault`); a TOML value picks one and a new kind of fault
is a new function, not an edit here. Every injection is logged as a ``fault_injected`` event *before* it acts,
so a test can assert that it fired. A seeded random schedule (``random_faults``) expands to the same list of
faults on every rank.

    [[chaos.faults]]
    kind = "kill"          # kill | hang | stall | raise | slow | bitflip
    replica = 1
    rank = 0
    step = 3
    phase = "reduction"    # forward | backward | reduction | commit | rebuild | optimizer | transfer

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

import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from titan_recover.registry import Registry

JOB_START_ENV = "TITAN_RECOVER_JOB_START"
"""Wall-clock time (``time.time()``) the job was launched: set by the launcher for every process it starts
(torchrun's restarts inherit it), the origin of time-triggered faults."""

STEP_PHASES = ("forward", "backward", "reduction", "commit", "rebuild", "optimizer")
FLIP_TARGETS = ("parameter", "gradient", "activation")
"""Phases every step passes (a seeded random schedule draws from these)."""
PHASES = (*STEP_PHASES, "transfer", "collective", "merge")
PROCESSES = ("trainer", "syncer")
SYNCER_KINDS = ("kill", "hang", "stall", "raise")
"""Fault kinds that act on a process, not on training state: the ones the diloco syncer can be given."""

FAULTS: Registry[Callable[["ChaosMonkey", "FaultSpec"], None]] = Registry("chaos fault kind")
register_fault = FAULTS.register


def fault_kinds() -> list[str]:
    return FAULTS.names()


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` fault: an ordinary crash of the training code."""


@register_fault("kill")
def _kill(_monkey, _spec) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@register_fault("hang")
def _hang(_monkey, _spec) -> None:
    """The whole process stops (SIGSTOP): no heartbeat, sockets stay open."""
    os.kill(os.getpid(), signal.SIGSTOP)


@register_fault("stall")
def _stall(_monkey, _spec) -> None:
    """The main thread is stuck forever while the process (and its heartbeat thread) lives on."""
    while True:
        time.sleep(1.0)


@register_fault("desync")
def _desync(monkey, _spec) -> None:
    """At phase ``collective``: this rank issues a different collective than its peers (another shape)."""
    monkey.desync_due = True


@register_fault("raise")
def _raise(_monkey, _spec) -> None:
    raise InjectedFault("injected exception")


@register_fault("slow")
def _slow(monkey, spec) -> None:
    """From this step on, every microbatch of this rank takes ``factor`` times as long (a straggler)."""
    monkey.slowdown = spec.factor


@register_fault("bitflip")
def _bitflip(monkey, spec) -> None:
    """Flip bit ``bit`` of element ``element`` of this rank's first local parameter (now), of its gradient (after
    the current microbatch's backward) or of the next forward's first activation: silent data corruption."""
    if spec.target == "parameter":
        flip_bit(monkey.tensors["parameter"]()[0], spec.element, spec.bit)
    else:
        monkey.pending[spec.target] = spec


def flip_bit(tensor: torch.Tensor, element: int, bit: int) -> None:
    """Flip one bit of one element in place (the tensor's own storage)."""
    width = 8 * tensor.element_size()
    words = tensor.detach().view({16: torch.int16, 32: torch.int32, 64: torch.int64}[width]).reshape(-1)
    if words.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise ValueError("bit flips need a contiguous tensor")
    mask = -(1 << bit) if bit == width - 1 else 1 << bit  # the sign bit as a signed word
    words[element % words.numel()] ^= mask


@dataclass(kw_only=True, slots=True)
class FaultSpec:
    """One scheduled fault."""

    kind: str
    """Registered fault kind: kill, hang (SIGSTOP), stall (stuck main thread), raise, slow (straggler)."""
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
    speed agreement of the ``throughput`` policy; ``stall`` there hangs in it, ``desync`` issues another one)."""
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
    ``rank`` ignored); ``step`` counts its merges and ``phase`` is ``merge``: the fault fires right after that
    merge was published."""

    def __post_init__(self) -> None:
        FAULTS.get(self.kind)  # raises, naming the registered kinds
        if self.target not in FLIP_TARGETS:
            raise ValueError(f"chaos fault target {self.target!r} must be one of {', '.join(FLIP_TARGETS)}")
        if not 0 <= self.bit < 64 or self.element < 0:
            raise ValueError(f"chaos fault bit must be in [0, 64) and element >= 0, got {self.bit} and {self.element}")
        if self.process not in PROCESSES:
            raise ValueError(f"chaos fault process {self.process!r} must be one of {', '.join(PROCESSES)}")
        if (self.process == "syncer") != (self.phase == "merge"):
            raise ValueError("chaos fault phase \"merge\" goes with process = \"syncer\" and only with it")
        if self.process == "syncer" and self.kind not in SYNCER_KINDS:
            raise ValueError(f"chaos fault kind {self.kind!r} cannot hit the syncer (no training there): use one of "
                             f"{', '.join(SYNCER_KINDS)}")
        if self.phase not in PHASES:
            raise ValueError(f"chaos fault phase {self.phase!r} must be one of {', '.join(PHASES)}")
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


class ChaosMonkey:
    """The faults of one rank; :meth:`maybe_inject` is called at every phase of every step.

    ``run_dir`` and ``job_start`` (default: ``TITAN_RECOVER_JOB_START``) are needed only by time-triggered faults
    (``at_s``): the run folder holds their once-per-job markers."""

    def __init__(self, schedule: list[FaultSpec], replica: int, rank: int, events, incarnation: int = 0,
                 run_dir: str | None = None, job_start: float | None = None):
        self.mine = [f for f in schedule if f.process == "trainer" and f.replica == replica and f.rank == rank
                     and (f.at_s is not None or f.incarnation == incarnation)]
        self._index = {id(f): i for i, f in enumerate(schedule)}  # a fault's place in the job's schedule
        self.events = events
        self.slowdown = 1.0
        self.desync_due = False
        """A ``desync`` fired: the next collective issued through :meth:`collective` diverges."""
        self._fired: set[int] = set()
        self.tensors: dict[str, Callable[[], list[torch.Tensor]]] = {}
        """Where bit flips land: ``parameter`` / ``gradient`` -> this rank's local tensors (set by the trainer)."""
        self.pending: dict[str, FaultSpec] = {}
        """Bit flips waiting for their moment (a gradient after a backward, an activation in a forward)."""
        self.run_dir, self.job_start = run_dir, job_start
        if any(f.at_s is not None for f in self.mine):
            if self.job_start is None:
                if JOB_START_ENV not in os.environ:
                    raise ValueError(f"chaos faults with at_s need the job's start time in {JOB_START_ENV} "
                                     "(./run_train.sh and python -m titan_recover.launch set it)")
                self.job_start = float(os.environ[JOB_START_ENV])
            if run_dir is None:
                raise ValueError("chaos faults with at_s need the run folder (their once-per-job markers)")

    def maybe_inject(self, step: int, phase: str) -> None:
        """Fire the faults scheduled for (step, phase), each once (a phase recurs within a step: every
        microbatch has a forward, a retried reduction is a reduction again), and the time-triggered ones due at
        this phase, each once per job."""
        for fault in self.mine:
            if fault.phase != phase or id(fault) in self._fired:
                continue
            if fault.at_s is None:
                if fault.step != step:
                    continue
                elapsed = None
            else:
                elapsed = time.time() - self.job_start
                if elapsed < fault.at_s:
                    continue
                self._fired.add(id(fault))
                if not self._claim(fault):
                    continue  # an earlier start of this job fired it
            self._fired.add(id(fault))
            timing = {} if elapsed is None else {"at_s": fault.at_s, "elapsed_s": round(elapsed, 3)}
            self.events.emit("fault_injected", kind=fault.kind, step=step, phase=phase, pid=os.getpid(), **timing)
            FAULTS.get(fault.kind)(self, fault)

    def _claim(self, fault: FaultSpec) -> bool:
        """Create the fault's marker in the run folder; False if it exists (the fault fired in this job)."""
        folder = os.path.join(self.run_dir, "chaos")
        os.makedirs(folder, exist_ok=True)
        try:
            os.close(os.open(os.path.join(folder, f"fault-{self._index[id(fault)]}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def collective(self, issue: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        """``issue`` (a collective on one tensor) as a faulty rank calls it: once a ``desync`` fired, the next call
        issues another collective than its peers (a tensor of another shape), as torchft injects faults through a
        process-group wrapper."""
        def issue_or_diverge(tensor: torch.Tensor) -> None:
            if self.desync_due:
                self.desync_due = False
                tensor = torch.zeros(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
            issue(tensor)

        return issue_or_diverge

    def after_compute(self, elapsed_s: float) -> None:
        """Called after every microbatch: a ``slow`` rank sleeps so the microbatch took ``factor`` times as long."""
        if self.slowdown > 1:
            time.sleep(elapsed_s * (self.slowdown - 1))

    def after_backward(self) -> None:
        """Called after every microbatch's backward: a pending gradient flip lands now."""
        spec = self.pending.pop("gradient", None)
        if spec is not None:
            flip_bit(next(g for g in self.tensors["gradient"]() if g is not None), spec.element, spec.bit)

    def on_activation(self, output: torch.Tensor) -> None:
        """Called with the first layer's output in every forward: a pending activation flip lands in it."""
        spec = self.pending.pop("activation", None)
        if spec is not None:
            with torch.no_grad():
                flip_bit(output, spec.element, spec.bit)
