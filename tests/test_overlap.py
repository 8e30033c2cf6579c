"""The reduction overlapped with the last microbatch's backward (docs/invariant.md, "Overlapping the reduction with
the last backward"): the gate that issues each part only once it is final, in one fixed order; the backup taken
piece by piece in that order; two real gloo members (threads of this process) whose parts become final in
different orders and over longer than the progress deadline. A fault during an overlapped reduction:
tests/test_ftpg.py (the fake NCCL communicator, whose pieces never complete)."""

from __future__ import annotations

import random
import time
from contextlib import nullcontext

import pytest
import torch
from torch.distributed import HashStore

from titan_recover.recover.ftpg.base import FTPGConfig
from titan_recover.recover.ftpg.gloo import PolledGlooGroup
from titan_recover.recover.invariant.overlap import Abandoned, OverlappedReduction
from titan_recover.recover.invariant.reduction import Backup
from two_members import run_both


class Recording:
    """A collective that issues each tensor whole and records the order and what it read at the issue."""

    def __init__(self):
        self.issued: list[tuple[int, torch.Tensor]] = []

    def __call__(self, tensors, before_piece):
        for index, tensor in enumerate(tensors):
            before_piece(index, 0, tensor.view(-1))
            self.issued.append((index, tensor.clone()))


def _finish_in(order, parts, reduction, pause_s=0.002):
    """A backward: give each part its final value (part index + 1) in ``order``, reporting it."""
    for index in order:
        parts[index].fill_(index + 1.0)
        reduction.part_ready(index)
        time.sleep(pause_s)


def test_parts_are_issued_in_one_fixed_order_and_only_once_final():
    parts = [torch.zeros(3) for _ in range(6)]
    tail = torch.zeros(2)
    collective = Recording()
    reduction = OverlappedReduction(parts, tail, collective, epoch=0).start()
    order = list(range(6))
    random.Random(3).shuffle(order)
    _finish_in(order, parts, reduction)
    reduction.release()
    tail.fill_(9.0)
    reduction.tail_ready()
    reduction.join()
    # the parts reversed, then the tail, whatever order the backward finished them in
    assert [i for i, _ in collective.issued] == list(range(7))
    assert reduction.order[:6] == list(reversed(parts)) and reduction.order[6] is tail
    for position, (_, seen) in enumerate(collective.issued[:6]):
        assert torch.equal(seen, torch.full((3,), 6.0 - position)), "a part was issued before it was final"
    assert torch.equal(collective.issued[6][1], torch.full((2,), 9.0))


def test_release_issues_parts_whose_hook_never_fired():
    parts = [torch.ones(2), torch.ones(2)]
    collective = Recording()
    reduction = OverlappedReduction(parts, torch.zeros(1), collective, epoch=0).start()
    reduction.part_ready(1)  # part 0's parameter got no gradient in this backward
    time.sleep(0.05)
    assert len(collective.issued) == 1
    reduction.release()
    reduction.tail_ready()
    reduction.join()
    assert len(collective.issued) == 3


def test_a_failed_computation_abandons_the_collective_with_a_reason():
    reduction = OverlappedReduction([torch.zeros(2)], torch.zeros(1), Recording(), epoch=0).start()
    reduction.abandon("RuntimeError: out of memory")
    with pytest.raises(Abandoned, match="out of memory"):
        reduction.join()


def test_the_collectives_thread_takes_its_streams_device_before_it_enters_the_stream(monkeypatch):
    """A new thread's current CUDA device is 0: entering and leaving a stream context there would create a CUDA
    context on GPU 0 in a rank that trains on another GPU. ``SideStream.running`` (entered on the collective's
    thread) makes the stream's device the thread's own first. Stand-ins record the calls (no GPU here)."""
    import threading

    from titan_recover.recover.invariant import overlap

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device,
                                                                              threading.current_thread().name)))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: calls.append(("stream", stream)) or nullcontext())
    side = overlap.SideStream.__new__(overlap.SideStream)
    side.stream = type("Stream", (), {"device": torch.device("cuda", 3)})()
    thread = threading.Thread(target=lambda: side.running(), name="collective")
    thread.start()
    thread.join()
    assert calls == [("set_device", torch.device("cuda", 3), "collective"), ("stream", side.stream)]


