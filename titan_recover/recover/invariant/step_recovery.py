"""The step recovery manager: one replica's part of a step, from its quota to the commit (docs/invariant.md).

:meth:`StepRecovery.run` computes this replica's quota of the step's microbatch ids, then loops: catch up with the
epochs the coordinator has published (each applied to the :class:`~titan_recover.recover.invariant.ledger.StepLedger`
in order, computing any ids taken over from lost replicas on top of the preserved local accumulation), reduce the
accumulation together with the ledger over the fault-tolerant group, and commit, or, on abort, go round again in
the new epoch. ``[recover.step] max_epochs_per_step`` bounds the loop. Whatever phase a failure hits, the step
commits with every id accumulated exactly once, which :meth:`StepLedger.check` verifies on the reduced ledger
before the gradient is used.

The manager does not know about models: it is given a *worker* (:class:`MicrobatchWorker`: forward and backward of
microbatch ``g``, accumulating locally, and this rank's contribution to the reduction) and a *sync* (``catch_up``,
``epoch``, ``members``, ``members_of``, ``reduce_once``, ``committed_epoch``, ``committed_members``,
``recoveries``, ``events``: a :class:`~titan_recover.recover.groups.replica_sync.ReplicaSync`), which tests replace
with fakes. It reduces the local accumulation in place, with a tail of small sections laid out by
:class:`~titan_recover.recover.invariant.reduction.ReductionLayout`, behind a
:class:`~titan_recover.recover.invariant.reduction.Backup` that an aborted reduction restores from, or, with
``[recover.step] abort_recovery = "recompute"``, computing its microbatches again after an abort.
With a :class:`~titan_recover.recover.scout.localize.Localizer` the tail carries the witnesses' signatures too and
the sync judges them before the commit (docs/scout.md).

Managers are registered by name (``[recover.step] manager``); ``recompute`` is the one described here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from titan_recover.recover.groups.protocol import active_replicas
from titan_recover.recover.invariant.ledger import StepLedger
from titan_recover.recover.invariant.overlap import OverlappedReduction
from titan_recover.recover.invariant.quota import get_policy, QuotaConfig
from titan_recover.recover.invariant.reduction import Backup, issue_order, Reduced, ReductionLayout
from titan_recover.registry import Registry

logger = logging.getLogger(__name__)

STEP_MANAGERS: Registry[type] = Registry("step recovery manager")
"""``[recover.step] manager`` name -> manager class."""

ABORT_RECOVERIES = ("backup", "recompute")
"""``[recover.step] abort_recovery`` values."""


@dataclass(kw_only=True, slots=True)
class StepConfig:
    """``[recover.step]``: the step recovery manager (docs/invariant.md)."""

    manager: str = "recompute"
    """Registered step recovery manager. ``recompute``: survivors compute a lost replica's microbatch ids in the
    same step, on top of what they accumulated, and the step commits the failure-free global batch."""

    max_epochs_per_step: int = 8
    """Bound on membership changes within one step (and one admission), so an endless failure loop becomes a clear
    error."""

    abort_recovery: str = "backup"
    """How a replica gets its own accumulation back after an aborted reduction (docs/invariant.md, "After an
    aborted reduction"). ``backup``: each piece of the local gradient is copied just before the collective first
    writes it and restored from the copy (a gradient-sized buffer per rank and a copy per step; the fastest
    recovery). ``recompute``: no copy; the replica computes its step's microbatches again (no extra memory and no
    copy on a failure-free step; an aborted reduction costs this replica's quota of compute once more). On CPU the
    platform default is ``recompute`` (docs/platform.md: the copy is a third of the reduction's time there)."""

    overlap_reduction: bool = True
    """Start the step's reduction during the backward of the replica's last planned microbatch, each gradient part
    as soon as it is final (docs/invariant.md, "Overlapping the reduction with the last backward"). Where the
    worker cannot say when a part is final (``[recover.quota] exact``, pipeline parallelism) the reduction starts
    after the last microbatch, as with ``false``. On CPU the platform default is ``false`` (docs/platform.md: the
    collective and the backward share the cores there)."""

    def __post_init__(self) -> None:
        STEP_MANAGERS.get(self.manager)  # raises, naming the registered managers
        if self.abort_recovery not in ABORT_RECOVERIES:
            raise ValueError(f"recover.step.abort_recovery must be one of {', '.join(map(repr, ABORT_RECOVERIES))}, "
                             f"got {self.abort_recovery!r}")
        if self.max_epochs_per_step < 1:
            raise ValueError(f"recover.step.max_epochs_per_step must be >= 1, got {self.max_epochs_per_step}")


class MicrobatchWorker(Protocol):
    """What the manager computes with (one replica group's rank; tests use a fake)."""

    numel: int
    """Elements of this rank's local gradient accumulation."""

    def compute(self, g: int, witness: str | None = None, on_final: Callable[[int], None] | None = None) -> int | None:
        """Forward and backward of microbatch ``g``, accumulated locally. ``witness``: also return the signature of
        ``g``'s gradient and loss; ``"replay"`` leaves nothing accumulated (docs/scout.md). ``on_final(i)``: called
        during the backward as soon as part ``i`` of :meth:`gradient_parts` holds its final value."""

    def needs_backward(self) -> bool:
        """Whether this worker must see one backward before it can build gradients of its own (a tensor-parallel
        gradient may be placed otherwise than its parameter, and only a backward shows how): the manager then
        computes a microbatch for it and drops it, in a step where it has none of its own (a spare's)."""

    def gradient_parts(self) -> list[torch.Tensor] | None:
        """The local accumulation's parts, in the order :meth:`contribution` gives them, made to exist before the
        step's last microbatch (its backward accumulates into them in place and reports each one to ``on_final``);
        None where this worker cannot report them (the reduction then starts after the last microbatch)."""

    def synchronize(self) -> None:
        """Wait until the device has finished the work issued so far (a GPU runs kernels after their launch): the
        manager's timings read the clock after it."""

    def contribution(self) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor, float]:
        """``(gradient, loss, mean_loss)``: the local accumulation (flat, or its parts in order: the manager
        reduces them in place), its summed loss share and the mean token loss of what this rank computed in the
        step (0: nothing)."""

    def replace_gradient(self, parts: list[torch.Tensor]) -> None:
        """After an aborted reduction: make ``parts`` (fresh tensors holding the values before it) the local
        accumulation, in place of the tensors the abandoned collective may still write into."""

    def discard(self) -> None:
        """After an aborted reduction without a backup: forget the step's accumulation (gradient and loss), leaving
        its storage to the abandoned collective, so that the microbatches can be computed again from nothing."""


@dataclass
class StepOutcome:
    """What one committed step did (the same on every rank of every member, except the timings)."""

    step: int
    reduced: Reduced
    """The reduced step, by section."""
    committed: int
    """Microbatches committed (M, or fewer with ``drop``)."""
    participants: int
    quotas: dict[int, int]
    """Initial quota per replica (live replicas only)."""
    recomputed: int
    """Ids taken over from lost replicas in this step, all survivors together."""
    mine: int
    """Ids this replica computed (its quota and what it took over)."""
    attempts: int
    discarded: bool
    """``drop`` only: some member saw a failure in this step, which is discarded (the optimizer must not step)."""
    compute_s: float = 0.0
    wait_s: float = 0.0
    """Time in the committed reduction (all-reduce + commit barrier, waiting for the slowest member included)."""
    recovery_s: float = 0.0
    """Time in failed reductions, epoch changes and microbatches taken over."""
    overlapped: bool = False
    """The committed reduction was issued during the last microbatch's backward."""


@dataclass
class _Progress:
    """One step's running state in the manager."""

    ledger: StepLedger
    done: list[int]
    speeds: list[float]
    replay_signature: int | None = None
    failed: bool = False
    recovery_s: float = 0.0
    overlapped: OverlappedReduction | None = None
    """The reduction started during the last planned microbatch's backward (the first attempt's)."""


@STEP_MANAGERS.register("recompute")
class StepRecovery:
    def __init__(self, quota: QuotaConfig, *, replica: int, groups: int, per_step: int, sync, worker: MicrobatchWorker,
                 config: StepConfig | None = None, active: int = 0,
                 agree_speed: Callable[[float], float] | None = None, localizer=None,
                 signature: Callable[[], int] | None = None, dtype: torch.dtype = torch.float32):
        """``groups``: replica groups of the job (active and spares); ``active``: those holding quota
        (``[recover] replicas``; 0: every member). ``agree_speed``: make this replica's ranks agree on its measured
        speed. ``localizer``: signatures, votes, replays and stragglers (docs/scout.md). ``signature``: this rank's
        state signature (parameters and optimizer state), read just before each reduction (the state the step's
        update applies to)."""
        self.quota, self.config = quota, config or StepConfig()
        self.replica, self.groups, self.per_step, self.active = replica, groups, per_step, active
        self.sync, self.worker = sync, worker
        self.agree_speed, self.localizer, self.signature = agree_speed, localizer, signature
        self.dtype = dtype
        self.policy = get_policy(quota.policy)
        self.layout = ReductionLayout(gradients=worker.numel, microbatches=per_step, groups=groups,
                                      evidence=localizer.size if localizer is not None else 0)
        self.speeds: dict[int, float] = {}
        """Smoothed microbatches per second per replica, updated from every commit (identical on every rank)."""
        self.degraded = False
        """Capacity was lost (a replica lost, or fewer than ``active`` replicas holding quota) and has not come
        back."""
        self._holding: tuple[int, ...] = ()
        self._backup = Backup() if self.config.abort_recovery == "backup" else None
        """The local accumulation as it was before the reduction being tried (docs/invariant.md)."""
        self._overlap_logged = False

    # the speed estimates travel with a replica's state (state transfer), as TorchTitan's Stateful components do
    def state_dict(self) -> dict:
        return {"speeds": {str(r): v for r, v in self.speeds.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.speeds = {int(r): v for r, v in state["speeds"].items()}

    def plan(self, step: int) -> StepLedger:
        sync = self.sync
        if not self.policy.redistributes:
            # no ids move between replicas: start from the newest membership, as torchft's per-step quorum does
            sync.catch_up(step)
            epoch, members = sync.epoch, sync.members
        else:
            # every survivor of the last commit agrees on its epoch; later epochs are applied in order below
            epoch, members = sync.committed_epoch, sync.committed_members
        return StepLedger(self.quota.policy, step, self.per_step, members, epoch, self.active or self.groups,
                          dict(self.speeds), active=self.active)

    def run(self, step: int) -> StepOutcome:
        self.sync.recoveries = []
        ledger = self.plan(step)
        quotas = {m: ledger.quota(m) for m in ledger.members}
        self._note_capacity(step, ledger)
        progress, compute_s = self._compute_quota(step, ledger)
        for attempt in range(1, self.config.max_epochs_per_step + 2):
            overlapped, progress.overlapped = progress.overlapped, None
            if overlapped is None:
                self._take_over(step, progress, attempt)
            # an overlapped reduction is already issued in the epoch the step was planned in: a failure since then
            # aborts it (the epoch's fault flag), and the next attempt takes over the lost replicas' ids
            parts, tail = self._pack(progress, overlapped)
            reducing = time.perf_counter()
            before_piece = self._backup.save_issued if self._backup is not None and overlapped is None else None
            if self.sync.reduce_once(step, issue_order(parts, tail), attempt, verify=self._verifier(step),
                                     before_piece=before_piece, pending=overlapped):
                return self._committed(step, progress, parts, tail, quotas, attempt, compute_s,
                                       wait_s=time.perf_counter() - reducing, overlapped=overlapped is not None)
            self._restore(step, progress, parts)
            progress.recovery_s += time.perf_counter() - reducing
        raise RuntimeError(
            f"step {step}: the reduction failed in {self.config.max_epochs_per_step + 1} consecutive epochs "
            f"(recover.step.max_epochs_per_step = {self.config.max_epochs_per_step}); giving up"
        )

    def _compute_quota(self, step: int, ledger: StepLedger) -> tuple[_Progress, float]:
        """This replica's own ids (a sampled replay first, while nothing is accumulated), and its measured speed."""
        progress = _Progress(ledger=ledger, done=[], speeds=[0.0] * self.groups)
        own = list(ledger.ids(self.replica))
        plan = None
        if self.localizer is not None:
            plan = self.localizer.replay_for(step, ledger.assignment.ids, ledger.members)
        if plan is not None and self.replica in plan.replayers:
            # the replayed gradient is signed and dropped
            progress.replay_signature = self.worker.compute(plan.microbatch, witness="replay")
        elif not own and self.worker.needs_backward():  # a spare's first step: one backward shows the placements
            self.worker.compute(min(g for ids in ledger.assignment.ids.values() for g in ids), witness="replay")
        # the clock measures the quota's device work: none queued before it, all of it done at the end (one wait
        # each, not one per microbatch, so the device keeps running ahead of the launches)
        self.worker.synchronize()
        start = time.perf_counter()
        if plan is not None and plan.microbatch in own:  # the holder computes it first too, and keeps it
            own.remove(plan.microbatch)
            progress.replay_signature = self.worker.compute(plan.microbatch, witness="holder")
            progress.done.append(plan.microbatch)
        for n, g in enumerate(own):
            if n == len(own) - 1:
                progress.overlapped = self._begin_overlap(progress)
            if progress.overlapped is None:
                self.worker.compute(g)
            else:
                try:
                    self.worker.compute(g, on_final=progress.overlapped.part_ready)
                    progress.overlapped.release()
                    progress.overlapped.check()
                except BaseException as error:
                    progress.overlapped.abandon(f"{type(error).__name__}: {error}")
                    raise
            progress.done.append(g)
        self.worker.synchronize()
        compute_s = time.perf_counter() - start
        speed = len(progress.done) / compute_s if progress.done and compute_s > 0 else 0.0
        if self.agree_speed is not None and self.policy.uses_speeds:
            speed = self.agree_speed(speed)
        progress.speeds[self.replica] = speed
        return progress, compute_s

    def _begin_overlap(self, progress: _Progress) -> OverlappedReduction | None:
        """The step's reduction, started before its last planned microbatch (None: it starts after it)."""
        parts = self.worker.gradient_parts() if self.config.overlap_reduction else None
        if not self._overlap_logged:
            self._overlap_logged = True
            logger.info("the cross-replica reduction %s", "overlaps the last microbatch's backward" if parts else
                        "starts after the last microbatch (recover.step.overlap_reduction is off, or the worker "
                        "cannot report final gradients: pipeline parallelism)")
        if not parts:
            return None
        epoch, collective = self.sync.collective()
        if epoch != progress.ledger.epoch:
            return None  # the step was planned in an older epoch: its reduction waits for the take-over
        self.layout.check(parts)
        tail = self.layout.empty_tail(self.dtype, parts[0].device)
        return OverlappedReduction(parts, tail, collective, epoch=epoch, backup=self._backup).start()

    def _take_over(self, step: int, progress: _Progress, attempt: int) -> None:
        """Move to the coordinator's newest epoch, computing the ids of replicas lost on the way."""
        sync, ledger = self.sync, progress.ledger
        recovering = time.perf_counter()
        sync.catch_up(step)
        changed = ledger.epoch < sync.epoch
        progress.failed = progress.failed or changed or attempt > 1
        while ledger.epoch < sync.epoch:
            transition = ledger.advance(ledger.epoch + 1, sync.members_of(ledger.epoch + 1))
            mine = transition.extra.get(self.replica, ())
            if transition.lost:
                sync.events.emit("microbatches_reassigned", step=step, epoch=transition.epoch,
                                 lost=list(transition.lost), taken=list(mine),
                                 extra={str(m): list(v) for m, v in transition.extra.items()},
                                 reason=transition.reason)
            for g in mine:
                self.worker.compute(g)
                progress.done.append(g)
        if changed or attempt > 1:
            self.worker.synchronize()  # the microbatches taken over are done
            progress.recovery_s += time.perf_counter() - recovering

    def _restore(self, step: int, progress: _Progress, parts: list[torch.Tensor]) -> None:
        """The local accumulation as it was before the aborted reduction, in storage no abandoned collective writes
        into: from the backup, or computed again in the order it was first computed (so the same bits)."""
        if self._backup is not None:
            self.worker.replace_gradient(self._backup.restored(parts))
            return
        self.worker.discard()
        self.sync.events.emit("accumulation_recomputed", step=step, epoch=self.sync.epoch,
                              microbatches=list(progress.done))
        for g in progress.done:
            self.worker.compute(g)
        self.worker.synchronize()

    def _pack(self, progress: _Progress, overlapped: OverlappedReduction | None = None
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The gradient parts (reduced where they lie) and the tail of small sections beside them; with an
        ``overlapped`` reduction, the tail is filled into the one it holds and released to it."""
        try:
            return self._pack_sections(progress, overlapped)
        except BaseException as error:
            if overlapped is not None:
                overlapped.abandon(f"{type(error).__name__}: {error}")
            raise

    def _pack_sections(self, progress: _Progress, overlapped: OverlappedReduction | None
                       ) -> tuple[list[torch.Tensor], torch.Tensor]:
        gradient, loss, mean_loss = self.worker.contribution()
        parts = [gradient] if isinstance(gradient, torch.Tensor) else list(gradient)
        self.layout.check(parts)
        if overlapped is not None:
            if [p.data_ptr() for p in parts] != [p.data_ptr() for p in overlapped.parts]:
                raise RuntimeError("the local accumulation moved during the overlapped reduction (a backward "
                                   "replaced a gradient instead of accumulating into it)")
            parts = overlapped.parts
        elif self._backup is not None:
            self._backup.begin(parts)
        losses = [0.0] * self.groups
        losses[self.replica] = mean_loss
        evidence = []
        if self.layout.evidence:
            evidence = self.localizer.evidence(self.signature() if self.signature else None,
                                               progress.replay_signature)
        tail = self.layout.tail(loss=loss, ledger=progress.ledger.vector(progress.done), speeds=progress.speeds,
                                losses=losses, evidence=evidence, failed=progress.failed, dtype=self.dtype,
                                device=parts[0].device if parts else loss.device,
                                out=overlapped.tail if overlapped is not None else None)
        if overlapped is not None:
            overlapped.tail_ready()
        return parts, tail

    def _verifier(self, step: int):
        """The witnesses' votes, judged on the reduced tail before the commit barrier (docs/scout.md)."""
        if not self.layout.evidence:
            return None
        return lambda tensors: self.localizer.judge(step, self.sync.members,
                                                    self.layout.read(tensors[:-1], tensors[-1]).evidence)

    def _committed(self, step: int, progress: _Progress, parts: list[torch.Tensor], tail: torch.Tensor,
                   quotas: dict[int, int], attempt: int, compute_s: float, wait_s: float,
                   overlapped: bool = False) -> StepOutcome:
        sync, ledger = self.sync, progress.ledger
        reduced = self.layout.read(parts, tail)
        count = ledger.check(reduced.ledger)
        self._update_speeds(reduced.speeds)
        if self.localizer is not None:
            self.localizer.observe_speeds(step, reduced.speeds)
        if ledger.transitions and any(t.lost for t in ledger.transitions):
            self.degraded = True
        elif self.degraded and len(self._holding) >= (self.active or len(self._holding)):
            self.degraded = False
            sync.events.emit("full_strength", step=step, epoch=sync.epoch, holding=list(self._holding))
        # the reduced failure flag is the same for every member, so all discard or none (torchft's should_commit
        # is such an all-reduce of errors too)
        return StepOutcome(
            step=step, reduced=reduced, committed=count, participants=len(sync.members), quotas=quotas,
            recomputed=ledger.recomputed, mine=len(progress.done), attempts=attempt,
            discarded=reduced.failed and not self.policy.redistributes,
            compute_s=compute_s, wait_s=wait_s, recovery_s=progress.recovery_s, overlapped=overlapped,
        )

    def _note_capacity(self, step: int, ledger: StepLedger) -> None:
        """Spare promotions and lost capacity, from who holds quota at the start of the step."""
        holding = active_replicas(ledger.members, self.active)
        promoted = [m for m in holding if m >= (self.active or self.groups) and m not in self._holding]
        if promoted and self._holding:
            self.sync.events.emit("spare_promoted", step=step, epoch=ledger.epoch, spares=promoted,
                                  holding=list(holding))
        if self.active and len(holding) < self.active:
            self.degraded = True
        self._holding = holding

    def _update_speeds(self, measured: list[float]) -> None:
        alpha = self.quota.speed_smoothing
        for replica, speed in enumerate(measured):
            if speed <= 0:
                continue
            old = self.speeds.get(replica)
            self.speeds[replica] = speed if old is None else alpha * speed + (1 - alpha) * old
