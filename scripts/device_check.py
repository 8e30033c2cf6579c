#!/usr/bin/env python3
"""The project's GPU-side components on one GPU, with plain torch (2.11 or later; no TorchTitan, no package index):
figures a CPU machine cannot give, written as JSON (docs/platform.md records them with the date).

Sections (each one's failure is recorded in the JSON and does not stop the others):

- ``staging``: host <-> device bandwidth through pinned vs pageable host memory (the staging rings use pinned);
- ``ftpg_gloo``: the fault-tolerant group's ``gloo`` backend with CUDA tensors (pinned ring, copy stream) among
  ``--members`` processes sharing the GPU: the sum is right, its time against the plain path (``.cpu()``, one gloo
  all-reduce, copy back) and against gloo's own path for CUDA tensors (``direct``: the tensor handed to gloo where it
  lies), and a member SIGKILLed mid-reduction releases the survivors with ``FaultDetected``;
- ``ftpg_nccl``: the ``nccl`` backend's communicator (non-blocking config, eager connect, pieces, abort) as a group
  of one (NCCL refuses several ranks on one GPU), in a subprocess with a deadline; then a piece held back on the
  device (the issuing stream busy with a spin kernel, as a peer that never arrives holds it) released by the
  epoch's fault flag and, apart, by the progress deadline, each aborting the communicator before the spin ends; then
  a new epoch's communicator;
- ``signature``: the parameter signature of CUDA tensors equals that of the same bytes on the host, and a flipped
  sign, exponent or mantissa bit changes it; its time for ``--mb`` MiB;
- ``snapshot_overlap``: a snapshot-sized device -> pinned-host copy on the snapshots' side stream while a matmul
  loop runs, against the loop alone and the copy on the compute stream;
- ``overlap_events``: the reduction overlapped with the backward (``invariant/overlap.py``) reads each gradient
  part on its own thread after the event its hook recorded on the producing stream (FSDP2's reduce-scatter
  stream): parts written on a side stream behind a matmul chain are read final, and the same parts reported from
  the default stream instead (the control: an event on a stream that never waited for the producer) are counted
  stale or not;
- ``stop_agreement``: the per-step stop flag of a job without replica groups (``recover/stop_request.py``) over
  200 steps with a stand-in all-reduce: the answer arrives ``lag`` steps after the request, the host's time per
  step, and that no step allocates (the same ``lag + 1`` flags and pinned host copies reused; device memory
  allocated before and after);
- ``device_timing``: a matmul loop timed on the host clock with and without the wait the project's speed
  measurements put around device work (``titan_recover.platform.synchronize``).

    python scripts/device_check.py [--out device_check.json] [--mb 256] [--members 3]
    python scripts/device_check.py --allow-cpu --mb 16   # the sections that run without a GPU (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import platform
import queue
import signal
import statistics
import sys
import threading
import time
import traceback
from datetime import timedelta

ROOT = pathlib.Path(__file__).resolve().parents[1]
GROUP_TIMEOUT_S = 30.0
"""The fault-tolerant group's ``timeout_s`` in the gloo section: a survivor released by its deadline waits this long."""
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


# ---- staging bandwidth ------------------------------------------------------------------------------------------
def staging(device: torch.device, mb: int, reps: int = 5) -> dict:
    n = mb * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    out = {}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        d2h = _timed(lambda: host.copy_(src, non_blocking=pinned), device, reps)
        h2d = _timed(lambda: src.copy_(host, non_blocking=pinned), device, reps)
        out[f"{kind}_d2h_gb_s"] = round(n / statistics.median(d2h) / 1e9, 2)
        out[f"{kind}_h2d_gb_s"] = round(n / statistics.median(h2d) / 1e9, 2)
    out["mb"] = mb
    return out


# ---- the gloo backend with CUDA tensors among processes sharing the GPU ------------------------------------------
def _plain_allreduce(pg, t: torch.Tensor) -> None:
    from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

    host = t.cpu()
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    pg.allreduce([host], opts).wait()
    t.copy_(host)


