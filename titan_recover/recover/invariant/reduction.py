"""What a rank reduces across replicas per step: the gradient in place, the small sections beside it, and the
backup that lets an aborted reduction leave the local accumulation as it was (docs/invariant.md).

Every entry is summed over the member replicas at the same rank, so each section is either this rank's
share of a sum (gradient, loss) or a vector in which every replica writes only its own entries (ledger: one count
per microbatch id; speeds and losses: one entry per replica; evidence: see
:class:`~titan_recover.recover.scout.localize.Localizer`); the last entry counts the members that saw a failure.
The gradient is reduced where it lies (the parameters' local gradients, or the exact-mode accumulator), as one
collective with the *tail* holding the rest, issued in :func:`issue_order`::

    gradient parts (G elements, in parameter order, issued last part first) + tail: | loss (1) | ledger (M) |
                                                     | speeds (R) | losses (R) | evidence (E) | failed (1) |

In place means an aborted reduction may have left partial sums in the gradient, and an abandoned collective (gloo
cannot abort one) may still write into it. :class:`Backup` copies each piece just before the collective first
writes it; after an abort the worker's gradient gets *fresh* storage holding what it held before (the old storage
is left to the abandoned collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def issue_order(parts: list[torch.Tensor], tail: torch.Tensor) -> list[torch.Tensor]:
    """The order in which a step's reduction issues its tensors, overlapped with the last backward or not
    (:mod:`~titan_recover.recover.invariant.overlap`): the gradient parts reversed (the order a backward finishes
    them), then the tail. Every path uses this one order, so the sums are the same bits: a backend may batch
    consecutive small tensors (gloo's coalescing), and where an element falls in a batch decides the order in which
    the members' values are added (with three members or more, float addition is not associative)."""
    return [*reversed(parts), tail]


def part_of(index: int, parts: int) -> int:
    """The gradient part (in parameter order) of tensor ``index`` of :func:`issue_order` (``parts`` or more: the
    tail)."""
    return parts - 1 - index if index < parts else index


@dataclass(frozen=True)
class Reduced:
    """A reduced step, read by section (``gradient``: the reduced parts themselves)."""

    gradient: list[torch.Tensor]
    loss: float
    """Summed token loss of the committed batch at this rank (and the same rank of every replica), divided by the global batch's tokens."""
    ledger: list[float]
    speeds: list[float]
    """Microbatches per second of each replica in this step (0: computed nothing)."""
    losses: list[float]
    """Mean token loss of what each replica computed at this rank (0: computed nothing)."""
    evidence: list[float]
    failed: bool
    """Some member saw a failure in this step (the same for every member)."""


@dataclass(frozen=True)
class ReductionLayout:
    gradients: int
    """G: elements of this rank's local gradient shards, in parameter order."""
    microbatches: int
    """M: microbatch ids of a step."""
    groups: int
    """R: replica groups of the job (active and spares)."""
    evidence: int = 0
    """E: signature entries of the witnesses (0: localisation off)."""

    @property
    def tail_size(self) -> int:
        return 1 + self.microbatches + 2 * self.groups + self.evidence + 1

    def check(self, parts: list[torch.Tensor]) -> None:
        numel = sum(p.numel() for p in parts)
        if numel != self.gradients:
            raise ValueError(f"gradient has {numel} elements, the layout {self.gradients}")

    def tail(self, *, loss: torch.Tensor, ledger: list[float], speeds: list[float], losses: list[float],
             evidence: list[float], failed: bool, dtype: torch.dtype, device: torch.device,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's small sections in one tensor on ``device`` (reduced in the same collective as the gradient);
        ``out``: written into this tensor of :meth:`empty_tail`'s shape (one an overlapped reduction already holds)."""
        values = [*ledger, *speeds, *losses, *evidence, 1.0 if failed else 0.0]
        if len(values) != self.tail_size - 1:
            raise ValueError(f"sections of {len(ledger)}, {len(speeds)}, {len(losses)}, {len(evidence)} entries do "
                             f"not fit the layout {self}")
        tail = self.empty_tail(dtype, device) if out is None else out
        tail[:1].copy_(loss.detach().reshape(1))
        tail[1:].copy_(torch.tensor(values, dtype=dtype))
        return tail

    def empty_tail(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(self.tail_size, dtype=dtype, device=device)

    def read(self, parts: list[torch.Tensor], tail: torch.Tensor) -> Reduced:
        m, r, e = self.microbatches, self.groups, self.evidence
        loss, *rest = tail.tolist()  # one small copy to the host
        return Reduced(
            gradient=parts,
            loss=loss,
            ledger=rest[:m],
            speeds=rest[m : m + r],
            losses=rest[m + r : m + 2 * r],
            evidence=rest[m + 2 * r : m + 2 * r + e],
            failed=rest[-1] > 0,
        )


class Backup:
    """The gradient parts as they were before a reduction, saved piece by piece (:meth:`save`, the fault-tolerant
    group's ``before_piece``) and handed back as fresh tensors after an abort (:meth:`restored`). One byte buffer
    per rank (the parts may differ in dtype), reused from step to step. A part's pieces come in order, the parts in
    any order (an overlapped reduction issues them reversed)."""

    def __init__(self):
        self.flat: torch.Tensor | None = None
        self.offsets: list[int] = []
        """Byte offset of each part."""
        self.saved: list[int] = []
        """Bytes saved so far of each part (a prefix of it)."""

    def begin(self, parts: list[torch.Tensor]) -> None:
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + p.numel() * p.element_size())
        device = parts[0].device if parts else None
        if parts and (self.flat is None or self.flat.numel() != self.offsets[-1] or self.flat.device != device):
            self.flat = torch.empty(self.offsets[-1], dtype=torch.uint8, device=device)
        self.saved = [0] * len(parts)

    def save(self, index: int, start: int, view: torch.Tensor) -> None:
        """Called just before the collective first writes ``view`` (part ``index`` from element ``start``); indices
        past the parts (the tail) need no backup."""
        if index >= len(self.saved):
            return
        data = view.view(torch.uint8)
        at = start * view.element_size()
        base = self.offsets[index]
        self.flat[base + at : base + at + data.numel()].copy_(data)
        self.saved[index] = at + data.numel()

    def save_issued(self, index: int, start: int, view: torch.Tensor) -> None:
        """:meth:`save` for tensor ``index`` of :func:`issue_order` (the group's ``before_piece`` of a step's
        reduction)."""
        self.save(part_of(index, len(self.saved)), start, view)

    def restored(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """New tensors with the parts' values before the reduction: each part's saved prefix from the backup, the
        rest (never issued, so never written) from the part itself."""
        fresh = []
        for i, part in enumerate(parts):
            start = self.offsets[i]
            out = torch.empty_like(part)
            target, source = out.view(-1).view(torch.uint8), part.reshape(-1).view(torch.uint8)
            saved = self.saved[i]
            target[:saved].copy_(self.flat[start : start + saved])
            target[saved:].copy_(source[saved:])
            fresh.append(out)
        return fresh
