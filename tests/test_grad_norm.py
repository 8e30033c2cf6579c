"""The deterministic gradient clip of sync mode (docs/invariant.md, "Replicas identical by construction").

Replicas are simulated in one process: ``W`` ranks per replica, each holding its gradient shards; a replica's
collectives are the test's functions. The cross-check with TorchTitan's clip on FSDP2 x TP and pipeline stages x TP
runs four gloo processes (``grad_norm_ranks.py``).
"""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Partial

from titan_recover.recover.invariant.grad_norm import clip_grad_norm_, owned_square_sum, owns, total_norm

RANKS = 4
SEED = 13
"""Shards whose float32 partial squares add up differently in ring and tree order (checked below)."""


def shards(seed: int = SEED, dtype=torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(64, generator=generator, dtype=dtype) for _ in range(RANKS)]


def parameters_of(grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    return p


def float32_all_reduce_clip(grads: list[torch.Tensor], max_norm: float, order: str) -> list[torch.Tensor]:
    """TorchTitan's clip as a replica computes it: each rank's float32 norm squared, summed by an all-reduce that
    adds in ``order`` (``ring``: one after the other; ``tree``: pairs first), every rank's grads scaled."""
    s = [torch.linalg.vector_norm(g) ** 2 for g in grads]
    total = ((s[0] + s[1]) + s[2]) + s[3] if order == "ring" else (s[0] + s[1]) + (s[2] + s[3])
    coef = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
    return [g * coef for g in grads]


UNEVEN_SEEDS = {torch.float32: 41, torch.float64: 3}
UNEVEN_SCALES = (0.1, 1.0, 3.0, 30.0)
"""Seeds (by dtype) and per-rank scales of shards whose squares add up differently in ring and tree order, and whose
float64 partials do in the two arrival orders of the test below (both checked there). A plain ``sum`` in arrival
order instead of ``math.fsum`` fails the float64 case (checked); the float32 case's two float64 sums round to the
same float32 norm, so only the float64 case tells them apart."""


def uneven_shards(dtype: torch.dtype) -> list[torch.Tensor]:
    return [g * scale for g, scale in zip(shards(UNEVEN_SEEDS[dtype], dtype), UNEVEN_SCALES)]


def replica_clip(grads: list[torch.Tensor], max_norm: float,
                 gather_order: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, list[float]]:
    """The new clip on every rank of one replica, whose all-gather hands the partials over in ``gather_order`` (the
    order they arrive in, as an algorithm would move them); returns the clipped gradients, the norm and the
    partials by rank."""
    params = [parameters_of(g) for g in grads]
    partials = [float(owned_square_sum([p.grad])) for p in params]

    def gather(partial: torch.Tensor) -> list[float]:
        assert float(partial) in partials
        return [partials[r] for r in gather_order]

    norms = [clip_grad_norm_([p], max_norm, gather=gather) for p in params]
    assert len({n.item() for n in norms}) == 1  # every rank of the replica clips by the same norm
    return [p.grad for p in params], norms[0], partials


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_replicas_whose_in_replica_sums_round_differently_still_agree_bitwise(dtype):
    grads = uneven_shards(dtype)
    ring, tree = float32_all_reduce_clip(grads, 1.0, "ring"), float32_all_reduce_clip(grads, 1.0, "tree")
    # the premise: the two all-reduce orders give the two replicas different parameters after the update
    assert not all(torch.equal(a, b) for a, b in zip(ring, tree))
    orders = [0, 1, 2, 3], [3, 1, 0, 2]
    first, norm, partials = replica_clip(grads, 1.0, gather_order=orders[0])
    second, _, _ = replica_clip([g.clone() for g in grads], 1.0, gather_order=orders[1])
    # and the partials, added in the order they arrive, round differently on the two replicas
    assert len({sum(partials[r] for r in order) for order in orders}) == 2
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    # the norm is the partials' exact sum rounded once (rationals: no float addition), and the gradients are clipped
    # by it as torch clips
    exact = torch.tensor(math.sqrt(float(sum(Fraction(p) for p in partials))), dtype=dtype)
    assert torch.equal(norm, exact)
    reference = [parameters_of(g) for g in grads]
    torch.nn.utils.clip_grads_with_norm_(reference, 1.0, exact)
    assert all(torch.equal(a, p.grad) for a, p in zip(first, reference))
    assert not all(torch.equal(a, g) for a, g in zip(first, grads))  # the clip was active


def test_the_total_does_not_depend_on_the_order_of_the_partials():
    partials = [float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in shards()]
    partials += [1e-17, 3.0, 1e16]
    assert len({total_norm(partials[i:] + partials[:i]) for i in range(len(partials))}) == 1
    assert total_norm([1e308, 1e308]) == math.inf and math.isnan(total_norm([math.inf, math.nan]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_single_process_clip_equals_torch(dtype, max_norm):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator, dtype=dtype) for shape in [(7, 3), (11,), (2, 2, 5)]]
    theirs = [parameters_of(g) for g in grads]
    mine = [parameters_of(g) for g in grads]
    reference = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    norm = clip_grad_norm_(mine, max_norm)
    assert norm.dtype == reference.dtype == dtype
    rel = 1e-12 if dtype == torch.float64 else 1e-6
    assert norm.item() == pytest.approx(reference.item(), rel=rel)
    for a, b in zip(mine, theirs):
        if max_norm > norm:  # not clipped: the gradients are untouched, bitwise
            assert torch.equal(a.grad, b.grad)
        torch.testing.assert_close(a.grad, b.grad, rtol=rel, atol=0)


def test_clip_is_bitwise_torchs_when_the_norms_agree():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]  # norm 13, exact in every order
    theirs, mine = [parameters_of(g) for g in grads], [parameters_of(g) for g in grads]
    assert torch.equal(torch.nn.utils.clip_grad_norm_(theirs, 1.0), clip_grad_norm_(mine, 1.0))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs))