def _direct_allreduce(pg, t: torch.Tensor) -> None:
    """gloo's own path for the tensor where it lies (for a CUDA tensor, gloo's CUDA algorithm: its own staging)."""
    from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    pg.allreduce([t], opts).wait()


def _gloo_member(port: int, replica: int, members: tuple, device_name: str, mb: int, reps: int, results) -> None:
    from torch.distributed import PrefixStore, TCPStore
    from torch._C._distributed_c10d import ProcessGroupGloo

    from titan_recover.recover.ftpg.base import build_group, FaultDetected, FTPGConfig

    try:
        device = torch.device(device_name)
        store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=120))
        config = FTPGConfig(backend="gloo", chunk_mb=min(64, max(1, mb // 8)))
        victim = replica == max(members)
        dying = threading.Event()

        def on_poll():  # the victim dies while it waits inside the reduction (its peers start 0.2 s late)
            if dying.is_set():
                os.kill(os.getpid(), signal.SIGKILL)

        group = build_group(config, store, epoch=0, members=members, replica=replica, rank=0,
                            timeout_s=GROUP_TIMEOUT_S, device=device, on_poll=on_poll)
        plain = ProcessGroupGloo(PrefixStore("plain", store), replica, len(members), timedelta(seconds=120))
        n = mb * 2**20 // 4
        t = torch.empty(n, device=device)
        staged, raw, direct = [], [], []
        expected = len(members) * (len(members) + 1) / 2
        correct = True
        for _ in range(reps):
            for times, reduce in ((staged, group.allreduce_sum_), (raw, lambda x: _plain_allreduce(plain, x)),
                                  (direct, lambda x: _direct_allreduce(plain, x))):
                t.fill_(float(replica + 1))
                times += _timed(lambda: reduce(t), device, 1)
                correct = correct and bool((t == expected).all())
        results.put(("round", replica, {"staged_s": staged, "plain_s": raw, "direct_s": direct, "correct": correct}))
        store.add("kill_round", 1)
        while int(store.add("kill_round", 0)) < len(members):
            time.sleep(0.01)
        if victim:
            dying.set()
        else:
            time.sleep(0.2)
        t.fill_(1.0)
        start = time.monotonic()
        try:
            group.allreduce_sum_(t)
            results.put(("kill", replica, {"outcome": "completed", "s": time.monotonic() - start}))
        except FaultDetected as fault:
            results.put(("kill", replica, {"outcome": "fault", "s": time.monotonic() - start,
                                           "reason": fault.reason[:200]}))
    except Exception:
        results.put(("error", replica, traceback.format_exc()[-2000:]))


def ftpg_gloo(device: torch.device, mb: int, members: int, reps: int = 3) -> dict:
    from torch.distributed import TCPStore

    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    group = tuple(range(members))
    procs = [ctx.Process(target=_gloo_member, args=(store.port, r, group, str(device), mb, reps, results))
             for r in group]
    for p in procs:
        p.start()
    got: dict = {"round": {}, "kill": {}, "error": {}}
    deadline = time.monotonic() + 150  # the whole section's, so that one hung member cannot take the script's time
    try:
        for _ in range(2 * members - 1):
            try:
                kind, replica, value = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                missing = 2 * members - 1 - sum(map(len, got.values()))
                got["error"]["section"] = f"{missing} result(s) missing after 150 s"
                break
            got[kind][replica] = value
            if kind == "error":
                break
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    rounds = got["round"].values()
    staged = statistics.median(x for r in rounds for x in r["staged_s"]) if rounds else None
    plain = statistics.median(x for r in rounds for x in r["plain_s"]) if rounds else None
    direct = statistics.median(x for r in rounds for x in r["direct_s"]) if rounds else None
    survivors = [v for r, v in got["kill"].items() if r != members - 1]
    return {
        "members": members, "mb": mb, "correct": all(r["correct"] for r in rounds) and len(rounds) == members,
        "staged_s": staged, "plain_s": plain, "staged_vs_plain": staged / plain if staged and plain else None,
        "direct_s": direct, "staged_vs_direct": staged / direct if staged and direct else None,
        "kill_survivors_released": len(survivors) == members - 1 and all(v["outcome"] == "fault" for v in survivors),
        "kill_release_s": max((v["s"] for v in survivors), default=None), "kill": got["kill"],
        "timeout_s": GROUP_TIMEOUT_S,
        "errors": got["error"],
    }


# ---- the nccl backend's communicator ----------------------------------------------------------------------------
def _spin_cycles_per_s(device: torch.device) -> float:
    """The rate of ``torch.cuda._sleep``'s cycles (a kernel that spins on the SM clock), measured."""
    torch.cuda._sleep(10**6)  # loaded and warm
    cycles = 2 * 10**8
    times = _timed(lambda: torch.cuda._sleep(cycles), device, 3)
    return cycles / statistics.median(times)


def _held(device: torch.device, store, epoch: int, mb: int, timeout_s: float, hold_s: float,
          flag_after_s: float | None) -> dict:
    """One all-reduce whose piece NCCL cannot start: the issuing stream runs a spin kernel for ``hold_s`` first (a
    peer that never arrives, as a group of one can show it). With ``flag_after_s`` the epoch's fault flag is raised
    that long after the issue; without, the progress deadline (``timeout_s``) ends it. Either must raise
    ``FaultDetected`` and abort the communicator without waiting for the spin to end."""
    from titan_recover.recover.ftpg.base import build_group, FaultDetected, FTPGConfig
    from titan_recover.recover.groups.keys import raise_fault_flag

    group = build_group(FTPGConfig(backend="nccl", chunk_mb=max(1, mb // 4)), store, epoch=epoch, members=(0,),
                        replica=0, rank=0, timeout_s=timeout_s, device=device)
    t = torch.ones(mb * 2**20 // 4, device=device)
    group.allreduce_sum_(t)  # connected outside the measured part
    _sync(device)
    torch.cuda._sleep(int(hold_s * _spin_cycles_per_s(device)))
    if flag_after_s is not None:
        threading.Timer(flag_after_s, raise_fault_flag, (store, epoch, "raised by the device check")).start()
    start = time.perf_counter()
    outcome = "completed"
    try:
        group.allreduce_sum_(t)
    except FaultDetected as fault:
        outcome = f"fault: {fault.reason[:160]}"
    released = time.perf_counter() - start
    _sync(device)  # the spin ends; nothing of the aborted communicator may hold the stream beyond it
    return {"outcome": outcome, "released_s": round(released, 3), "stream_free_s": round(time.perf_counter() - start, 3),
            "hold_s": hold_s, "timeout_s": timeout_s, "flag_after_s": flag_after_s, "failed": group.failed,
            "communicator_let_go": group.pg is None}


def _nccl_alone(device_name: str, mb: int, results) -> None:
    from torch.distributed import HashStore

    from titan_recover.recover.ftpg.base import build_group, FTPGConfig

    try:
        device = torch.device(device_name)
        torch.cuda.set_device(device)
        store = HashStore()
        start = time.perf_counter()
        group = build_group(FTPGConfig(backend="nccl", chunk_mb=max(1, mb // 4)), store, epoch=0,
                            members=(0,), replica=0, rank=0, timeout_s=30.0, device=device)
        created = time.perf_counter() - start
        t = torch.arange(mb * 2**20 // 4, dtype=torch.float32, device=device)
        before = t.clone()
        times = _timed(lambda: group.allreduce_sum_(t), device, 3)
        unchanged = bool(torch.equal(t, before))  # a group of one sums to itself
        start = time.perf_counter()
        group.close()
        results.put(("basic", {"created_s": created, "allreduce_s": statistics.median(times),
                               "sum_correct": unchanged, "close_abort_s": time.perf_counter() - start,
                               "nccl": ".".join(map(str, torch.cuda.nccl.version()))}))
        results.put(("flag", _held(device, store, 1, mb, timeout_s=30.0, hold_s=6.0, flag_after_s=0.5)))
        results.put(("deadline", _held(device, store, 2, mb, timeout_s=1.0, hold_s=4.0, flag_after_s=None)))
        # the next epoch's communicator works after two aborted ones
        group = build_group(FTPGConfig(backend="nccl"), store, epoch=3, members=(0,), replica=0, rank=0,
                            timeout_s=30.0, device=device)
        t.fill_(2.0)
        group.allreduce_sum_(t)
        _sync(device)
        results.put(("next_epoch", {"sum_correct": bool((t == 2.0).all()),
                                    "device_mb_allocated": torch.cuda.memory_allocated(device) / 2**20}))
    except Exception:
        results.put(("error", traceback.format_exc()[-2000:]))
    results.put(("done", None))


def _nccl_phases(device_name: str, mb: int, monitoring: str, results) -> None:
    """Where a held piece's release spends its time: issuing it, querying it, noticing the flag, ``abort()``, and the
    stream's wait after; and an idle communicator's ``abort()`` and destruction. ``monitoring``: the value of
    ``TORCH_NCCL_ENABLE_MONITORING`` (the launcher sets 0 in replica-group processes)."""
    os.environ["TORCH_NCCL_ENABLE_MONITORING"] = monitoring
    from torch.distributed import HashStore

    from titan_recover.recover.ftpg.base import build_group, FTPGConfig
    from titan_recover.recover.ftpg.nccl import NcclGroup

    out: dict = {"monitoring": monitoring}
    try:
        device = torch.device(device_name)
        torch.cuda.set_device(device)
        store = HashStore()
        t = torch.ones(mb * 2**20 // 4, device=device)
        group = build_group(FTPGConfig(backend="nccl"), store, epoch=0, members=(0,), replica=0, rank=0,
                            timeout_s=30.0, device=device)
        group.allreduce_sum_(t)
        _sync(device)
        pg, group.pg = group.pg, None
        start = time.perf_counter()
        pg.abort()
        out["idle_abort_s"] = round(time.perf_counter() - start, 4)
        start = time.perf_counter()
        del pg
        out["idle_destroy_s"] = round(time.perf_counter() - start, 4)
        group = build_group(FTPGConfig(backend="nccl"), store, epoch=1, members=(0,), replica=0, rank=0,
                            timeout_s=30.0, device=device)
        group.allreduce_sum_(t)
        _sync(device)
        hold_s = 4.0
        torch.cuda._sleep(int(hold_s * _spin_cycles_per_s(device)))
        start = time.perf_counter()
        work = NcclGroup._issue(group.pg, t.view(-1), None)
        out["held_issue_s"] = round(time.perf_counter() - start, 4)
        queries, first = 0, time.perf_counter()
        while time.perf_counter() - first < 0.5 and not work.is_completed():
            queries += 1
            time.sleep(0.0005)
        out["held_queries_in_0_5_s"] = queries
        out["held_completed_by_0_5_s"] = bool(work.is_completed())
        pg, group.pg = group.pg, None
        start = time.perf_counter()
        pg.abort()
        out["held_abort_s"] = round(time.perf_counter() - start, 4)
        start = time.perf_counter()
        _sync(device)
        out["held_stream_after_abort_s"] = round(time.perf_counter() - start, 4)
        out["held_total_s"] = round(time.perf_counter() - first, 4)
        out["hold_s"] = hold_s
        del work, pg
    except Exception:
        out["error"] = traceback.format_exc()[-2000:]
    results.put(out)


def nccl_phases(device: torch.device, mb: int) -> dict:
    """:func:`_nccl_phases` with NCCL's heartbeat monitor on (torch's default) and off (the launcher's), each in a
    subprocess with a deadline."""
    ctx = mp.get_context("spawn")
    out = {}
    for monitoring in ("1", "0"):
        results = ctx.Queue()
        proc = ctx.Process(target=_nccl_phases, args=(str(device), mb, monitoring, results))
        proc.start()
        try:
            out[f"monitoring_{monitoring}"] = results.get(timeout=60)
        except queue.Empty:
            out[f"monitoring_{monitoring}"] = {"error": "no result within 60 s"}
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return out


def ftpg_nccl(device: torch.device, mb: int) -> dict:
    """The communicator as a group of one in a subprocess: created, all-reduce, close; then a piece held back on the
    device, released by the fault flag and by the progress deadline; then a new epoch's communicator."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_nccl_alone, args=(str(device), mb, results))
    proc.start()
    out: dict = {}
    deadline = time.monotonic() + 150
    try:
        while True:
            try:
                kind, value = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                out["error"] = f"no result after {sorted(out)} within 150 s (a communicator or a wait hung)"
                break
            if kind == "done":
                break
            out[kind] = value
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return out


# ---- signature and bit flips on device tensors -----------------------------------------------------------------
def signature(device: torch.device, mb: int) -> dict:
    from titan_recover.recover.scout.consensus import fingerprint

    n = mb * 2**20 // 4
    t = torch.randn(n, device=device)
    host = t.cpu()
    same = fingerprint([t]) == fingerprint([host])
    changed = {}
    for name, bit in (("sign", 31), ("exponent", 27), ("mantissa", 3)):
        flipped = t.clone()
        words = flipped.view(torch.int32)
        index = int(torch.randint(0, n, ()).item())
        words[index] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32, device=device)
        changed[name] = fingerprint([flipped]) != fingerprint([t])
    times = _timed(lambda: fingerprint([t]), device, 3)
    return {"device_equals_host": same, "flip_detected": changed, "mb": mb,
            "gb_s": round(n * 4 / statistics.median(times) / 1e9, 2)}


# ---- a snapshot's copy on the side stream against compute --------------------------------------------------------
def snapshot_overlap(device: torch.device, mb: int, iters: int = 40) -> dict:
    from titan_recover.recover.phoenix.staging import copies_for

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    state = [torch.randn(mb * 2**20 // 4, device=device)]
    copies = copies_for(state)
    host = copies.host_buffer(state[0].numel() * 4).view(torch.float32)

    def matmuls():
        for _ in range(iters):
            torch.mm(a, a)

    alone = statistics.median(_timed(matmuls, device, 3))
    copy_alone = statistics.median(_timed(lambda: copies.copy([(host, state[0])]).synchronize(), device, 3))

    def side():
        event = copies.copy([(host, state[0])])
        matmuls()
        event.synchronize()

    def same_stream():
        host.copy_(state[0])
        matmuls()

    with_side = statistics.median(_timed(side, device, 3))
    serial = statistics.median(_timed(same_stream, device, 3))
    hidden = 1.0 - max(0.0, with_side - alone) / copy_alone if copy_alone > 0 else None
    return {"matmuls_s": alone, "copy_s": copy_alone, "side_stream_s": with_side, "compute_stream_s": serial,
            "copy_hidden_fraction": hidden, "asynchronous": copies.asynchronous, "mb": mb}


# ---- the overlapped reduction's reads of parts produced on another stream -----------------------------------------
def overlap_events(device: torch.device, parts: int = 8, chain: int = 30) -> dict:
    from titan_recover.recover.invariant.overlap import OverlappedReduction

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    producer = torch.cuda.Stream(device)

    def run(with_event: bool) -> int:
        """Parts written on ``producer`` behind ``chain`` matmuls each, reported from that stream; the collective
        copies each to the host at its gate. Returns the number of parts read before their final value."""
        tensors = [torch.zeros(2**20, device=device) for _ in range(parts)]
        tail = torch.zeros(4, device=device)
        seen: list[torch.Tensor] = []

        def collective(order, before_piece):
            for index, t in enumerate(order):
                before_piece(index, 0, t.view(-1))
                seen.append(t.to("cpu"))  # on this thread's stream, which waited for the part's event
        reduction = OverlappedReduction(tensors, tail, collective, epoch=0).start()
        torch.cuda.synchronize(device)
        for index in reversed(range(parts)):
            with torch.cuda.stream(producer):
                for _ in range(chain):
                    torch.mm(a, a)
                tensors[index].fill_(index + 1.0)
                if with_event:  # as FSDP2 calls the hook: inside the stream that produced the gradient
                    reduction.part_ready(index)
            if not with_event:  # the control: reported from the default stream, which never waited for producer
                reduction.part_ready(index)
        reduction.release()
        reduction.tail_ready()
        reduction.join()
        torch.cuda.synchronize(device)
        return sum(1 for i, t in enumerate(seen[:parts]) if not bool((t == parts - i).all()))

    return {"stale_with_event": run(True), "stale_event_on_default_stream_control": run(False), "parts": parts,
            "matmuls_per_part": chain}


def stop_agreement(device: torch.device, steps: int = 200, requested_at: int = 50) -> dict:
    from titan_recover.recover.stop_request import StopAgreement

    class Done:
        def wait(self) -> None:
            pass

    agreement = StopAgreement(device, all_reduce_max=lambda flag: Done(), lag=2)
    answers, times = [], []
    _sync(device)
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    agreement.poll(False)  # the ring is allocated at the first poll
    allocated_after_first = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for step in range(1, steps):
        start = time.perf_counter()
        answers.append(agreement.poll(step >= requested_at))
        times.append(time.perf_counter() - start)
    _sync(device)
    return {"steps": steps, "first_true_at": answers.index(True) + 1 if True in answers else None,
            "requested_at": requested_at, "lag": agreement.lag,
            "per_poll_us_median": round(statistics.median(times) * 1e6, 1),
            "per_poll_us_max": round(max(times) * 1e6, 1),
            "buffers": agreement.host_buffers,
            "device_bytes_ring": allocated_after_first - allocated,
            "device_bytes_after_steps": (torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)
            - allocated_after_first}


def device_timing(device: torch.device, iters: int = 40, reps: int = 5) -> dict:
    """What a host clock reads around device work with and without ``titan_recover.platform.synchronize`` (the
    wait the quota's speeds, the straggler detector and chaos ``slow`` put around what they time): without it, the
    time to launch the kernels."""
    from titan_recover.platform import synchronize

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def work():
        for _ in range(iters):
            torch.mm(a, a)

    work()
    synchronize(device)
    unwaited, waited = [], []
    for _ in range(reps):
        start = time.perf_counter()
        work()
        unwaited.append(time.perf_counter() - start)
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        waited.append(time.perf_counter() - start)
    return {"without_wait_s": statistics.median(unwaited), "with_wait_s": statistics.median(waited),
            "tflop_s_with_wait": round(iters * 2 * 4096**3 / statistics.median(waited) / 1e12, 1),
            "matmuls": iters}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "device_check.json"))
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--allow-cpu", action="store_true", help="no GPU: run what runs on CPU tensors")
    parser.add_argument("--sections", help="comma-separated names of the sections to run (default: all)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("device_check: no CUDA device visible (pass --allow-cpu for the sections that run without one)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                    "python": platform.python_version(), "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    sections = {"staging": lambda: staging(device, args.mb),
                "ftpg_gloo": lambda: ftpg_gloo(device, args.mb, args.members),
                "ftpg_nccl": lambda: ftpg_nccl(device, args.mb),
                "nccl_phases": lambda: nccl_phases(device, args.mb),
                "signature": lambda: signature(device, args.mb),
                "snapshot_overlap": lambda: snapshot_overlap(device, args.mb),
                "overlap_events": lambda: overlap_events(device),
                "stop_agreement": lambda: stop_agreement(device),
                "device_timing": lambda: device_timing(device)}
    chosen = args.sections.split(",") if args.sections else list(sections)
    unknown = sorted(set(chosen) - set(sections))
    if unknown:
        parser.error(f"--sections: no section {unknown}; the sections are {', '.join(sections)}")
    needs_cuda = {"staging", "ftpg_nccl", "nccl_phases", "snapshot_overlap", "overlap_events", "device_timing"}
    for name in chosen:
        if not cuda and name in needs_cuda:
            report[name] = {"skipped": "no CUDA device"}
        else:
            start = time.perf_counter()
            try:
                report[name] = sections[name]()
            except Exception:
                report[name] = {"error": traceback.format_exc()[-2000:]}
            report[name]["section_s"] = round(time.perf_counter() - start, 2)
            print(f"{name}: {json.dumps(report[name], default=str)[:600]}", flush=True)
        # after every section: a run ended by the machine's time limit keeps the figures of the sections done
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
