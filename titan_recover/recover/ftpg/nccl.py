"""The ``nccl`` backend of the fault-tolerant group: a NCCL communicator per (membership epoch, rank), on the device.

Tensors never leave the device. Each epoch's group creates its own communicator from the epoch's store prefix
(``ProcessGroupNCCL`` with ``config.blocking = False``: a non-blocking communicator, whose abort returns even while
a kernel waits on a dead peer), connected eagerly on the device. A collective is issued in pieces, all at once
(NCCL queues them on its stream in order), and the caller's thread polls each piece's completion
(``work.is_completed()``, a query of its CUDA event) together with the epoch's fault flag and the progress
deadline (:mod:`.polled`). On a fault the communicator is aborted (``ncclCommAbort``), which releases the kernels
still waiting, and the group is never used again: the next epoch creates a new communicator. NCCL's own watchdog
gets a per-piece timeout well behind the progress deadline, so it never fires first.

Why this and not ``torch.distributed.shrink_group`` or a communicator in a subprocess (torchft's
``ProcessGroupBabyNCCL``): docs/replica_groups.md, "Backends". Not yet run on a GPU (docs/platform.md).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, Store
from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions, ReduceOp

from titan_recover.recover.ftpg.base import register_backend
from titan_recover.recover.ftpg.polled import check_contiguous, pieces_of, PolledGroup, Progress
from titan_recover.recover.groups.keys import GroupKeys

_QUERY_S = 0.0005
"""How often a waiting thread queries a piece's CUDA event (a query is cheap; a NCCL piece has no future to sleep
on that completes on the host)."""


@register_backend("nccl")
class NcclGroup(PolledGroup):
    """The NCCL communicator of one rank of each of one epoch's member replicas, on this rank's device."""

    def __init__(self, store, **kwargs):
        super().__init__(store, **kwargs)
        if self.device.type != "cuda":
            raise ValueError(f"[recover.ftpg] backend = \"nccl\" needs CUDA tensors; this rank's device is "
                             f"{self.device} (use backend = \"auto\" or \"gloo\")")
        prefix = PrefixStore(GroupKeys.group_prefix(self.epoch, self.rank, self.tag), store)
        self.pg = self._connect(prefix, self.group_rank, len(self.members))

    def _connect(self, store: Store, group_rank: int, size: int):
        """A new non-blocking communicator of this epoch (tests replace it with a fake)."""
        from torch.distributed import ProcessGroupNCCL

        # the time NCCL allows a non-blocking init or abort before giving up (torchft sets it the same way)
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(max(self.timeout_s, 1))))
        options = ProcessGroupNCCL.Options()
        options.config.blocking = False
        options._timeout = timedelta(seconds=self._watchdog_s(0))
        pg = ProcessGroupNCCL(store, group_rank, size, options)
        pg.eager_connect_single_device(self.device)
        return pg

    def _watchdog_s(self, index: int) -> float:
        """NCCL's own timeout of piece ``index``: behind the progress deadline of every piece before it."""
        return self.timeout_s * (index + 2) + 60.0

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        self.allreduce_many_([tensor])

    def allreduce_many_(self, tensors: list[torch.Tensor], before_piece=None) -> None:
        self._check_device(tensors)
        self._guarded("allreduce", lambda: self._collective("allreduce", tensors, root=None,
                                                            before_piece=before_piece))

    def broadcast_many_(self, tensors: list[torch.Tensor], root_replica: int, on_each=None) -> None:
        self._check_device(tensors)
        root = self.members.index(root_replica)
        self._guarded("broadcast", lambda: self._collective("broadcast", tensors, root=root, on_each=on_each))

    def _check_device(self, tensors: list[torch.Tensor]) -> None:
        """A caller's mistake, not a fault of the epoch: raised before anything is issued."""
        check_contiguous(tensors)
        off = [str(t.device) for t in tensors if t.device != self.device]
        if off:
            raise ValueError(f"the nccl group of {self.device} was given tensors on {sorted(set(off))}")

    def _collective(self, name: str, tensors: list[torch.Tensor], root: int | None, on_each=None,
                    before_piece=None) -> None:
        pieces = pieces_of(tensors, self.config.chunk_bytes)
        works = []
        for i, piece in enumerate(pieces):
            if before_piece is not None:  # queued on the caller's stream, which NCCL's stream waits for
                before_piece(*piece)
            works.append(self._issue(i, piece[2], root))
        progress = Progress(self.timeout_s)
        last = {index: i for i, (index, _, _) in enumerate(pieces)}
        reported = 0
        for i, work in enumerate(works):
            self._wait(name, work, progress)
            index = pieces[i][0]
            if on_each is not None and last[index] == i:
                while reported <= index:
                    on_each(reported)
                    reported += 1
        if on_each is not None:
            for index in range(reported, len(tensors)):
                on_each(index)

    def _issue(self, i: int, view: torch.Tensor, root: int | None):
        if root is None:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            opts.timeout = timedelta(seconds=self._watchdog_s(i))
            return self.pg.allreduce([view], opts)
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        opts.timeout = timedelta(seconds=self._watchdog_s(i))
        return self.pg.broadcast([view], opts)

    # ---- PolledGroup ------------------------------------------------------------------------------------------
    def _wait_for(self, work, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_QUERY_S)
        return True

    def _abort(self) -> None:
        self.pg.abort()
