"""The one buffer a rank reduces across replicas per step: its layout, packing and reading (docs/invariant.md).

Every entry is summed over the member replicas at the same rank, so each section is either this rank's
share of a sum (gradient, loss) or a vector in which every replica writes only its own entries (ledger: one count
per microbatch id; speeds and losses: one entry per replica; evidence: see
:class:`~titan_recover.recover.scout.localize.Localizer`); the last entry counts the members that saw a failure::

    | gradient (G) | loss (1) | ledger (M) | speeds (R) | losses (R) | evidence (E) | failed (1) |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reduced:
    """A reduced buffer, read by section (``gradient`` is a view into it)."""

    gradient: torch.Tensor
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
    def size(self) -> int:
        return self.gradients + 1 + self.microbatches + 2 * self.groups + self.evidence + 1

    def pack(self, gradient: torch.Tensor | list[torch.Tensor], *, loss: torch.Tensor, ledger: list[float],
             speeds: list[float], losses: list[float], evidence: list[float], failed: bool, dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's contribution in one buffer on the gradient's device (the fault-tolerant group reduces it
        there, or stages it through host memory). ``gradient``: the flat accumulation, or its parts in order.
        ``out``: a buffer of this layout to fill again (a new one when it does not fit)."""
        parts = [gradient] if isinstance(gradient, torch.Tensor) else list(gradient)
        numel = sum(p.numel() for p in parts)
        if numel != self.gradients:
            raise ValueError(f"gradient has {numel} elements, the layout {self.gradients}")
        tail = [*ledger, *speeds, *losses, *evidence, 1.0 if failed else 0.0]
        if len(tail) != self.size - self.gradients - 1:
            raise ValueError(f"sections of {len(ledger)}, {len(speeds)}, {len(losses)}, {len(evidence)} entries do "
                             f"not fit the layout {self}")
        device = parts[0].device if parts else loss.device
        fits = out is not None and out.device == device and out.dtype == dtype and out.numel() == self.size
        buffer = out if fits else torch.empty(self.size, dtype=dtype, device=device)
        with torch.no_grad():
            offset = 0
            for part in parts:
                buffer[offset : offset + part.numel()].copy_(part.detach().reshape(-1))
                offset += part.numel()
            g = self.gradients
            buffer[g : g + 1].copy_(loss.detach().reshape(1))
            buffer[g + 1 :].copy_(torch.tensor(tail, dtype=dtype))
        return buffer

    def read(self, buffer: torch.Tensor) -> Reduced:
        g, m, r, e = self.gradients, self.microbatches, self.groups, self.evidence
        loss, *tail = buffer[g:].tolist()  # one small copy to the host
        return Reduced(
            gradient=buffer[:g],
            loss=loss,
            ledger=tail[:m],
            speeds=tail[m : m + r],
            losses=tail[m + r : m + 2 * r],
            evidence=tail[m + 2 * r : m + 2 * r + e],
            failed=tail[-1] > 0,
        )
