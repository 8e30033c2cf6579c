"""Decoupled DiLoCo's pure rules (docs/diloco.md): fragments, their staggered schedule, the syncer's quorum,
adaptive grace window and token-weighted merge, and the outer optimizer step.

Nothing here talks to a process; the syncer and the learners apply these rules, and the tests check them alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import AbstractSet, Iterable, Mapping, Sequence

import torch


def split_fragments(sizes: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges over the parameters (in model order) with near-equal element counts.

    Every parameter is in exactly one fragment, each fragment holds at least one parameter."""
    if fragments < 1 or fragments > len(sizes):
        raise ValueError(f"fragments must be between 1 and the number of parameters ({len(sizes)}), got {fragments}")
    total = sum(sizes)
    ranges, start, acc = [], 0, 0
    for f in range(fragments - 1):
        target = total * (f + 1) / fragments
        acc += sizes[start]
        end = start + 1
        # take the next parameter while that brings the running total closer to this fragment's end, leaving
        # at least one parameter for every later fragment
        while end < len(sizes) - (fragments - f - 1) and abs(acc + sizes[end] - target) <= abs(acc - target):
            acc += sizes[end]
            end += 1
        ranges.append((start, end))
        start = end
    ranges.append((start, len(sizes)))
    return ranges


def fragment_offset(fragment: int, fragments: int, period: int) -> int:
    """Inner step (1-based, within every ``period``) at which ``fragment`` is due: spread evenly over the period
    so that the fragments' syncs are staggered (one fragment's traffic at a time)."""
    return max(1, round((fragment + 1) * period / fragments))


def due_fragments(step: int, fragments: int, period: int) -> list[int]:
    """Fragments a learner sends after inner step ``step`` (each exactly once every ``period`` steps)."""
    return [f for f in range(fragments) if step % period == fragment_offset(f, fragments, period) % period]


def quorum_size(min_quorum: int, alive: AbstractSet[int], delivered: Iterable[int]) -> int:
    """Deltas a fragment's round needs before it may merge: ``min_quorum``, fewer when fewer learners are alive or
    delivered (a delta of a learner that died since counts, it is not lost)."""
    return min(min_quorum, len(set(alive) | set(delivered)))


def quorum_reached(delivered: Mapping[int, int], quorum: int) -> bool:
    """``delivered``: learner -> tokens of its delta in the open round."""
    return len(delivered) >= quorum


@dataclass(frozen=True)
class GraceDecision:
    deadline_s: float
    """Seconds after the quorum was reached until which the syncer waits (0: merge now)."""
    waiting_for: tuple[int, ...]
    reason: str


def grace_window(delivered: Mapping[int, int], pending: Mapping[int, tuple[float, int]], period_s: float,
                 max_window_s: float) -> GraceDecision:
    """How long to wait, once the quorum delivered, for learners still expected.

    ``delivered``: learner -> tokens in its delta. ``pending``: learner -> (expected arrival in seconds after the
    quorum, from its past lateness; its expected tokens). A late learner is worth waiting for while what it adds
    exceeds what the wait costs: its share of the merged tokens ``n_j / (N + n_j)`` (otherwise its delta arrives one
    period staler) against the merge's delay as a share of the fragment's sync period ``eta_j / period_s`` (every
    learner trains that much longer on the older global fragment). Learners are considered in order of arrival; the
    window ends at the last one worth it, never after ``max_window_s``; dead learners are simply not pending, and
    one whose expected arrival has already passed (``eta <= 0``) is not waited for."""
    tokens = sum(delivered.values())
    deadline, waiting, notes = 0.0, [], []
    for learner, (eta, expected) in sorted(pending.items(), key=lambda item: (item[1][0], item[0])):
        if eta <= 0:  # its expected arrival has passed: the estimate failed, there is nothing to wait until
            notes.append(f"{learner} overdue")
            continue
        if eta > max_window_s:
            notes.append(f"{learner} beyond the {max_window_s:g} s cap")
            continue
        gain = expected / (tokens + expected) if tokens + expected > 0 else 0.0
        cost = eta / period_s
        if gain > cost:
            tokens += expected
            deadline = max(deadline, eta)
            waiting.append(learner)
        else:
            notes.append(f"{learner}: gain {gain:.2f} <= cost {cost:.2f}")
    reason = (f"wait {deadline:.2f} s for {waiting}" if waiting else "merge now") + (
        f" ({'; '.join(notes)})" if notes else "")
    return GraceDecision(deadline, tuple(waiting), reason)


