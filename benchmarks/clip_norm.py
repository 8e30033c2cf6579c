#!/usr/bin/env python3
"""The deterministic clip norm's partial on CPU: each tensor's norm in its own dtype, the squares added in float64
(``invariant/grad_norm.py``, ``owned_square_sum``), against every element widened to float64 first (the form it
replaced), on the same gradient tensors, in interleaved rounds on one thread (a training process's share of a
2-core host).

    python benchmarks/clip_norm.py [--elements 60000000] [--tensors 30] [--rounds 7]

Last line: ``float64_s=<median> current_s=<median> ratio=<float64 / current>``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from report import add_out_argument, recorded  # noqa: E402
from titan_recover.recover.invariant.grad_norm import owned_square_sum  # noqa: E402


def widened(grads: list[torch.Tensor]) -> torch.Tensor:
    """The replaced form: every element's square summed in float64."""
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=60_000_000)
    parser.add_argument("--tensors", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        torch.set_num_threads(1)
        generator = torch.Generator().manual_seed(0)
        grads = [torch.randn(args.elements // args.tensors, generator=generator) for _ in range(args.tensors)]
        current, old = owned_square_sum(grads), widened(grads)  # warm, and the two agree
        print(f"{args.elements} float32 elements in {args.tensors} tensors, 1 thread; partials "
              f"{float(current):.9e} (current) and {float(old):.9e} (float64), relative difference "
              f"{abs(float(current) - float(old)) / float(old):.1e}")
        times: dict[str, list[float]] = {"float64": [], "current": []}
        for r in range(args.rounds):
            order = ["float64", "current"] if r % 2 == 0 else ["current", "float64"]
            for name in order:
                times[name].append(timed(lambda: widened(grads) if name == "float64" else owned_square_sum(grads)))
            print(f"round {r}: float64 {times['float64'][-1]:.4f} s, current {times['current'][-1]:.4f} s")
        median = {name: statistics.median(t) for name, t in times.items()}
        for name, t in times.items():
            print(f"{name:8s}: median {median[name]:.4f} s, min {min(t):.4f}, max {max(t):.4f}")
        print(f"float64_s={median['float64']:.4f} current_s={median['current']:.4f} "
              f"ratio={median['float64'] / median['current']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
