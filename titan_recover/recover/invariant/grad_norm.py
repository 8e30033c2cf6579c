"""Gradient clipping whose total norm does not depend on how a replica's collectives add (docs/invariant.md).

TorchTitan's ``clip_grad_norm_`` forms the total norm with an all-reduce inside the replica (a DTensor's
``full_tensor``, a sum over pipeline stages): two replicas holding bitwise the same gradient shards can round that
sum differently when their collectives add in different orders (another NCCL algorithm, another topology), and
then clip by coefficients that differ in the last bit. :func:`clip_grad_norm_` clips as torch does
(``coef = clamp(max_norm / (total_norm + 1e-6), max=1)``, by :func:`torch.nn.utils.clip_grads_with_norm_`), with
the total formed so that it is a function of the gradient shards only:

* a gradient still partial over a mesh dimension (TP's sequence-parallel norms without FSDP: each rank holds a
  summand) is settled first (:func:`settle_partials`): its summands are all-gathered and added in rank order, the
  rank at coordinate 0 keeps the sum and the others hold zeros, so that the reduction the optimizer later does on
  it adds exact zeros and gives the same bits whatever its algorithm;
* each rank takes the norm of every tensor it *owns* (its shards, and a tensor replicated (or settled) over a mesh
  dimension only at coordinate 0 of that dimension (:func:`owns`), so that every element counts once; a plain
  tensor is the rank's own: a pipeline stage's; replica groups keep ``data_parallel_replicate_degree = 1``, so
  none is replicated inside a replica), as torch's clip does (``_foreach_norm``, in the gradient's dtype, float32
  at least), and adds their squares in float64: its partial, a function of its shards alone;
* the ranks' partials are all-gathered (bytes moved, no arithmetic) over the replica's world, pipeline stages
  included;
* every rank adds them with :func:`math.fsum`, which rounds the exact sum once, whatever the order.

Only the 2-norm is provided (TorchTitan's default). A tensor's norm overflows where torch's does (a float32
gradient whose norm exceeds about 3e38); the float64 partials overflow only beyond about 1e154 (then the norm is
``inf``). The per-tensor norms are not taken in float64: on a CPU that widening costs ~5x the float32 norm
(``benchmarks/clip_norm.py``), a few percent of a large model's step. They are then as accurate as torch's own
(float32 accumulation: 5.6e-5 relative in the squared total of 60 M random elements, printed by that benchmark),
and still the same bits on every replica.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

Gather = Callable[[torch.Tensor], list[float]]
"""``gather(partial)``: every rank's partial (a float64 scalar tensor) of the replica, in rank order."""


def owns(placements: Sequence[Placement], coordinate: Sequence[int]) -> bool:
    """Whether the rank at ``coordinate`` of a DTensor's mesh counts its local elements: it is at coordinate 0 of
    every mesh dimension the tensor is replicated or (settled) partial over; its shards on the other dimensions
    are its own."""
    return all(c == 0 for p, c in zip(placements, coordinate) if p.is_replicate() or p.is_partial())


def settle_partials(grads: Iterable[torch.Tensor]) -> None:
    """In place: every DTensor gradient partial over a mesh dimension gets the sum of its summands, added in rank
    order, at coordinate 0 of that dimension and zeros elsewhere (the tensor it stands for is unchanged)."""
    for g in grads:
        if not isinstance(g, DTensor):
            continue
        coordinate = g.device_mesh.get_coordinate()
        for dim, placement in enumerate(g.placements):
            if not placement.is_partial() or coordinate is None:
                continue
            if getattr(placement, "reduce_op", "sum") != "sum":
                raise ValueError(f"a gradient partial by {placement} cannot be settled (only sums are)")
            local = g.to_local()
            summands = [torch.empty_like(local) for _ in range(g.device_mesh.size(dim))]
            torch.distributed.all_gather(summands, local.contiguous(), group=g.device_mesh.get_group(dim))
            if coordinate[dim] == 0:
                total = summands[0].clone()
                for summand in summands[1:]:
                    total.add_(summand)
                local.copy_(total)
            else:
                local.zero_()


def owned(grads: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The local tensors of ``grads`` this rank counts (plain tensors: all of them)."""
    mine = []
    for g in grads:
        if isinstance(g, DTensor):
            coordinate = g.device_mesh.get_coordinate()
            if coordinate is None or not owns(g.placements, coordinate):
                continue
            g = g.to_local()
        mine.append(g)
    return mine


def owned_square_sum(grads: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """This rank's partial: the squares of the norms of the tensors it owns, each taken in the tensor's dtype (at
    least float32), added in float64 in the tensors' order (a float64 scalar on the gradients' device, or on
    ``device`` when it holds none)."""
    mine = owned(grads)
    if not mine:
        return torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else device)
    norms: list[torch.Tensor | None] = [None] * len(mine)
    for dtype in dict.fromkeys(torch.promote_types(t.dtype, torch.float32) for t in mine):
        at = [i for i, t in enumerate(mine) if torch.promote_types(t.dtype, torch.float32) == dtype]
        group = [mine[i] for i in at]
        found = torch._foreach_norm(group, 2) if all(t.dtype == dtype for t in group) else \
            torch._foreach_norm(group, 2, dtype=dtype)
        for i, n in zip(at, found):
            norms[i] = n
    return torch.stack([n.to(device=mine[0].device, dtype=torch.float64) for n in norms]).square().sum()


def all_gather_partials(partial: torch.Tensor) -> list[float]:
    """Every rank's partial over the default process group (the replica's world), in rank order."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [float(partial)]
    gathered = [torch.empty_like(partial) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, partial)
    return torch.stack(gathered).tolist()


def total_norm(partials: Sequence[float]) -> float:
    """The 2-norm from the ranks' partials, rounded once (``inf`` beyond float64's range)."""
    try:
        return math.sqrt(math.fsum(partials))
    except OverflowError:
        return math.inf


def norm_dtype(grads: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype torch's total norm has: the promotion of the gradients' dtypes."""
    if not grads:
        return torch.get_default_dtype()
    return functools.reduce(torch.promote_types, (g.dtype for g in grads))


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *, gather: Gather = all_gather_partials,
                    device: torch.device | str = "cpu", error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (this rank's part of the replica's model) to the 2-norm ``max_norm``
    as :func:`torch.nn.utils.clip_grad_norm_` does, with the total norm formed deterministically; returns it (a
    scalar tensor of the gradients' dtype, the same on every rank). ``gather``: the ranks' partials (default: an
    all-gather over the default group); ``device``: where the partial of a rank without gradients lies. A
    non-finite norm is used as torch uses it (``error_if_nonfinite``: raise instead, with torch's message)."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    settle_partials(grads)
    partial = owned_square_sum(grads, device)
    norm = total_norm(gather(partial))
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(
            "The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be clipped. "
            "To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    result = torch.tensor(norm, dtype=norm_dtype(grads), device=partial.device)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, result, foreach)
    return result
