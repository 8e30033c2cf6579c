"""A learner rank's parameters as ``F`` contiguous flat fragments (docs/diloco.md, "Fragments", "Send", "Pull and
mix"): each fragment's mark (a copy at its last send or adoption), the delta to send, and the mix of a global
fragment into the local one."""

from __future__ import annotations

import torch

from titan_recover.recover.diloco.rules import split_fragments
from titan_recover.recover.phoenix.state_transfer import local_tensor


class LocalFragments:
    """This rank's local shards of ``params`` (model order) split into near-equal fragments. ``where`` names the
    rank in error messages."""

    def __init__(self, params: list[torch.nn.Parameter], fragments: int, where: str):
        self.params, self.where = params, where
        self.ranges = split_fragments([local_tensor(p.data).numel() for p in params], fragments)
        self.count = len(self.ranges)
        self.marks = [self.flat(f).clone() for f in range(self.count)]

    def locals(self, fragment: int | None = None) -> list[torch.Tensor]:
        """The local shards of one fragment's parameters (of every parameter when ``fragment`` is None)."""
        start, end = self.ranges[fragment] if fragment is not None else (0, len(self.params))
        return [local_tensor(p.data) for p in self.params[start:end]]

    def flat(self, fragment: int) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float() for t in self.locals(fragment)])

    def write(self, fragment: int, flat: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for t in self.locals(fragment):
                t.copy_(flat[at : at + t.numel()].view_as(t).to(t.dtype))
                at += t.numel()

    def take_delta(self, fragment: int) -> torch.Tensor:
        """``mark - local`` (the progress since the last send or adoption) as a CPU copy; the mark moves to now."""
        flat = self.flat(fragment)
        delta = (self.marks[fragment] - flat).cpu()
        self.marks[fragment].copy_(flat)
        return delta

    def mix(self, fragment: int, global_flat: torch.Tensor) -> None:
        """``local <- global + (local - mark)``, ``mark <- global``: what was trained since the last send is kept,
        what was sent comes back through the global fragment."""
        mark = self.marks[fragment]
        if global_flat.numel() != mark.numel():
            raise RuntimeError(f"{self.where}: global fragment {fragment} has {global_flat.numel()} elements, this "
                               f"rank holds {mark.numel()} (a different model or sharding than the syncer's)")
        self.write(fragment, global_flat + (self.flat(fragment) - mark))
        mark.copy_(global_flat)
