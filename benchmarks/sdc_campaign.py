#!/usr/bin/env python3
"""Silent-data-corruption campaign (docs/scout.md): how often single bit flips are detected and attributed.

Three replicas of the ``tiny`` Llama (TorchTitan's model, its ``OptimizersContainer`` with AdamW and its LR
schedule), one process each in real jobs, here three model copies in this process fed the same addressable
microbatches. Each replica runs the project's own step: :class:`ReplicaWorker` (forward, backward, the float64
exact-mode accumulator, the signatures), :class:`StepRecovery`'s phases (the replay plan, the holder's and the
replayers' computations, the reduction tail) and :class:`Localizer` (evidence, judge), with the optimizer step and
clip of the sync mode. The reduction is the sum of the replicas' tails and accumulators, as the all-reduce forms it.

    base runs     one cluster of 3 replicas per setting (no localisation; vote with the state signature and replay
                  every 1, 2, 5, 10 steps or never; vote with the parameters-only signature), stepped in lockstep,
                  ``--steps`` + ``--window`` steps: every vote is a clean vote, the committed states are checked
                  equal across settings, and the step times give the overhead at each interval in the same run
    injections    for every (kind, bit class, interval) cell, ``--injections`` flips drawn from the campaign's own
                  random stream (never from the replay plan): a step uniform in [2, steps], an element uniform in
                  the target, a bit uniform in its class; for gradient and activation flips a microbatch uniform
                  among the step's ids (its holder is the corrupted replica), else a replica uniform. The corrupted
                  replica restarts from the base run's state before that step, the flip lands (parameter and
                  optimizer state: before the step; gradient: after the microbatch's backward; activation: in the
                  first layer's output of its forward), and it runs on, step by step, against the other replicas'
                  recorded tails, until a vote refuses a step or ``--window`` steps pass
    clean         ``--clean`` draws per interval (a step and a replica) without a flip, judged the same way

Outcomes of an injection: ``detected`` (a vote refused a step: latency = that step - the injected step;
``attributed`` if it named exactly the corrupted replica), ``escaped`` (nothing refused and the corruption reached
the reduction: every replica commits it, no later vote can see it), ``masked`` (the flip changed nothing the
reduction or the replica's state holds any more), ``dormant`` (the replica's state still differs from the others'
after ``--window`` steps and no vote saw it). A false attribution is a refusal by a vote none of whose witnesses
computed from a corrupted input (base runs, clean draws, the parameter vote of a gradient or activation flip's
step, and its replay vote when another microbatch was replayed).

    python benchmarks/sdc_campaign.py [--injections 200] [--quick]

Writes docs/results/sdc_campaign.txt (the table) and docs/results/sdc_campaign.png (detection rate per replay
interval). Last line: ``param_detect=... grad_detect_at_1=... false=... overhead_at_1=...``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import pathlib
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import commit, write_result  # noqa: E402
from titan_recover import platform  # noqa: E402

platform.activate("cpu")

from titan_recover.data.addressable import AddressableTokens  # noqa: E402
from titan_recover.data.prepare import DEFAULT_DATA_DIR, prepare  # noqa: E402
from titan_recover.evaluate import forward_arguments  # noqa: E402
from titan_recover.models import get_model  # noqa: E402
from titan_recover.recover.chaos.kinds import flip_bit  # noqa: E402
from titan_recover.recover.invariant import grad_norm  # noqa: E402
from titan_recover.recover.invariant.quota import QuotaConfig  # noqa: E402
from titan_recover.recover.invariant.step_recovery import StepRecovery  # noqa: E402
from titan_recover.recover.modes.base import TrainerParts  # noqa: E402
from titan_recover.recover.modes.replica_worker import ComputeHooks, local_parameters, ReplicaWorker  # noqa: E402
from titan_recover.recover.phoenix.state_transfer import local_tensor, TrainingState  # noqa: E402
from titan_recover.recover.scout.config import LocalizeConfig  # noqa: E402
from titan_recover.recover.scout.consensus import fingerprint  # noqa: E402
from titan_recover.recover.scout.localize import Localizer  # noqa: E402

KINDS = ("parameter", "gradient", "activation", "exp_avg", "exp_avg_sq")
STATE_KINDS = ("parameter", "exp_avg", "exp_avg_sq")
"""Flips of a replica's memory (between steps); the others hit one computation of one microbatch."""
OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq")
BIT_CLASSES = {"sign": (31,), "exponent": tuple(range(23, 31)), "mantissa": tuple(range(23))}
"""float32 bit positions by class; a flip takes a bit uniformly within its class."""
INTERVALS = (1, 2, 5, 10, 0)
"""``[recover.localize] replay_interval`` values (0: off)."""
OUTCOMES = ("detected", "escaped", "masked", "dormant", "unsimulated")


