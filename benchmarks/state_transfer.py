#!/usr/bin/env python3
"""State-transfer throughput (docs/phoenix.md): a donor streams its training state (parameters + AdamW state +
metadata; chunked, xxHash3 per chunk) to a joiner over the fault-tolerant group (gloo over loopback), against a raw
gloo broadcast of the same number of bytes in one tensor between the same two processes.

Two processes; the state is a stack of ``--layers`` square linear layers of width ``--width`` with AdamW state after
one step (about 12 bytes per parameter: fp32 weights + two fp32 moments; the defaults make 2.3 GiB, so one raw
broadcast lasts long enough on loopback to be timed stably: at 1.1 GiB and 5 rounds one run's round ratios spread
from 0.49 to 1.07, docs/benchmarks.md). ``--rounds`` interleaved rounds: each round times one transfer, one raw
broadcast, one transfer without its digests (``digest=None``: what the xxHash3 of every chunk on both sides costs) and
one with "cached digests" (:func:`cached_digest`: as many bytes hashed, of a 1 MiB buffer that stays in cache: the
digests' hashing without their reads of the state's memory) back to back, each first in turn. Each round gives a
ratio (raw / that round's transfer of each kind); printed: median, min and max of the times and the ratios, and
every round; then the CPU seconds each side used for each kind (``getrusage``, every thread of the process, gloo's
included: whether the cores were free for the digests), one thread's xxHash3 of the whole state, and the host's
memory speed: one copy of the state's bytes in a process alone and with both processes copying at once, against
the copies a loopback broadcast makes (each byte into the kernel by the donor, out of it by the joiner).

    python benchmarks/state_transfer.py [--width 2048] [--layers 48] [--rounds 11] [--chunk-mb 64] [--in-flight 2]
                                        [--device cpu] [--out FILE]

``--device cuda``: the state on the GPU (both processes on device 0), so the donor's chunks go device -> pinned
host -> gloo -> pinned host -> device through the transfer's ring (docs/phoenix.md); the raw broadcast stays a host
tensor's, the target's reference.

Last line: ``transfer_mb_s=... raw_mb_s=... transfer_ratio=... transfer_ratio_min=... transfer_ratio_max=...
unverified_ratio=... cached_ratio=... transfer_s=... raw_s=... unverified_s=... cached_s=... hash_s=... copy_alone_s=...
copy_together_s=... state_mb=...`` (throughputs from the median times; ``transfer_ratio``: the median of the rounds'
ratios, ``unverified_ratio`` and ``cached_ratio`` the same without digests and with cached ones). Target (issue
"rejoin from peers' memory"): transfer_ratio >= 0.8. Output also written to docs/results/state_transfer.txt
(benchmarks/report.py). benchmarks/rejoin.py runs this and adds the time to full strength with a spare or a restart.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import pathlib
import resource
import statistics
import sys
import time
from datetime import timedelta

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import add_out_argument, recorded  # noqa: E402

KINDS = ("transfer", "raw", "unverified", "cached")
"""What each round times: the state transfer, a raw broadcast of as many bytes, the transfer without its digests, and
the transfer with its digests' hashing but not their reads of memory (:func:`cached_digest`)."""
LABELS = {"transfer": "transfer", "raw": "raw broadcast", "unverified": "transfer without digests",
          "cached": "digests of cached bytes"}
CACHED_BYTES = 2**20
"""The buffer :func:`cached_digest` hashes over and over: small enough to stay in a core's cache."""


@functools.cache
def _cached_buffer():
    import numpy as np

    return np.ones(CACHED_BYTES, dtype=np.uint8)


def cached_digest(data) -> int:
    """The digests' work without their reads of memory: xxHash3 over a cache-resident buffer of CACHED_BYTES, as
    many bytes as ``data`` holds (both sides compute the same value, so the transfer verifies)."""
    import xxhash

    value, left = 0, data.numel()
    while left > 0:
        value ^= xxhash.xxh3_64_intdigest(_cached_buffer()[: min(left, CACHED_BYTES)])
        left -= CACHED_BYTES
    return value - (1 << 64) if value >= 1 << 63 else value


