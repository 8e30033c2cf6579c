"""One rank of tests/test_grad_norm.py's cross-check (run by torchrun, 4 gloo processes): the deterministic clip
against TorchTitan's on the same gradients, for FSDP2 (2) x TP (2) and for two pipeline stages x TP (2).

Blocks are parallelized as TorchTitan parallelizes Llama's (sequence-parallel norms, whose weights are replicated
over TP; column- and row-wise linears; FSDP2 over the data-parallel dimension). Without FSDP2 the norms'
gradients are partial over TP (each rank holds a summand), with it replicated. Writes ``rank{R}.json`` to
``$RESULTS``.
"""

from __future__ import annotations

import json
import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module, RowwiseParallel, SequenceParallel
from torchtitan.distributed import utils as dist_utils

from titan_recover.recover.invariant.grad_norm import clip_grad_norm_

MAX_NORM = 0.01
"""Small enough that every layout clips."""


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def tensor_parallel(block: Block, tp_mesh) -> Block:
    plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(block, tp_mesh, plan)


def gradients(model, tp_mesh, seed: int) -> list[torch.nn.Parameter]:
    """One forward and backward on this rank's sequence shard of a batch; the parameters."""
    tp, tp_rank = tp_mesh.size(), tp_mesh.get_local_rank()
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(seed))
    out = model(x[:, tp_rank * 8 // tp : (tp_rank + 1) * 8 // tp])
    (out**2).sum().backward()
    return list(model.parameters())


def compare(params: list[torch.nn.Parameter], pp_mesh) -> dict:
    """Both clips on the same gradients; the gradients compared as the tensors they stand for (a partial one is
    summed)."""
    saved = [p.grad.to_local().clone() for p in params]
    placements = [tuple(p.grad.placements) for p in params]
    reference = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh)
    clipped = [p.grad.full_tensor() for p in params]
    for p, g in zip(params, saved):
        p.grad.to_local().copy_(g)
    norm = clip_grad_norm_(params, MAX_NORM, foreach=True)
    diff = max(float((a - p.grad.full_tensor()).abs().max() / a.abs().max()) for a, p in zip(clipped, params))
    return {"norm": float(norm), "torchtitan_norm": float(reference), "max_grad_rel_diff": diff,
            "replicated": sum(any(x.is_replicate() for x in p) for p in placements),
            "partial": sum(any(x.is_partial() for x in p) for p in placements)}


def fsdp_tp() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    for block in model:
        tensor_parallel(block, mesh["tp"])
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return compare(gradients(model, mesh["tp"], seed=1 + mesh.get_coordinate()[0]), pp_mesh=None)


def pp_tp() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_coordinate()[0]
    torch.manual_seed(10 + stage)  # each stage holds its own layers
    model = tensor_parallel(Block(), mesh["tp"])
    return compare(gradients(model, mesh["tp"], seed=20 + stage), pp_mesh=mesh["pp"])


def main() -> None:
    torch.distributed.init_process_group("gloo")
    results = {"fsdp_tp": fsdp_tp(), "pp_tp": pp_tp()}
    rank = torch.distributed.get_rank()
    with open(os.path.join(os.environ["RESULTS"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
