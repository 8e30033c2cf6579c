"""Timings that measure device work wait for the device (docs/invariant.md, "Quotas"), without processes.

A fake device runs a microbatch's kernels only when the host waits for it (``synchronize``), as a GPU runs them
after their launch: a clock read without that wait measures the launches.
"""

from __future__ import annotations

import time
import types

import pytest
import torch

from titan_recover import platform
from titan_recover.recover.config import QuotaConfig
from titan_recover.recover.invariant.step_recovery import StepRecovery

KERNEL_S = 0.1
"""Device time of one fake microbatch."""


class Device:
    """Work launched is queued; ``synchronize`` runs what is queued (sleeps) and logs the wait."""

    def __init__(self, log: list):
        self.queued_s, self.log = 0.0, log

    def launch(self, seconds: float) -> None:
        self.queued_s += seconds

    def synchronize(self) -> None:
        self.log.append("synchronize")
        time.sleep(self.queued_s)
        self.queued_s = 0.0


class AsyncWorker:
    """A step recovery worker whose microbatches return at once and run on the fake device."""

    numel = 1

    def __init__(self):
        self.log = []
        self.device = Device(self.log)

    def compute(self, g, witness=None):
        self.log.append("compute")
        self.device.launch(KERNEL_S)

    def synchronize(self):
        self.device.synchronize()

    def contribution(self):
        return torch.zeros(1), torch.zeros(()), 0.0

    def gradient_parts(self):
        return None

    def needs_backward(self):
        return False


class CommitsAtOnce:
    """A sync with one member that commits its first reduction (the buffer is its own)."""

    epoch, members, committed_epoch, committed_members = 0, (0,), 0, (0,)
    recoveries, events = [], None

    def catch_up(self, _step):
        pass

    def reduce_once(self, _step, _tensors, _attempt=1, verify=None, before_piece=None, pending=None):
        return True


def run_step(worker, microbatches: int = 4):
    manager = StepRecovery(QuotaConfig(policy="throughput"), replica=0, groups=1, per_step=microbatches,
                           sync=CommitsAtOnce(), worker=worker, dtype=torch.float64)
    return manager.run(1)


def test_the_quota_speed_counts_the_device_work_that_ends_in_synchronize():
    """The measured compute time holds the 4 microbatches' device work (it ran only in ``synchronize``), and the
    speed the quota gets is the microbatches over that same measured time: at most 1 / KERNEL_S, however long a
    busy machine stretched it. A clock read before the wait measures the launches and fails both."""
    worker = AsyncWorker()
    outcome = run_step(worker, microbatches=4)
    assert outcome.compute_s >= 4 * KERNEL_S
    assert outcome.reduced.speeds[0] == pytest.approx(4 / outcome.compute_s, rel=1e-9)
    assert outcome.reduced.speeds[0] <= 1 / KERNEL_S


def test_the_quota_waits_for_the_device_once_before_and_once_after_not_per_microbatch():
    worker = AsyncWorker()
    run_step(worker, microbatches=5)
    assert worker.log == ["synchronize"] + ["compute"] * 5 + ["synchronize"]


def fake_parts(device_queue: Device) -> types.SimpleNamespace:
    """What :class:`ReplicaWorker` reads of TorchTitan's parts: a one-layer model on CPU, one rank, no PP."""
    model = torch.nn.Linear(4, 1)
    config = types.SimpleNamespace(training=types.SimpleNamespace(local_batch_size=2, seq_len=4))

    def forward_backward(input_dict, labels, global_valid_tokens):
        loss = (model(input_dict["input"]).squeeze(-1) - labels).pow(2).sum() / global_valid_tokens
        loss.backward()
        device_queue.launch(KERNEL_S)
        return loss

    def microbatch(g, shard_rank, shard_degree, batch_size):
        return {"input": torch.full((batch_size, 4), float(g))}, torch.zeros(batch_size)

    return types.SimpleNamespace(
        config=config, model_parts=[model], device=torch.device("cpu"), pp_microbatches=1, pp_has_last_stage=True,
        parallel_dims=types.SimpleNamespace(pp_enabled=False), batch_layout=lambda: (1, 0),
        dataloader=types.SimpleNamespace(microbatch=microbatch), forward_backward=forward_backward,
        metrics_processor=types.SimpleNamespace(record_batch=lambda *_: None))


@pytest.mark.parametrize("slowed", [False, True])
def test_a_slow_fault_measures_the_microbatch_on_the_device_and_nothing_else_waits_per_microbatch(slowed):
    from titan_recover.recover.modes.replica_worker import ComputeHooks, ReplicaWorker

    log, measured = [], []
    device = Device(log)
    hooks = ComputeHooks(after=lambda _step, seconds: measured.append(seconds), timed=lambda: slowed)
    worker = ReplicaWorker(fake_parts(device), per_step=3, exact=False, hooks=hooks)
    worker.synchronize = device.synchronize
    worker.begin_step(1)
    for g in range(3):
        worker.compute(g)
    assert len(measured) == 3
    if slowed:  # the time the slow fault multiplies is the microbatch's device time
        assert log == ["synchronize"] * 3 and all(s >= KERNEL_S for s in measured) and device.queued_s == 0
    else:  # nothing waited for the device: its work is still queued, whatever the host's times were
        assert log == [] and device.queued_s == pytest.approx(3 * KERNEL_S)


def test_synchronize_waits_for_the_current_stream_of_an_accelerator_and_not_for_the_cpu(monkeypatch):
    """On an accelerator: the current stream (the compute), never the whole device, which would also wait for a
    cross-replica collective queued on its own stream for a peer that may be dead (docs/invariant.md)."""
    waited = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            waited.append(("stream", self.device))

    monkeypatch.setattr(torch.accelerator, "current_stream", Stream)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: waited.append(("device", device)))
    platform.synchronize("cpu")
    platform.synchronize(torch.device("cpu"))
    assert waited == []
    platform.synchronize(torch.device("cuda", 1))
    assert waited == [("stream", torch.device("cuda", 1))]


def test_single_mode_measures_a_slow_ranks_microbatch_on_the_device(monkeypatch):
    from titan_recover.recover.modes import single

    log, measured = [], []
    device = Device(log)
    monkeypatch.setattr(single.platform, "synchronize", lambda _device: device.synchronize())
    chaos = types.SimpleNamespace(maybe_inject=lambda *_: None, slowed=True, after_compute=measured.append)
    parts = types.SimpleNamespace(device=torch.device("cuda"),
                                  forward_backward=lambda **_: device.launch(KERNEL_S))
    single.forward_backward_with_faults(parts, chaos, step=1, batch={})
    assert log == ["synchronize", "synchronize"] and measured[0] >= KERNEL_S


def test_a_worker_needs_a_backward_before_building_gradients_only_with_tensor_parallelism_and_only_once():
    """Every rank of a replica gives the same answer (a spare's ranks compute the microbatch it leads to together):
    tensor parallelism on, and no backward run yet in this process."""
    from titan_recover.recover.modes.replica_worker import ComputeHooks, ReplicaWorker

    for tp in (False, True):
        parts = fake_parts(Device([]))
        parts.parallel_dims.tp_enabled = tp
        worker = ReplicaWorker(parts, per_step=2, exact=False, hooks=ComputeHooks())
        assert worker.needs_backward() is tp
        worker.begin_step(1)
        worker.compute(0, witness="replay")
        assert not worker.needs_backward()