def test_on_a_device_the_collectives_thread_queues_on_a_side_stream_the_caller_then_waits_for():
    """On a GPU the collective's thread must not queue on the default stream, the backward's (its gates' waits for
    the parts' events would hold the rest of the backward behind each part's reduce-scatter); the caller's stream
    comes after the side stream before join returns or raises (the backup's copies are read after it). A stand-in
    stream on CPU tensors records where each gate ran and when the caller waited."""
    log = []

    class Side:
        active = False

        def running(self):
            side = self

            class Running:
                def __enter__(self):
                    side.active = True

                def __exit__(self, *exc):
                    side.active = False
                    log.append("left the side stream")

            return Running()

        def caller_waits(self):
            log.append("caller waits")

    side = Side()

    def collective(tensors, before_piece):
        for index, tensor in enumerate(tensors):
            before_piece(index, 0, tensor.view(-1))
            log.append(("issued", index, side.active))

    for fail in (False, True):
        log.clear()
        reduction = OverlappedReduction([torch.zeros(2)], torch.zeros(1), collective, epoch=0, side=side).start()
        if fail:
            reduction.abandon("the backward failed")
            with pytest.raises(Abandoned):
                reduction.join()
            assert log == ["left the side stream", "caller waits"]
            continue
        reduction.release()
        reduction.tail_ready()
        reduction.join()
        assert log == [("issued", 0, True), ("issued", 1, True), "left the side stream", "caller waits"]


def test_the_backup_restores_parts_saved_in_reverse_order_and_those_never_issued():
    originals = [torch.arange(5, dtype=torch.float32) + 10 * i for i in range(4)]
    parts = [t.clone() for t in originals]
    backup = Backup()
    backup.begin(parts)
    # parts 3 and 2 issued (3 in two pieces), then the collective abandoned: it wrote partial sums into them
    backup.save(3, 0, parts[3].view(-1)[:2])
    backup.save(3, 2, parts[3].view(-1)[2:])
    backup.save(2, 0, parts[2].view(-1))
    parts[3].add_(1000.0)
    parts[2].add_(1000.0)
    restored = backup.restored(parts)
    assert all(torch.equal(r, o) for r, o in zip(restored, originals))
    assert all(r.data_ptr() != p.data_ptr() for r, p in zip(restored, parts))


def _gloo_members(store, timeout_s):
    config = FTPGConfig(chunk_mb=1)
    return [PolledGlooGroup(store, config=config, epoch=0, members=(0, 1), replica=r, rank=0, timeout_s=timeout_s)
            for r in (0, 1)]


SIZES = (300_000, 7, 40_000, 1)


def _run_member(group, values, order, hold_s, backup=None, parts=None):
    """One member's last backward: its parts become final in ``order``, ``hold_s`` apart, while the reduction
    runs; returns the parts and tail after the reduction (or raises what the reduction raised)."""
    parts = parts if parts is not None else [torch.zeros(n) for n in SIZES]
    tail = torch.zeros(3)
    reduction = OverlappedReduction(parts, tail, group.allreduce_many_, epoch=0, backup=backup).start()
    for index in order:
        parts[index].fill_(values[index])
        reduction.part_ready(index)
        time.sleep(hold_s)
    reduction.release()
    tail.fill_(1.0)
    reduction.tail_ready()
    reduction.join()
    return parts, tail


