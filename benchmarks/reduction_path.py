#!/usr/bin/env python3
"""The cross-replica gradient reduction on its own, three ways, over the same bytes (docs/replica_groups.md,
"The reduction: in place, with a backup"):

- ``native``: what TorchTitan's HSDP does across its replicate dimension: an in-place gloo all-reduce of each
  gradient shard (one per FSDP module), no copies;
- ``new``: this project's path as it runs on CPU (``[recover.step] abort_recovery = "recompute"``, the CPU
  platform's default: an aborted reduction computes the replica's microbatches again): the gradient shards reduced
  in place with the step's small sections beside them, as one collective of the fault-tolerant group (gloo, pieces
  of ``chunk_mb``, polled for the fault flag);
- ``backup``: the same collective with ``abort_recovery = "backup"`` (the default on GPUs): each piece copied into
  the backup just before it is issued (while the pieces before it are reduced), docs/invariant.md;
- ``old``: the data movement of the path before the FTPG backends (commit 8b7a5a7): the shards concatenated, copied
  to a new host tensor and concatenated again with the small sections, one gloo all-reduce of the whole buffer
  waited on through its future, written back parameter by parameter.

``--replicas`` R x ``--shards`` S processes on this host: shard position ``p`` of every replica forms one group of
R, and the S groups reduce at the same time (as the shard positions of a node do). Each rank holds
``--total-mb / S`` MiB of float32 gradient in ``--layers`` tensors. Rounds interleave the three paths in rotating
order; a round's time is the slowest rank's.

    python benchmarks/reduction_path.py [--total-mb 1024] [--replicas 2] [--shards 2] [--rounds 5]

Last line: ``new_vs_native=... old_vs_native=... backup_vs_native=...`` (ratios of median times; the table adds
the spread of the per-round ratios). Target on CPU: within 1.1x of native (docs/benchmarks.md, "Replica groups: the
reduction path on its own").
On this 2-core host the S groups' R*S processes share two cores, so absolute times are the host's, not a cluster's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pathlib
import statistics
import sys
import time
from datetime import timedelta

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402

PATHS = ("old", "new", "backup", "native")


def _old_path(pg, grads: list, tail: list[float]) -> None:
    import threading

    import torch
    from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

    flat = torch.cat([g.reshape(-1) for g in grads])
    buffer = torch.cat([flat.cpu().to(torch.float32), torch.zeros(1), torch.tensor(tail)])
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    work = pg.allreduce([buffer], opts)
    done = threading.Event()
    work.get_future().then(lambda _f: done.set())
    while not done.wait(0.01):
        pass
    work.wait()
    offset = 0
    for g in grads:
        g.copy_(buffer[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _new_path(group, layout, grads: list, tail: list[float], backup) -> None:
    import torch

    r = layout.groups
    if backup is not None:
        backup.begin(grads)
    sections = layout.tail(loss=torch.zeros(()), ledger=tail[: layout.microbatches], speeds=tail[-2 * r - 1 : -r - 1],
                           losses=tail[-r - 1 : -1], evidence=[], failed=False, dtype=torch.float32,
                           device=grads[0].device)
    group.allreduce_many_([*grads, sections], backup.save if backup is not None else None)
    layout.read(grads, sections)


def _native_path(pg, grads: list) -> None:
    from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    for g in grads:
        pg.allreduce([g], opts).wait()


def _member(port: int, replica: int, position: int, args, results) -> None:
    import torch
    from torch.distributed import PrefixStore, TCPStore
    from torch._C._distributed_c10d import ProcessGroupGloo

    from titan_recover.recover.ftpg.base import build_group, FTPGConfig
    from titan_recover.recover.invariant.reduction import Backup, ReductionLayout

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=600))
    members = tuple(range(args.replicas))
    numel = int(args.total_mb * 2**20 / 4 / args.shards)
    grads = [torch.full((numel // args.layers,), float(replica + 1)) for _ in range(args.layers)]
    layout = ReductionLayout(gradients=sum(g.numel() for g in grads), microbatches=8, groups=args.replicas)
    tail = [0.0] * (layout.tail_size - 1)  # ledger, speeds, losses, failed
    timeout = timedelta(seconds=600)
    raw = ProcessGroupGloo(PrefixStore(f"raw/{position}", store), replica, args.replicas, timeout)
    group = build_group(FTPGConfig(backend="gloo", chunk_mb=args.chunk_mb), store, epoch=0, members=members,
                        replica=replica, rank=position, timeout_s=600.0)
    barrier = ProcessGroupGloo(PrefixStore("barrier", store), replica * args.shards + position,
                               args.replicas * args.shards, timeout)
    backup = Backup()
    run = {"old": lambda: _old_path(raw, grads, tail),
           "new": lambda: _new_path(group, layout, grads, tail, None),
           "backup": lambda: _new_path(group, layout, grads, tail, backup),
           "native": lambda: _native_path(raw, grads)}
    for r in range(args.rounds + 1):  # round 0 warms up (connections, first-touch of the buffers)
        order = PATHS[r % len(PATHS):] + PATHS[: r % len(PATHS)]
        for path in order:
            for g in grads:
                g.fill_(float(replica + 1))
            barrier.barrier().wait()
            start = time.perf_counter()
            run[path]()
            elapsed = time.perf_counter() - start
            expected = args.replicas * (args.replicas + 1) / 2
            if not all(bool((g == expected).all()) for g in grads):
                raise RuntimeError(f"{path}: wrong sum")
            if r > 0:
                results.put((r, path, replica, position, elapsed))
    barrier.barrier().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mb", type=float, default=1024, help="gradient of one replica, MiB (all shards)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16, help="gradient tensors per rank (FSDP modules)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-mb", type=float, default=64)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        return measure(args)


def measure(args) -> int:
    """Run the measurement; print its lines and the headline."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(store.port, r, p, args, results))
             for r in range(args.replicas) for p in range(args.shards)]
    for proc in procs:
        proc.start()
    expected = args.rounds * len(PATHS) * len(procs)
    got = [results.get(timeout=1800) for _ in range(expected)]
    for proc in procs:
        proc.join(60)
    slowest: dict[tuple[int, str], float] = {}
    for r, path, _, _, elapsed in got:
        slowest[r, path] = max(slowest.get((r, path), 0.0), elapsed)
    times = {path: [slowest[r, path] for r in range(1, args.rounds + 1)] for path in PATHS}
    per_rank_mb = args.total_mb / args.shards
    print(f"{args.replicas} replicas x {args.shards} shard positions, {args.total_mb:.0f} MiB of float32 gradient "
          f"a replica ({per_rank_mb:.0f} MiB a rank in {args.layers} tensors), {args.rounds} interleaved rounds; "
          f"time of the slowest rank, seconds")
    print(f"{'path':10s} {'median':>8s} {'min':>8s} {'max':>8s}   {'vs native: median':>17s} {'min':>6s} {'max':>6s}"
          f"   per round")
    for path in PATHS:
        t = times[path]
        ratios = [x / n for x, n in zip(t, times["native"])]
        print(f"{path:10s} {statistics.median(t):8.3f} {min(t):8.3f} {max(t):8.3f}   {statistics.median(ratios):17.3f} "
              f"{min(ratios):6.3f} {max(ratios):6.3f}   " + " ".join(f"{x:.3f}" for x in t))
    median = {path: statistics.median(times[path]) for path in PATHS}
    native = median["native"]
    print(f"new_vs_native={median['new'] / native:.3f} old_vs_native={median['old'] / native:.3f} "
          f"backup_vs_native={median['backup'] / native:.3f} new_s={median['new']:.3f} "
          f"backup_s={median['backup']:.3f} old_s={median['old']:.3f} native_s={native:.3f} "
          f"rank_mb={per_rank_mb:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
