"""The global model the syncer holds (docs/diloco.md, "The syncer"): one outer optimizer (and its global copy) per
(fragment, rank), each fragment's version, and the layout of every rank's shards."""

from __future__ import annotations

import torch

from titan_recover.recover.diloco.messages import publish_fragment
from titan_recover.recover.diloco.rules import DilocoKeys, encode_versions, merge_deltas, OuterOptimizer


class GlobalModel:
    def __init__(self, *, ranks: int, outer_lr: float, outer_momentum: float):
        self.ranks, self.outer_lr, self.outer_momentum = ranks, outer_lr, outer_momentum
        self.layout: list[dict] = []  # per rank: names, shapes, global_shapes, fragment ranges
        self.optimizers: dict[tuple[int, int], OuterOptimizer] = {}  # (fragment, rank)
        self.versions: list[int] = []

    @property
    def fragments(self) -> int:
        return len(self.versions)

    def build(self, metas: list[dict], flats: list[torch.Tensor]) -> None:
        """Version 0 from every rank's offer (:func:`titan_recover.recover.diloco.messages.read_offer`)."""
        self.layout = [{"names": m["names"], "shapes": m["shapes"], "ranges": m["ranges"],
                        "global_shapes": m["global_shapes"]} for m in metas]
        for rank, (meta, flat) in enumerate(zip(metas, flats)):
            offsets = [0]
            for shape in meta["shapes"]:
                offsets.append(offsets[-1] + int(torch.Size(shape).numel()))
            for f, (start, end) in enumerate(meta["ranges"]):
                self.optimizers[(f, rank)] = OuterOptimizer(flat[offsets[start] : offsets[end]], self.outer_lr,
                                                                self.outer_momentum)
        self.versions = [0] * len(metas[0]["ranges"])

    def merge(self, fragment: int, deltas: dict[int, list[torch.Tensor]], tokens: dict[int, int]) -> int:
        """One outer step per rank on the token-weighted mean of the learners' deltas; the new version."""
        for rank in range(self.ranks):
            outer_gradient = merge_deltas({i: d[rank] for i, d in deltas.items()}, tokens)
            self.optimizers[(fragment, rank)].step(outer_gradient)
        self.versions[fragment] += 1
        return self.versions[fragment]

    def publish(self, store, fragment: int) -> None:
        for rank in range(self.ranks):
            publish_fragment(store, fragment, rank, self.versions[fragment],
                             self.optimizers[(fragment, rank)].parameter)

    def publish_versions(self, store, generation: int) -> None:
        """The versions learners poll: written after the fragments they name."""
        store.set(DilocoKeys.VERSIONS, encode_versions(generation, self.versions))

    def flats(self) -> list[torch.Tensor]:
        """Every rank's parameters, flat, in model order."""
        return [torch.cat([self.optimizers[(f, p)].parameter.detach().reshape(-1) for f in range(self.fragments)])
                for p in range(self.ranks)]

    def parameters(self) -> dict[str, torch.Tensor] | None:
        """The global model by name (see :func:`assemble_rows`), or None for layouts it cannot assemble."""
        return assemble_rows(self.layout, self.flats())

    def state_dict(self) -> dict:
        return {"layout": self.layout, "versions": list(self.versions),
                "optimizers": {f"{f}/{p}": o.state_dict() for (f, p), o in self.optimizers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.layout = state["layout"]
        for key, saved in state["optimizers"].items():
            f, p = (int(v) for v in key.split("/"))
            optimizer = OuterOptimizer(saved["parameter"], self.outer_lr, self.outer_momentum)
            optimizer.load_state_dict(saved)
            self.optimizers[(f, p)] = optimizer
        self.versions = list(state["versions"])


def assemble_rows(layout: list[dict], flats: list[torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Whole parameters by name from every rank's flat local shards (``layout[p]``: names, shapes,
    global_shapes): concatenated along dim 0 in rank order when that gives the whole shape (one process per
    learner, FSDP2's row shards); None for other layouts (TP's column shards, PP's stages)."""
    per_rank = []
    for meta, flat in zip(layout, flats):
        shards, at = {}, 0
        for name, shape in zip(meta["names"], meta["shapes"]):
            n = int(torch.Size(shape).numel())
            shards[name] = flat[at : at + n].view(shape)
            at += n
        per_rank.append(shards)
    first = layout[0]
    out = {}
    for name, whole in zip(first["names"], first.get("global_shapes", first["shapes"])):
        if any(name not in shards for shards in per_rank):
            return None
        parts = [shards[name] for shards in per_rank]
        joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0) if parts[0].dim() else None
        if joined is None or list(joined.shape) != list(whole):
            return None
        out[name] = joined.clone()
    return out