def test_gloo_members_finishing_parts_in_different_orders_reduce_the_same_sums(monkeypatch):
    """The members' backwards finish the parts in different orders and take 4 x 0.3 s, longer than the 0.5 s
    progress deadline: the time a part is held back is not the collective's, and the sums are right."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    members = _gloo_members(HashStore(), timeout_s=0.5)
    values = {0: [1.0, 2.0, 3.0, 4.0], 1: [10.0, 20.0, 30.0, 40.0]}
    results, _ = run_both(lambda: _run_member(members[0], values[0], [3, 2, 1, 0], 0.3),
                          lambda: _run_member(members[1], values[1], [0, 2, 3, 1], 0.3), timeout_s=60)
    for r in (0, 1):
        assert not isinstance(results[r], Exception), results[r]
        parts, tail = results[r]
        assert [float(p[0]) for p in parts] == [11.0, 22.0, 33.0, 44.0]
        assert all(bool((p == p[0]).all()) for p in parts)
        assert torch.equal(tail, torch.full((3,), 2.0))


def test_a_part_reported_final_twice_in_one_backward_is_an_error_naming_the_setting():
    parts = [torch.zeros(2), torch.zeros(2)]
    reduction = OverlappedReduction(parts, torch.zeros(1), Recording(), epoch=0).start()
    reduction.part_ready(1)
    reduction.part_ready(0)
    reduction.part_ready(1)  # accumulated again after it may have been issued
    reduction.release()
    with pytest.raises(RuntimeError, match=r"parameter\(s\) \[1\].*overlap_reduction = false"):
        reduction.check()
    reduction.abandon("the check failed")
    with pytest.raises(Abandoned):
        reduction.join()


def test_autograd_reports_each_parameter_once_after_its_last_accumulation():
    """The premise of the worker's hooks (torch's post-accumulate-grad hook): each parameter is reported once per
    backward, when its gradient already holds the whole backward's contribution, also for a module used twice in
    the forward (its gradients are added before the one accumulation)."""
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    head = torch.nn.Linear(4, 1)
    params = [*shared.parameters(), *head.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    seen: dict[int, torch.Tensor] = {}
    reported: list[int] = []
    for index, p in enumerate(params):
        def final(param, index=index):
            reported.append(index)
            seen[index] = param.grad.clone()
        p.register_post_accumulate_grad_hook(final)
    x = torch.randn(3, 4)
    head(shared(shared(x))).sum().backward()  # ``shared`` used twice
    assert sorted(reported) == [0, 1, 2, 3]
    assert all(torch.equal(seen[i], p.grad) for i, p in enumerate(params))


def _worker(exact: bool = False, pp: bool = False, reports_final: bool = True):
    """The project's worker on a two-layer model (TorchTitan's parts faked as tests/test_device_timing.py does)."""
    from types import SimpleNamespace

    from titan_recover.recover.modes.replica_worker import ReplicaWorker

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))

    def forward_backward(input_dict, labels, global_valid_tokens):
        loss = (model(input_dict["input"]).squeeze(-1) - labels).pow(2).sum() / global_valid_tokens
        loss.backward()
        return loss

    def microbatch(g, shard_rank, shard_degree, batch_size):
        return {"input": torch.full((batch_size, 4), float(g + 1))}, torch.zeros(batch_size)

    parts = SimpleNamespace(
        config=SimpleNamespace(training=SimpleNamespace(local_batch_size=2, seq_len=4)), model_parts=[model],
        device=torch.device("cpu"), pp_microbatches=1, pp_has_last_stage=True,
        parallel_dims=SimpleNamespace(pp_enabled=pp), batch_layout=lambda: (1, 0),
        dataloader=SimpleNamespace(microbatch=microbatch), forward_backward=forward_backward,
        metrics_processor=SimpleNamespace(record_batch=lambda *_: None))
    return ReplicaWorker(parts, per_step=4, exact=exact, reports_final=reports_final), model


def test_the_worker_reports_each_gradient_final_in_the_last_backward_and_reduces_it_where_it_lies():
    worker, model = _worker()
    worker.begin_step(1)
    worker.compute(0)  # an earlier microbatch: accumulated locally, nothing reported
    parts = worker.gradient_parts()
    assert [p.data_ptr() for p in parts] == [p.grad.data_ptr() for p in model.parameters()]
    reported: dict[int, torch.Tensor] = {}
    worker.compute(1, on_final=lambda i: reported.setdefault(i, parts[i].clone()))
    assert sorted(reported) == [0, 1, 2, 3]  # every parameter once, in the last backward
    # what was reported is the final accumulation (both microbatches), still in the parameters' own gradients
    assert all(torch.equal(reported[i], p.grad) for i, p in enumerate(model.parameters()))
    gradient, _, _ = worker.contribution()
    assert [g.data_ptr() for g in gradient] == [p.data_ptr() for p in parts]


def test_the_first_microbatch_as_the_last_accumulates_into_gradients_made_for_it():
    worker, model = _worker()
    worker.begin_step(1)
    for p in model.parameters():
        p.grad = None  # as TorchTitan's zero_grad(set_to_none=True) leaves them
    parts = worker.gradient_parts()
    assert all(bool((p == 0).all()) for p in parts)
    worker.compute(2, on_final=lambda i: None)
    assert [p.data_ptr() for p in parts] == [p.grad.data_ptr() for p in model.parameters()]
    assert any(bool((p != 0).any()) for p in parts)


def test_in_exact_mode_each_hook_moves_its_gradient_into_the_accumulator_before_reporting_it_final():
    """The last backward's hook adds the parameter's gradient to its float64 accumulator, zeroes it and reports the
    part final: each part then holds both microbatches, the same bits as the accumulation without overlap, and the
    step reduces those accumulators where they lie."""
    def accumulate(overlapped: bool):
        worker, model = _worker(exact=True)
        worker.begin_step(1)
        worker.compute(0)
        reported: dict[int, torch.Tensor] = {}
        if overlapped:
            parts = worker.gradient_parts()
            assert all(p.dtype == torch.float64 for p in parts)
            worker.compute(1, on_final=lambda i: reported.setdefault(i, parts[i].clone()))
            assert sorted(reported) == [0, 1, 2, 3]  # every part once, in the last backward
            assert all(torch.equal(reported[i], part) for i, part in enumerate(parts))  # final when reported
            assert all(not bool(p.grad.any()) for p in model.parameters())  # moved out of the gradients
        else:
            worker.compute(1)
        gradient, _, _ = worker.contribution()
        if overlapped:
            assert [g.data_ptr() for g in gradient] == [p.data_ptr() for p in parts]
        return [g.clone() for g in gradient]

    with_overlap, without = accumulate(True), accumulate(False)
    assert all(torch.equal(a, b) for a, b in zip(with_overlap, without))
    assert any(bool(a.any()) for a in with_overlap)


def test_an_exact_accumulation_restored_from_a_backup_is_reduced_and_written_back_by_parameter():
    """After an aborted reduction the backup's fresh tensors become the exact-mode accumulators as they are (no
    copy: on a GPU a copy would hold a second float64 accumulation at once); the next step accumulates into them,
    and the reduced parts are written into the gradients, cast once."""
    worker, model = _worker(exact=True)
    worker.begin_step(1)
    worker.compute(0)
    fresh = [g.clone() for g in worker.contribution()[0]]
    worker.replace_gradient(fresh)
    restored = worker.contribution()[0]
    assert [g.data_ptr() for g in restored] == [g.data_ptr() for g in fresh]
    worker.write_gradient([2 * g for g in restored], scale=0.5)
    assert all(torch.equal(p.grad, g.view_as(p).to(p.dtype)) for p, g in zip(model.parameters(), restored))


def test_no_overlap_where_a_hook_cannot_mean_final():
    assert _worker(pp=True)[0].gradient_parts() is None  # a stage's backward runs once per pipeline chunk


def test_a_worker_not_asked_to_report_final_gradients_hooks_nothing():
    """With ``overlap_reduction`` off (the CPU default) the backward runs without a hook per parameter."""
    worker, model = _worker(reports_final=False)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert worker.gradient_parts() is None
    hooked, _ = _worker()
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in hooked.params)