def test_non_finite_norms_are_used_as_torch_uses_them():
    for bad in (math.inf, math.nan):
        grads = [torch.tensor([1.0, bad]), torch.tensor([2.0])]
        theirs, mine = [parameters_of(g) for g in grads], [parameters_of(g) for g in grads]
        reference = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        norm = clip_grad_norm_(mine, 1.0)
        assert torch.equal(norm, reference) or (norm.isnan() and reference.isnan())
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a.grad, b.grad, equal_nan=True)
        with pytest.raises(RuntimeError, match="non-finite"):
            clip_grad_norm_([parameters_of(g) for g in grads], 1.0, error_if_nonfinite=True)


def test_a_replicated_tensor_counts_on_coordinate_zero_of_its_replicated_dimensions_only():
    fsdp_tp = (Shard(0), Replicate())
    assert owns(fsdp_tp, (0, 0)) and owns(fsdp_tp, (1, 0))
    assert not owns(fsdp_tp, (0, 1)) and not owns(fsdp_tp, (1, 1))
    assert all(owns((Shard(0), Shard(1)), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)])
    assert owns((Replicate(), Replicate()), (0, 0)) and not owns((Replicate(), Replicate()), (0, 1))
    # a settled partial gradient holds the sum at coordinate 0 of the partial dimension, zeros elsewhere
    assert owns((Shard(0), Partial()), (1, 0)) and not owns((Shard(0), Partial()), (1, 1))