@dataclasses.dataclass(frozen=True)
class Setup:
    replicas: int = 3
    microbatches: int = 3
    """M: replica microbatches per step (the default of 3 replicas: one each)."""
    seq_len: int = 32
    batch: int = 2
    steps: int = 50
    """Injections land in steps [2, steps]: from step 2 on the optimizer state exists."""
    window: int = 10
    """Steps an injection is followed for (its own included)."""
    seed: int = 0
    """The campaign's random stream (what is flipped where)."""
    replay_seed: int = 0
    """``[recover.localize] replay_seed``: the replay plan's own stream."""

    @property
    def total_steps(self) -> int:
        return self.steps + self.window


@dataclasses.dataclass(frozen=True)
class Flip:
    kind: str
    bits: str
    step: int
    replica: int
    bit: int
    element: int
    microbatch: int | None = None
    """Gradient and activation flips: the global microbatch id whose holder's computation is corrupted."""


def draw(setup: Setup, kind: str, bits: str, interval: int, index: int, sizes: dict[str, int]) -> Flip:
    """Injection ``index`` of a cell, from the campaign's own stream: it never reads the replay plan."""
    rng = random.Random(f"sdc:{setup.seed}:{kind}:{bits}:{interval}:{index}")
    step = rng.randint(2, setup.steps)
    bit = rng.choice(BIT_CLASSES[bits])
    element = rng.randrange(sizes[kind])
    if kind in STATE_KINDS:
        return Flip(kind, bits, step, rng.randrange(setup.replicas), bit, element)
    microbatch = (step - 1) * setup.microbatches + rng.randrange(setup.microbatches)
    return Flip(kind, bits, step, holder(setup, microbatch), bit, element, microbatch)


def holder(setup: Setup, microbatch: int) -> int:
    """The replica that computes ``microbatch`` under the even quota with every replica a member."""
    return microbatch % setup.replicas


# ---- one replica of this process ---------------------------------------------------------------------------------
class Events:
    """What the localizer reports (``corruption_attributed``, ``vote_inconclusive``), kept for the outcome."""

    def __init__(self):
        self.records: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> None:
        self.records.append((event, fields))


class OneEpoch:
    """The sync of a job whose membership never changes: a refused step ends the injection, nobody is evicted."""

    epoch = committed_epoch = 0

    def __init__(self, replicas: int, events: Events):
        self.members = self.committed_members = tuple(range(replicas))
        self.events = events
        self.recoveries: list = []

    def catch_up(self, step: int) -> None:
        pass

    def members_of(self, epoch: int) -> tuple[int, ...]:
        return self.members