class _Step:
    """The trainer's step as the transfer carries it (TorchTitan's Stateful protocol)."""

    def __init__(self, step: int):
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": 0}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def _cpu_s() -> float:
    """User and system CPU seconds of this process so far, all threads (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _member(port: int, replica: int, args, results) -> None:
    import torch
    from torch.distributed import TCPStore

    from titan_recover.recover.ftpg.base import build_group, FTPGConfig
    from titan_recover.recover.phoenix.state_transfer import checksum, TrainingState, transfer

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    group = build_group(FTPGConfig(in_flight=args.in_flight), store, epoch=0, members=(0, 1), replica=replica, rank=0,
                        timeout_s=300.0)
    torch.manual_seed(replica)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if replica == 0:
        model(torch.randn(2, args.width, device=device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the gradients are not part of the state: free their memory
    state = TrainingState([model], [optimizer], scheduler, _Step(1 if replica == 0 else 0))
    if replica == 1:
        state.ensure_optimizer_state()
    total = sum(t.numel() * t.element_size() for t in state.tensors())
    digests = {"transfer": checksum, "unverified": None, "cached": cached_digest}
    raw = torch.zeros(total // 4, dtype=torch.float32)

    def broadcast(t):
        group.broadcast_(t, root_replica=0)

    def barrier():
        flag = torch.zeros(1)
        group.allreduce_sum_(flag)

    timings: dict[str, list[float]] = {kind: [] for kind in KINDS}
    cpu: dict[str, list[float]] = {kind: [] for kind in KINDS}  # this process's CPU seconds (every thread's)
    for r in range(args.rounds):
        for kind in KINDS[r % len(KINDS):] + KINDS[: r % len(KINDS)]:  # each kind first in turn
            barrier()
            start, used = time.perf_counter(), _cpu_s()
            if kind == "raw":
                broadcast(raw)
            else:
                transfer(state, broadcast, is_donor=replica == 0, chunk_bytes=args.chunk_mb * 2**20,
                         broadcast_many=lambda tensors, on_each: group.broadcast_many_(tensors, 0, on_each),
                         digest=digests[kind])
            barrier()
            if device.type == "cuda":  # the joiner's last host-to-device copy is done
                torch.cuda.synchronize(device)
            timings[kind].append(time.perf_counter() - start)
            cpu[kind].append(_cpu_s() - used)
    timings.update(_host_figures(state, raw, replica, barrier))
    results.put((replica, total, timings, cpu))


def _host_figures(state, raw, replica: int, barrier) -> dict[str, list[float]]:
    """What the host gives the two processes, timed on each: ``hash``, xxHash3 over every byte of the state once
    (each side's digests alone; the ring hashes host chunks, on CPU as on GPU); ``copy_alone``, one copy of the
    state's bytes between two buffers of this process while the other process waits; ``copy_together``, the same
    copy with both processes copying at once (the host's memory bandwidth shared, as in a loopback transfer)."""
    import torch

    from titan_recover.recover.phoenix.state_transfer import bytes_view, checksum

    figures: dict[str, list[float]] = {}
    start = time.perf_counter()
    for view in (bytes_view(t.cpu()) for t in state.tensors()):
        checksum(view)
    figures["hash"] = [time.perf_counter() - start]
    copy = torch.empty_like(raw)
    copy.copy_(raw)  # first touch of the pages outside the timings
    figures["copy_alone"], figures["copy_together"] = [], []
    for _ in range(3):
        for alone in (0, 1, None):  # the donor alone, the joiner alone, both at once
            barrier()
            if alone in (replica, None):
                start = time.perf_counter()
                copy.copy_(raw)
                figures["copy_alone" if alone is not None else "copy_together"].append(time.perf_counter() - start)
            barrier()
    return figures


def main(argv: list[str] | None = None) -> int:
    from titan_recover.recover.ftpg.base import FTPGConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=FTPGConfig().in_flight,
                        help="pieces of a collective in flight at once ([recover.ftpg] in_flight)")
    parser.add_argument("--device", default="cpu", help="where the state lives (cuda: both processes on one GPU, "
                        "the chunks staged through the pinned ring); the raw broadcast is of host memory")
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    with recorded(__file__, argv, args.out):
        measure(args)
    return 0


def spread(values: list[float], digits: int = 3) -> str:
    """``median [min, max]``."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def measure(args) -> None:
    """Run the two processes, print the table and the headline."""
    from torch.distributed import TCPStore

    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(store.port, r, args, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {r: (total, timings, cpu) for r, total, timings, cpu in (results.get(timeout=900) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    report(args, got)


def report(args, got: dict[int, tuple]) -> None:
    """The table and the headline, from each side's (state bytes, timings, CPU seconds)."""
    total, timings, _ = got[1]  # the joiner's clock: from before the first byte to its last check
    mb = total / 2**20
    medians = {kind: statistics.median(timings[kind]) for kind in KINDS}
    ratios = {kind: [raw / moved for raw, moved in zip(timings["raw"], timings[kind])] for kind in KINDS}
    print(f"state {mb:.1f} MB ({args.layers} x {args.width}^2 parameters + AdamW state) on {args.device}, chunks of "
          f"{args.chunk_mb} MB, {args.rounds} interleaved rounds; seconds on the joiner's clock")
    print(f"{'':26s} {'median [min, max]':26s} per round")
    rows = [(LABELS[kind], timings[kind]) for kind in KINDS]
    rows += [("ratio raw / transfer", ratios["transfer"]), ("ratio raw / no digests", ratios["unverified"]),
             ("ratio raw / cached digests", ratios["cached"])]
    for label, values in rows:
        print(f"{label:26s} {spread(values):26s} " + " ".join(f"{v:.3f}" for v in values))
    print("CPU seconds each side used (all its threads), median over the rounds, and the cores both kept busy:")
    for kind in KINDS:
        donor, joiner = (statistics.median(got[r][2][kind]) for r in (0, 1))
        print(f"  {LABELS[kind]:26s} donor {donor:.3f}  joiner {joiner:.3f}  cores busy "
              f"{(donor + joiner) / medians[kind]:.2f} of {os.cpu_count()}")
    hash_s = timings["hash"][0]
    print(f"xxHash3 of the whole state on one thread, once: {hash_s:.3f} s ({mb / hash_s:.0f} MB/s); each side hashes "
          f"every chunk as it arrives, on the cores the two processes' transfer uses; 'cached digests' hash as many "
          f"bytes of a {CACHED_BYTES // 2**20} MiB buffer that stays in cache: the same hashing, none of its reads")
    alone = statistics.median(got[0][1]["copy_alone"] + got[1][1]["copy_alone"])
    together = statistics.median(got[0][1]["copy_together"] + got[1][1]["copy_together"])
    print(f"one copy of the state's bytes in a process's memory (median of both sides, 3 each): alone {alone:.3f} s "
          f"({mb / alone:.0f} MB/s); both processes at once {together:.3f} s each ({2 * mb / together:.0f} MB/s "
          f"together, {2 * alone / together:.2f}x one alone)")
    print(f"the raw broadcast's {mb / medians['raw']:.0f} MB/s of payload is {2 * mb / medians['raw']:.0f} MB/s of "
          f"copies (the donor's into the kernel, the joiner's out of it), "
          f"{2 * mb / medians['raw'] / (2 * mb / together):.2f} of what two processes copying at once reach")
    print(f"transfer_mb_s={mb / medians['transfer']:.1f} raw_mb_s={mb / medians['raw']:.1f} "
          f"transfer_ratio={statistics.median(ratios['transfer']):.3f} "
          f"transfer_ratio_min={min(ratios['transfer']):.3f} transfer_ratio_max={max(ratios['transfer']):.3f} "
          f"unverified_ratio={statistics.median(ratios['unverified']):.3f} "
          f"cached_ratio={statistics.median(ratios['cached']):.3f} transfer_s={medians['transfer']:.3f} "
          f"raw_s={medians['raw']:.3f} unverified_s={medians['unverified']:.3f} cached_s={medians['cached']:.3f} "
          f"hash_s={hash_s:.3f} copy_alone_s={alone:.3f} copy_together_s={together:.3f} state_mb={mb:.1f}")


if __name__ == "__main__":
    sys.exit(main())