def test_dtensor_gradients_on_a_one_process_mesh(tmp_path):
    """Sharded, replicated and partial gradients of a 1 x 1 mesh (the single rank owns all of them) clip as the
    plain tensors they stand for."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        grads = shards(dtype=torch.float64)[:3]
        params = [parameters_of(g) for g in grads]
        distributed = []
        for g, placements in zip(grads, [(Shard(0), Replicate()), (Shard(0), Shard(0)), (Shard(0), Partial())]):
            p = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(g), mesh, placements))
            p.grad = DTensor.from_local(g.clone(), mesh, placements)
            distributed.append(p)
        norm, expected = clip_grad_norm_(distributed, 1.0), clip_grad_norm_(params, 1.0)
        assert norm.item() == pytest.approx(expected.item(), rel=1e-15)
        assert all(torch.equal(p.grad.to_local(), q.grad) for p, q in zip(distributed, params))
        by_max = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, (Shard(0), Replicate())))
        by_max.grad = DTensor.from_local(torch.ones(2), mesh, (Shard(0), Partial("max")))
        with pytest.raises(ValueError, match="cannot be settled"):
            clip_grad_norm_([by_max], 1.0)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_equals_torchtitans_clip_on_fsdp_tp_and_pipeline_tp_ranks(tmp_path):
    """Four gloo processes: FSDP2 (2) x TP (2), then two stages x TP (2); the new clip's norm and clipped
    gradients against ``torchtitan.distributed.utils.clip_grad_norm_`` on the same gradients."""
    script = os.path.join(os.path.dirname(__file__), "grad_norm_ranks.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                           script], env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == {"fsdp_tp", "pp_tp"}
        # the ownership rule met replicated gradients, and the settling partial ones
        assert results["fsdp_tp"]["replicated"] > 0 and results["pp_tp"]["partial"] > 0
        for layout, result in results.items():
            assert result["norm"] == pytest.approx(result["torchtitan_norm"], rel=1e-6), (layout, rank)
            assert result["max_grad_rel_diff"] <= 1e-6, (layout, rank)


def test_each_tensors_norm_is_taken_in_its_dtype_at_least_float32_and_the_squares_added_in_float64():
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(1000, generator=generator, dtype=dtype) * 3 for dtype in
             (torch.float32, torch.bfloat16, torch.float64, torch.float32)]
    partial = owned_square_sum(grads)
    assert partial.dtype == torch.float64
    # bfloat16 widened to float32 before the norm (a bfloat16 norm would be off in the third digit)
    expected = [torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]
    assert float(partial) == pytest.approx(math.fsum(float(n) ** 2 for n in expected), rel=1e-15)
    assert float(partial) != pytest.approx(sum(float(torch.linalg.vector_norm(g)) ** 2 for g in grads), rel=1e-4)


def test_gradients_the_replica_worker_builds_keep_a_partial_gradients_placement(tmp_path):
    """A tensor-parallel norm weight (Replicate over the TP mesh) whose backward gives a Partial gradient (each TP
    rank a summand): the zeros an overlapped step starts from, a backup restored after an aborted reduction and a
    reduced sum written where the replica had no gradient are Partial too (labelled Replicate, each TP rank's
    summand would be taken as the whole gradient). A sharded parameter needs no record (its gradient is placed as
    itself)."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titan_recover.recover.modes.replica_worker import needs_gradient_placements, ReplicaWorker

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        norm = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, (Replicate(),)))
        sharded = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, (Shard(0),)))
        assert needs_gradient_placements(norm) and not needs_gradient_placements(sharded)
        worker = ReplicaWorker.__new__(ReplicaWorker)
        worker.params, worker.exact, worker._loaded = [norm, sharded], False, True
        worker._grad_placements, worker._placements_unknown = [None, None], [0]
        worker.parts, worker._backward_seen = SimpleNamespace(parallel_dims=SimpleNamespace(tp_enabled=True)), False
        assert worker.needs_backward()  # a spare's first step: the manager computes a microbatch for it
        norm.grad = DTensor.from_local(torch.full((4,), 0.5), mesh, (Partial(),))  # as the backward gives it
        worker._note_placements()
        assert worker._placements_unknown == []
        worker.replace_gradient([torch.full((4,), 2.0), torch.full((4,), 3.0)])  # a backup restored
        assert norm.grad.placements == (Partial(),) and norm.grad.to_local().tolist() == [2.0] * 4
        assert sharded.grad.placements == (Shard(0),)
        norm.grad = sharded.grad = None
        assert worker._zero_gradient(0).placements == (Partial(),)  # what an overlapped step starts from
        worker.parts = SimpleNamespace(metrics_processor=None)
        worker.write_gradient([torch.full((4,), 7.0), torch.full((4,), 1.0)], scale=1)  # computed nothing
        assert norm.grad.placements == (Partial(),) and norm.grad.to_local().tolist() == [7.0] * 4
    finally:
        torch.distributed.destroy_process_group()