class Counter:
    """The trainer's step and tokens (TorchTitan's ``train_state``)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class NoMetrics:
    def record_batch(self, *_args) -> None:
        pass


class FlippingWorker(ReplicaWorker):
    """The project's worker; while it computes the flip's microbatch as its holder (not as a replayer), the flip
    lands in that computation."""

    flip: Flip | None = None
    armed: Flip | None = None

    def compute(self, g: int, witness: str | None = None) -> int | None:
        flip = self.flip
        self.armed = flip if flip is not None and g == flip.microbatch and witness != "replay" else None
        try:
            return super().compute(g, witness)
        finally:
            self.armed = None


class Replica:
    """One replica group of one rank: TorchTitan's model, optimizers and schedulers, the project's worker,
    localizer and step recovery manager, driven one phase at a time (the reduction between them is the caller's)."""

    def __init__(self, setup: Setup, index: int, tokens: AddressableTokens, *, interval: int | None,
                 signature: str = "state"):
        """``interval``: the replay interval (None: no localisation at all); ``signature``: what the parameter vote
        signs, ``state`` (parameters and optimizer state, the sync mode's) or ``parameters``."""
        self.setup, self.index = setup, index
        entry = get_model("llama3", "tiny")
        spec = platform.adapt_model_spec(entry.model_spec(), platform.PlatformConfig(), "cpu")
        config = entry.base_config()
        torch.manual_seed(0)
        model = spec.model.build()
        model.init_weights(buffer_device=None)
        model.train()
        self.model = model
        optimizers = config.optimizer.build(model_parts=[model])
        schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=setup.total_steps)
        self.max_norm = config.training.max_norm
        device = torch.device("cpu")

        def forward_backward(*, input_dict, labels, global_valid_tokens):
            # TorchTitan's step: the summed token loss over the global batch's token count, then backward
            tokens_in, kwargs = forward_arguments(model, input_dict, device)
            logits = model(tokens_in, **kwargs)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                     labels.reshape(-1), reduction="sum") / global_valid_tokens
            loss.backward()
            return loss

        training = SimpleNamespace(local_batch_size=setup.batch, seq_len=setup.seq_len)
        self.parts = TrainerParts(
            config=SimpleNamespace(training=training), model_parts=[model], optimizers=optimizers,
            lr_schedulers=schedulers, checkpointer=None, dataloader=tokens, metrics_processor=NoMetrics(),
            parallel_dims=SimpleNamespace(pp_enabled=False, dp_enabled=False), device=device,
            gradient_accumulation_steps=1, pp_microbatches=1, pp_has_last_stage=True,
            forward_backward=forward_backward, train_state=Counter())
        # the reduction after the last microbatch (the CPU default, overlap_reduction = false): a gradient flip,
        # injected after a backward, lands before the gradients move into the accumulator
        self.worker = FlippingWorker(self.parts, per_step=setup.microbatches, exact=True, reports_final=False,
                                     hooks=ComputeHooks(after_backward=self._after_backward))
        self.events = Events()
        self.localizer = None
        if interval is not None:
            self.localizer = Localizer(LocalizeConfig(replay_interval=interval, replay_seed=setup.replay_seed),
                                       replica=index, rank=0, groups=setup.replicas, events=self.events)
        sign = self.worker.state_signature if signature == "state" else self.worker.parameter_signature
        self.recovery = StepRecovery(QuotaConfig(policy="even", microbatches=setup.microbatches, exact=True),
                                     replica=index, groups=setup.replicas, per_step=setup.microbatches,
                                     sync=OneEpoch(setup.replicas, self.events), worker=self.worker,
                                     localizer=self.localizer, signature=sign, dtype=torch.float64)
        self.state = TrainingState([model], list(optimizers), schedulers, train_state=self.parts.train_state)
        next(model.children()).register_forward_hook(self._on_first_layer)

    # ---- flips ------------------------------------------------------------------------------------------------
    def _after_backward(self) -> None:
        flip = self.worker.armed
        if flip is not None and flip.kind == "gradient":
            flip_element([local_tensor(p.grad) for p in self.worker.params], flip.element, flip.bit)

    def _on_first_layer(self, _module, _inputs, output) -> None:
        flip = self.worker.armed
        if flip is not None and flip.kind == "activation":
            with torch.no_grad():
                flip_bit(output, flip.element % output.numel(), flip.bit)

    def flip_state(self, flip: Flip) -> None:
        flip_element(self.targets(flip.kind), flip.element, flip.bit)

    def targets(self, kind: str) -> list[torch.Tensor]:
        if kind == "parameter":
            return local_parameters([self.model])
        if kind in OPTIMIZER_KINDS:
            return [local_tensor(opt.state[p][kind]) for opt in self.parts.optimizers
                    for group in opt.param_groups for p in group["params"]]
        if kind == "gradient":
            return [local_tensor(p) for p in self.worker.params]  # shaped as the gradients
        raise ValueError(kind)

    # ---- state ------------------------------------------------------------------------------------------------
    def snapshot(self) -> tuple[list[torch.Tensor], dict, dict]:
        return ([t.clone() for t in self.state.tensors()], self.parts.lr_schedulers.state_dict(),
                self.parts.train_state.state_dict())

    def restore(self, snapshot) -> None:
        """The state a transfer would give (docs/phoenix.md): every tensor copied in place, the schedule, the step."""
        tensors, schedule, counter = snapshot
        self.state.ensure_optimizer_state()
        mine = self.state.tensors()
        assert len(mine) == len(tensors)
        with torch.no_grad():
            for dst, src in zip(mine, tensors):
                dst.copy_(src)
        self.parts.lr_schedulers.load_state_dict(schedule)
        self.parts.train_state.load_state_dict(counter)

    def copy_parameters(self, other: "Replica") -> None:
        with torch.no_grad():
            for dst, src in zip(local_parameters([self.model]), local_parameters([other.model])):
                dst.copy_(src)

    # ---- the step, phase by phase (StepRecovery.run's first attempt) ------------------------------------------
    def compute(self, step: int):
        """Plan, this replica's quota (a sampled replay first), its contribution and tail."""
        self.parts.optimizers.zero_grad()
        self.worker.begin_step(step)
        recovery = self.recovery
        ledger = recovery.plan(step)
        recovery._note_capacity(step, ledger)
        progress, _ = recovery._compute_quota(step, ledger)
        recovery._take_over(step, progress, 1)
        parts, tail = recovery._pack(progress)
        return progress, parts, tail

    def plan_only(self, step: int) -> None:
        """The replay plan of ``step`` (what :meth:`compute` sets), for a replica whose tail was recorded."""
        if self.localizer is not None:
            ledger = self.recovery.plan(step)
            self.localizer.replay_for(step, ledger.assignment.ids, ledger.members)

    def judge(self, step: int, parts: list[torch.Tensor], tail: torch.Tensor):
        """The votes of this replica's rank over the reduced tail (the votes read only the tail)."""
        verify = self.recovery._verifier(step)
        return verify([*parts, tail]) if verify is not None else None

    def commit(self, step: int, progress, parts: list[torch.Tensor], tail: torch.Tensor) -> None:
        """``parts`` and ``tail`` hold the reduced sums: the committed step, clipped and applied."""
        self.recovery._committed(step, progress, parts, tail, {}, 1, 0.0, 0.0)
        self.worker.write_gradient(parts, 1.0)
        grad_norm.clip_grad_norm_([p for p in self.model.parameters()], self.max_norm, foreach=True)
        self.parts.optimizers.step()
        self.parts.lr_schedulers.step()
        self.parts.train_state.step = step

    def contribution(self, parts: list[torch.Tensor], tail: torch.Tensor) -> int:
        """A signature of what this replica puts into the reduction: its accumulated gradient and loss."""
        return fingerprint(parts, extra=[float(tail[0])])


