"""What the ranks of one process group hold, in one all-reduce: the lowest and the highest of each value.

Equal extremes mean every rank holds the same value; used where ranks must take one decision together (a diloco
learner's ranks on the global versions to adopt, the ranks of a job on the snapshot to restore).
"""

from __future__ import annotations

import torch


def extremes(values: list[int], device: torch.device | str, group=None) -> tuple[list[int], list[int]]:
    """(lowest, highest) of each of ``values`` over the ranks of ``group`` (default: the job's): one all-reduce
    (MAX) of the values and their negations, on ``device`` (the group's backend must take it), read back once."""
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
    read = both.tolist()
    return [-v for v in read[len(values):]], read[: len(values)]