def token_weights(delivered: Mapping[int, int]) -> dict[int, float]:
    """Each delivered delta weighs its learner's share of the tokens behind the merge."""
    total = sum(delivered.values())
    if total <= 0:
        raise ValueError(f"a merge needs tokens, got {dict(delivered)}")
    return {learner: n / total for learner, n in delivered.items()}


def merge_deltas(deltas: Mapping[int, torch.Tensor], delivered: Mapping[int, int]) -> torch.Tensor:
    """The outer gradient of a fragment: the token-weighted mean of the learners' deltas (``global - local``),
    summed in float64 in learner order (the same bits whatever the arrival order)."""
    weights = token_weights(delivered)
    out = None
    for learner in sorted(deltas):
        term = deltas[learner].to(torch.float64) * weights[learner]
        out = term if out is None else out + term
    return out


class OuterOptimizer:
    """The syncer's outer optimizer over one fragment: SGD with Nesterov momentum (torch's), the outer gradient
    being the merged delta."""

    def __init__(self, fragment: torch.Tensor, lr: float, momentum: float):
        self.parameter = torch.nn.Parameter(fragment.detach().clone(), requires_grad=False)
        self.optimizer = torch.optim.SGD([self.parameter], lr=lr, momentum=momentum, nesterov=momentum > 0)

    def step(self, outer_gradient: torch.Tensor) -> torch.Tensor:
        self.parameter.grad = outer_gradient.to(self.parameter.dtype)
        self.optimizer.step()
        self.parameter.grad = None
        return self.parameter.detach()

    def state_dict(self) -> dict:
        # a deep copy: torch's state_dict references the live momentum buffer, which the next step changes
        return {"parameter": self.parameter.detach().clone(), "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.parameter.copy_(state["parameter"])
        self.optimizer.load_state_dict(state["optimizer"])


def schedule_step(block: int, learners: int) -> int:
    """The learning-rate step (1-based, as TorchTitan's schedulers count) of the inner step that trains data block
    ``block``: blocks are claimed in order, about ``learners`` per synchronous step of the same budget."""
    return block // learners + 1


def total_blocks(steps: int, learners: int) -> int:
    """Data blocks (one inner step's microbatches each) in the job's budget: the microbatches of ``steps``
    synchronous steps of ``learners`` replica groups."""
    return steps * learners


Version = tuple[int, int]
"""(syncer generation, fragment version): a restarted syncer's versions are newer than any of its predecessor's."""


WARMING = ":warming"
"""The end of a syncer beat written just before work that compiles (its first evaluation's first microbatch: a
FlexAttention model compiles ``flex_attention`` there). The launcher holds such a beat to ``startup_timeout_s``,
not to ``syncer_timeout_s``; the syncer's next beat, after that microbatch, drops it (docs/diloco.md)."""


def warming(beat: bytes) -> bool:
    """Whether a syncer ``beat`` (the value of :attr:`DilocoKeys.SYNCER_BEAT`) announces a first compile."""
    return beat.endswith(WARMING.encode())


class DilocoKeys:
    """Store keys of the diloco mode. The coordinator's store (stable for the whole job) holds the syncer's address,
    the data-block counter and each learner's current block; the syncer's store (gone with the syncer) holds deltas
    and global fragments."""

    SYNCER = "diloco/syncer"  # coordinator: "HOST:PORT GENERATION"
    GENERATION = "diloco/generation"  # coordinator: counter of syncer starts (of leaders, with standby syncers)
    SYNCER_LEADER = "diloco/syncer_leader"  # coordinator (etcd): the leading syncer candidate's identity, leased
    CHECKPOINTED = "diloco/checkpointed"  # coordinator: "GENERATION MERGES" of the newest syncer checkpoint saved
    SYNCER_BEAT = "diloco/syncer_beat"  # coordinator: "GENERATION:TIME", rewritten by each pass of the syncer's loop
    """A beat that ends in :data:`WARMING` announces a first compile: the launcher holds it to the start bound."""
    NEXT_BLOCK = "diloco/next_block"  # coordinator: counter of claimed data blocks
    REQUEUED = "diloco/requeued"  # coordinator: counter of blocks given back (their learner died)
    BLOCKS_DONE = "diloco/blocks_done"  # coordinator: counter of blocks trained to the end (each counted once)
    COLLECTED_BELOW = "diloco/collected_below"  # coordinator: done keys of blocks below it deleted (blocks.collect_done)
    COLLECT_CLAIMED = "diloco/collect_claimed"  # coordinator: the claim counter as the previous collection read it
    VERSIONS = "global/versions"  # syncer: "GENERATION V_0 ... V_{F-1}"

    @staticmethod
    def block(learner: int) -> str:
        # coordinator: "BLOCK STEP START" (trained at inner step STEP by the learner's start START) or "done STEP START"
        return f"diloco/block/{learner}"

    @staticmethod
    def learners_over(node: int) -> str:
        return f"diloco/learners_over/{node}"  # coordinator: this node's launcher saw each of its learners end

    @staticmethod
    def requeue(number: int) -> str:
        return f"diloco/requeue/{number}"  # coordinator: the block given back as the number-th

    @staticmethod
    def requeue_owner(number: int) -> str:
        return f"diloco/requeue_owner/{number}"  # coordinator: who took it (set once, by compare-and-set)

    @staticmethod
    def requeued_of(block: int) -> str:
        # coordinator: the block was given back at least once (or counted by a giver for its holder): keys kept
        return f"diloco/requeued_of/{block}"

    @staticmethod
    def hold(block: int, learner: int, incarnation: int) -> str:
        # coordinator: how this start's hold of the block ended, set once: trained by it, or given back by whom
        return f"diloco/hold/{block}/{learner}/{incarnation}"

    @staticmethod
    def done_of(block: int) -> str:
        return f"diloco/done_of/{block}"  # coordinator: who finished the block first (set once)

    @staticmethod
    def claim(learner: int, incarnation: int, count: int) -> str:
        return f"diloco/claim/{learner}/{incarnation}/{count}"  # coordinator: rank 0's claim, for the other ranks

    @staticmethod
    def hello(learner: int, rank: int) -> str:
        return f"hello/{learner}/{rank}"  # syncer: the incarnation sending from this rank

    @staticmethod
    def init(learner: int, rank: int) -> str:
        return f"init/{learner}/{rank}"

    @staticmethod
    def delta(learner: int, incarnation: int, rank: int, number: int) -> str:
        return f"delta/{learner}/{incarnation}/{rank}/{number}"

    @staticmethod
    def fragment(fragment: int, rank: int, version: int) -> str:
        return f"global/{fragment}/{rank}/{version}"

    @staticmethod
    def meta(prefix: str) -> str:
        return prefix + "/meta"


def encode_versions(generation: int, versions: Sequence[int]) -> str:
    return " ".join(str(v) for v in (generation, *versions))


def decode_versions(raw: bytes | str) -> tuple[int, list[int]]:
    generation, *versions = (int(v) for v in (raw.decode() if isinstance(raw, bytes) else raw).split())
    return generation, versions