def flip_element(tensors: list[torch.Tensor], element: int, bit: int) -> None:
    """Flip ``bit`` of element ``element`` of the tensors laid end to end."""
    for t in tensors:
        if element < t.numel():
            flip_bit(t, element, bit)
            return
        element -= t.numel()
    raise IndexError("element beyond the tensors")


# ---- base runs ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Cluster:
    name: str
    interval: int | None
    signature: str
    replicas: list[Replica]
    tails: dict[int, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    contributions: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    step_s: list[float] = dataclasses.field(default_factory=list)
    votes: int = 0
    false: int = 0


@dataclasses.dataclass
class Base:
    setup: Setup
    clusters: dict[str, Cluster]
    snapshots: dict[int, tuple]
    """The committed state before each step (identical in every cluster, checked)."""
    gradients: dict[int, torch.Tensor]
    """The reduced gradient of each step."""
    states: dict[int, int]
    """The state signature before each step."""


def cluster_names() -> list[tuple[str, int | None, str]]:
    out = [("none", None, "state"), ("params_only", 0, "parameters")]
    out += [(f"replay_{k}" if k else "replay_off", k, "state") for k in INTERVALS]
    return out


def run_base(setup: Setup, tokens: AddressableTokens, names: tuple[str, ...] | None = None, log=print) -> Base:
    """``names``: the settings to run (default: all; ``replay_off`` always, the reference of the others)."""
    clusters = {}
    for name, interval, signature in cluster_names():
        if names is not None and name not in names and name != "replay_off":
            continue
        replicas = [Replica(setup, r, tokens, interval=interval, signature=signature) for r in range(setup.replicas)]
        for r in replicas[1:]:
            r.copy_parameters(replicas[0])  # the members start from the lowest member's parameters
        clusters[name] = Cluster(name, interval, signature, replicas)
    snapshots, gradients, states = {}, {}, {}
    order = list(clusters)
    started = time.perf_counter()
    for step in range(1, setup.total_steps + 1):
        reference = clusters["replay_off"].replicas[0]
        snapshots[step] = reference.snapshot()
        states[step] = reference.worker.state_signature()
        shift = step % len(order)  # the settings take turns going first (the machine's load drifts)
        for name in order[shift:] + order[:shift]:
            cluster = clusters[name]
            gradient = base_step(cluster, step)
            if name == "replay_off":
                gradients[step] = gradient
        signatures = {name: c.replicas[0].worker.state_signature() for name, c in clusters.items()}
        if len(set(signatures.values())) != 1:
            raise RuntimeError(f"step {step}: the settings committed different states {signatures}")
        if step % 10 == 0:
            log(f"base runs: step {step}/{setup.total_steps}, {time.perf_counter() - started:.0f} s", flush=True)
    return Base(setup, clusters, snapshots, gradients, states)


def base_step(cluster: Cluster, step: int) -> torch.Tensor:
    """One step of a cluster: every replica computes and signs, the tails and accumulators are summed, every rank
    judges, all commit. Times the step as parallel replicas would take it (the slowest in each phase)."""
    computed, compute_s = [], []
    for replica in cluster.replicas:
        start = time.perf_counter()
        computed.append(replica.compute(step))
        compute_s.append(time.perf_counter() - start)
    tails = [tail.clone() for _, _, tail in computed]
    contributions = [r.contribution(parts, tail) for r, (_, parts, tail) in zip(cluster.replicas, computed)]
    reduced = flat(computed[0][1])
    for _, parts, _ in computed[1:]:
        reduced += flat(parts)
    reduced_tail = sum_tails(tails)
    commit_s = []
    decisions = None
    for replica, (progress, parts, tail) in zip(cluster.replicas, computed):
        start = time.perf_counter()
        votes_before = replica.localizer.votes if replica.localizer is not None else 0
        refusal = replica.judge(step, [reduced], reduced_tail)
        if replica.localizer is not None and decisions is None:
            decisions = replica.localizer.votes - votes_before
        if refusal is not None:
            cluster.false += 1
            raise RuntimeError(f"{cluster.name} step {step}: a clean step was refused: {refusal}")
        fill(parts, reduced)
        tail.copy_(reduced_tail)
        replica.commit(step, progress, parts, tail)
        commit_s.append(time.perf_counter() - start)
    cluster.votes += decisions or 0
    cluster.tails[step] = tails
    cluster.contributions[step] = contributions
    cluster.step_s.append(max(compute_s) + max(commit_s))
    return reduced


def flat(parts: list[torch.Tensor]) -> torch.Tensor:
    """A replica's gradient parts (its parameters' accumulators, in parameter order) as one new flat tensor."""
    return torch.cat([part.reshape(-1) for part in parts])


def fill(parts: list[torch.Tensor], values: torch.Tensor) -> None:
    """Write the flat ``values`` into the gradient parts, as a reduction in place would."""
    offset = 0
    for part in parts:
        part.copy_(values[offset : offset + part.numel()].view_as(part))
        offset += part.numel()


def sum_tails(tails: list[torch.Tensor]) -> torch.Tensor:
    out = tails[0].clone()
    for t in tails[1:]:
        out += t
    return out


# ---- injections --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    flip: Flip | None
    interval: int | None
    signature: str
    outcome: str
    attributed: bool = False
    latency: int | None = None
    what: tuple[str, ...] = ()
    replayed: int | None = None
    """The microbatch the injected step replayed (None: no replay that step)."""
    clean_votes: int = 0
    false: int = 0


def inject(base: Base, cluster: Cluster, flip: Flip | None, *, clean_step: int | None = None,
           clean_replica: int = 0) -> Result:
    """Run the corrupted replica (or, with ``flip=None``, a clean one) from the base state before the injected
    step against the other replicas' recorded tails, until a vote refuses or the window ends."""
    setup = base.setup
    step0 = flip.step if flip is not None else clean_step
    x = flip.replica if flip is not None else clean_replica
    replica = cluster.replicas[x]
    replica.restore(base.snapshots[step0])
    computation_kind = flip is not None and flip.kind not in STATE_KINDS
    if flip is not None and not computation_kind:
        replica.flip_state(flip)
    result = Result(flip, cluster.interval, cluster.signature, "dormant")
    last = min(step0 + setup.window - 1, setup.total_steps)
    for step in range(step0, last + 1):
        replica.worker.flip = flip if computation_kind and step == step0 else None
        try:
            progress, parts, tail = replica.compute(step)
        finally:
            replica.worker.flip = None
        plan = replica.localizer.plan
        if step == step0:
            result.replayed = plan.microbatch if plan is not None else None
        tails = [tail.clone() if r == x else cluster.tails[step][r] for r in range(setup.replicas)]
        reduced_tail = sum_tails(tails)
        replica.events.records.clear()
        votes_before = replica.localizer.votes
        refusals = []
        for r, other in enumerate(cluster.replicas):
            if r != x:
                other.plan_only(step)
            refusals.append(other.judge(step, parts, reduced_tail))
        decisions = replica.localizer.votes - votes_before
        refusal = refusals[x]
        if any((r is None) != (refusal is None) or (r is not None and r.evict != refusal.evict) for r in refusals):
            raise RuntimeError(f"ranks judged step {step} differently: {refusals}")
        refused_what = tuple(sorted({f["what"] for _, f in replica.events.records}))
        if step == step0:
            clean = clean_votes(flip, plan, decisions)
            result.clean_votes = len(clean)
            result.false = sum(1 for what in clean if what in refused_what)
        if refusal is not None:
            result.outcome = "detected" if flip is not None else "false"
            result.attributed = flip is not None and refusal.evict == (x,)
            result.latency = step - step0
            result.what = refused_what
            return result
        if flip is None:
            result.outcome = "clean"
            return result
        if replica.contribution(parts, tail) != cluster.contributions[step][x]:
            # the corruption is in the reduction: every replica commits it (nothing left for a vote to see), or,
            # for a corrupted state, the others' state leaves the recorded run (not followed here)
            result.outcome = "escaped" if computation_kind else "unsimulated"
            return result
        if computation_kind:
            result.outcome = "masked"
            return result
        fill(parts, base.gradients[step])
        tail.copy_(reduced_tail)
        replica.commit(step, progress, parts, tail)
        if step + 1 in base.states and replica.worker.state_signature() == base.states[step + 1]:
            result.outcome = "masked"
            return result
    return result


def clean_votes(flip: Flip | None, plan, decisions: int) -> list[str]:
    """The votes of the injected step none of whose witnesses computed from a corrupted input."""
    votes = ["parameters", "replay"][:decisions] if decisions else []
    if flip is None:
        return votes
    if flip.kind in STATE_KINDS:
        return []
    return [v for v in votes if v == "parameters" or (plan is not None and plan.microbatch != flip.microbatch)]


def target_sizes(replica: Replica, setup: Setup) -> dict[str, int]:
    sizes = {kind: sum(t.numel() for t in replica.targets(kind)) for kind in ("parameter", "gradient", *OPTIMIZER_KINDS)}
    sizes["activation"] = setup.batch * setup.seq_len * replica.model.config.dim
    return sizes


def campaign(base: Base, injections: int, clean: int, log=print) -> list[Result]:
    setup = base.setup
    sizes = target_sizes(base.clusters["replay_off"].replicas[0], setup)
    results = []
    started = time.perf_counter()
    cells = [(kind, bits, k) for k in INTERVALS for kind in KINDS for bits in BIT_CLASSES]
    for n, (kind, bits, k) in enumerate(cells):
        cluster = base.clusters[f"replay_{k}" if k else "replay_off"]
        for i in range(injections):
            results.append(inject(base, cluster, draw(setup, kind, bits, k, i, sizes)))
        if (n + 1) % 5 == 0:
            log(f"injections: {n + 1}/{len(cells)} cells, {time.perf_counter() - started:.0f} s", flush=True)
    for kind in OPTIMIZER_KINDS:  # the vote without the optimizer state (interval-independent: replay off)
        for bits in BIT_CLASSES:
            for i in range(injections):
                results.append(inject(base, base.clusters["params_only"], draw(setup, kind, bits, -1, i, sizes)))
    log(f"injections done, {time.perf_counter() - started:.0f} s", flush=True)
    for k in INTERVALS:  # clean draws
        cluster = base.clusters[f"replay_{k}" if k else "replay_off"]
        rng = random.Random(f"sdc:{setup.seed}:clean:{k}")
        for _ in range(clean):
            results.append(inject(base, cluster, None, clean_step=rng.randint(2, setup.steps),
                                  clean_replica=rng.randrange(setup.replicas)))
    log(f"clean draws done, {time.perf_counter() - started:.0f} s", flush=True)
    return results


# ---- report ------------------------------------------------------------------------------------------------------
def rate(results: list[Result], pred) -> float:
    return sum(1 for r in results if pred(r)) / len(results) if results else float("nan")


def interval_name(k: int | None) -> str:
    return "off" if k == 0 else str(k)


def report(base: Base, results: list[Result], wall_s: float, args) -> tuple[list[str], dict[str, str]]:
    setup = base.setup
    lines = []
    cells = collections.defaultdict(list)
    for r in results:
        if r.flip is not None:
            cells[(r.flip.kind, r.signature, r.flip.bits, r.interval)].append(r)
    header = (f"{'kind':10s} {'signature':10s} {'bits':8s} {'replay':>6s} {'n':>4s} {'detect':>7s} {'attrib':>7s} "
              f"{'lat mean':>8s} {'lat max':>7s} {'escaped':>7s} {'masked':>7s} {'dormant':>7s} {'expect':>7s}")
    lines.append(header)
    lines.append("-" * len(header))
    for (kind, signature, bits, k), rs in sorted(cells.items(), key=lambda c: (
            KINDS.index(c[0][0]), c[0][1] != "state", list(BIT_CLASSES).index(c[0][2]), INTERVALS.index(c[0][3]))):
        latencies = [r.latency for r in rs if r.latency is not None]
        expect = ""
        if kind not in STATE_KINDS:
            expect = f"{(1 / k if k else 0) / setup.microbatches:7.3f}"
        lines.append(
            f"{kind:10s} {signature:10s} {bits:8s} {interval_name(k):>6s} {len(rs):4d} "
            f"{rate(rs, lambda r: r.outcome == 'detected'):7.3f} {rate(rs, lambda r: r.attributed):7.3f} "
            f"{statistics.mean(latencies) if latencies else float('nan'):8.2f} "
            f"{max(latencies) if latencies else '-':>7} "
            f"{rate(rs, lambda r: r.outcome == 'escaped'):7.3f} {rate(rs, lambda r: r.outcome == 'masked'):7.3f} "
            f"{rate(rs, lambda r: r.outcome == 'dormant'):7.3f} {expect:>7s}")
    unsimulated = sum(1 for r in results if r.outcome == "unsimulated")
    lines.append("")
    lines.append("detect: a vote refused a step within the window; attrib: the refusal named exactly the corrupted "
                 "replica; lat: steps from the flip's step to the refused one")
    lines.append("escaped: undetected and in the reduction (every replica commits it); masked: no trace left in the "
                 "reduction or the replica's state; dormant: the state still differs after the window, unseen")
    lines.append("expect: the chance that the corrupted microbatch is the one replayed, (1 / interval) / M")
    if unsimulated:
        lines.append(f"unsimulated (a corrupted state reached the reduction undetected; not followed): {unsimulated}")

    # clean votes
    base_votes = sum(c.votes for c in base.clusters.values())
    base_false = sum(c.false for c in base.clusters.values())
    injected_votes = sum(r.clean_votes for r in results if r.flip is not None)
    injected_false = sum(r.false for r in results if r.flip is not None)
    clean_draws = [r for r in results if r.flip is None]
    draw_votes = sum(r.clean_votes for r in clean_draws)
    draw_false = sum(r.false for r in clean_draws)
    votes = base_votes + injected_votes + draw_votes
    false = base_false + injected_false + draw_false
    lines.append("")
    lines.append(f"clean votes: {votes} ({base_votes} in the base runs, {injected_votes} of injected steps whose "
                 f"witnesses computed nothing corrupted, {draw_votes} of {len(clean_draws)} clean draws); "
                 f"false attributions: {false}")

    # overhead
    off = base.clusters["replay_off"].step_s
    warm = 3
    mean_off = statistics.mean(off[warm:])
    lines.append("")
    lines.append("overhead: mean step time (each phase as long as its slowest replica), settings interleaved step by "
                 f"step in the same run, first {warm} steps left out")
    overhead = {}
    for name, cluster in base.clusters.items():
        mean = statistics.mean(cluster.step_s[warm:])
        overhead[name] = mean / mean_off
        lines.append(f"  {name:12s} {mean * 1000:8.2f} ms  x{mean / mean_off:.3f} of the vote without replay")
    none = statistics.mean(base.clusters["none"].step_s[warm:])
    lines.append(f"  the vote itself (state signature, replay off) costs x{mean_off / none:.3f} of no localisation")

    lines.append("")
    lines.append(f"setup: tiny Llama (dim 64, 2 layers, vocab 2048), {setup.replicas} replicas, M = "
                 f"{setup.microbatches} microbatches of {setup.batch} x {setup.seq_len} tokens per step, exact mode, "
                 f"AdamW; base runs {setup.total_steps} steps, injections in steps [2, {setup.steps}], followed "
                 f"{setup.window} steps; seed {setup.seed}, replay seed {setup.replay_seed}; {args.injections} "
                 f"injections per cell, {args.clean} clean draws per interval; wall {wall_s:.0f} s")

    def pooled(pred) -> list[Result]:
        return [r for r in results if r.flip is not None and pred(r)]

    def detect(rs) -> str:
        return f"{rate(rs, lambda r: r.outcome == 'detected'):.3f}"

    headline = {
        "param_detect": detect(pooled(lambda r: r.flip.kind == "parameter")),
        "param_attrib": f"{rate(pooled(lambda r: r.flip.kind == 'parameter'), lambda r: r.attributed):.3f}",
        **{f"grad_detect_at_{interval_name(k)}": detect(pooled(lambda r, k=k: r.flip.kind == "gradient"
                                                                and r.interval == k)) for k in INTERVALS},
        "act_detect_at_1": detect(pooled(lambda r: r.flip.kind == "activation" and r.interval == 1)),
        "optim_detect": detect(pooled(lambda r: r.flip.kind in OPTIMIZER_KINDS and r.signature == "state")),
        "optim_detect_params_only": detect(pooled(lambda r: r.flip.kind in OPTIMIZER_KINDS
                                                  and r.signature == "parameters")),
        "false": str(false),
        "clean_votes": str(votes),
        **{f"overhead_at_{interval_name(k)}": f"{overhead[f'replay_{k}']:.3f}" for k in INTERVALS if k},
    }
    return lines, headline


def plot(results: list[Result], setup: Setup, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(INTERVALS)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in KINDS:
        ys = [rate([r for r in results if r.flip is not None and r.flip.kind == kind and r.signature == "state"
                    and r.interval == k], lambda r: r.outcome == "detected") for k in INTERVALS]
        ax.plot(xs, ys, marker="o", label=kind)
    for kind in OPTIMIZER_KINDS:
        y = rate([r for r in results if r.flip is not None and r.flip.kind == kind and r.signature == "parameters"],
                 lambda r: r.outcome == "detected")
        ax.plot(xs, [y] * len(xs), linestyle=":", label=f"{kind}, parameters-only vote")
    expect = [(1 / k if k else 0) / setup.microbatches for k in INTERVALS]
    ax.plot(xs, expect, linestyle="--", color="gray", label="(1/interval)/M: the flipped microbatch is replayed")
    ax.set_xticks(xs, [interval_name(k) for k in INTERVALS])
    ax.set_xlabel("replay interval (steps)")
    ax.set_ylabel("detection rate (all bit classes)")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title("Single bit flips detected by the vote and replay (3 replicas, M = %d)" % setup.microbatches)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--injections", type=int, default=None, help="per cell (default 200; --quick: 10)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and injections: a smoke run")
    parser.add_argument("--steps", type=int, default=None, help="injection steps [2, steps] (default 50; quick 12)")
    parser.add_argument("--clean", type=int, default=None, help="clean draws per interval (default 2 x injections)")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay-seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"), help="folder of the table and the plot")
    args = parser.parse_args(argv)
    args.injections = args.injections or (10 if args.quick else 200)
    args.clean = 2 * args.injections if args.clean is None else args.clean
    torch.set_num_threads(1)
    setup = Setup(microbatches=args.microbatches, steps=args.steps or (12 if args.quick else 50),
                  window=args.window, seed=args.seed, replay_seed=args.replay_seed)
    tokens = AddressableTokens(prepare(str(ROOT / DEFAULT_DATA_DIR)), setup.seq_len)
    started_at, at_commit = datetime.datetime.now(datetime.timezone.utc), commit()
    started = time.perf_counter()
    base = run_base(setup, tokens)
    results = campaign(base, args.injections, args.clean)
    wall_s = time.perf_counter() - started
    lines, headline = report(base, results, wall_s, args)
    last = " ".join(f"{k}={v}" for k, v in headline.items())
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "sdc_campaign.txt", __file__, argv if argv is not None else sys.argv[1:],
                 "\n".join(lines) + "\n" + last, started_at, wall_s, at_commit)
    plot(results, setup, out / "sdc_campaign.png")
    print("\n".join(lines))
    print(last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
