"""The trainer's data order: which microbatch ids each rank consumes per step (no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from titan_recover.trainer import RecoverTrainer  # first: it activates the platform before TorchTitan loads

from titan_recover.data.loader import AddressableDataLoader  # noqa: E402
from titan_recover.metrics import RunMetrics  # noqa: E402
from titan_recover.recover.modes.base import Mode  # noqa: E402


class FakeParts(SimpleNamespace):
    def batch_layout(self):
        return self.layout


def fake_mode(dp: int, rank: int, accumulation: int) -> Mode:
    """TorchTitan's data order, as the ``single`` mode (the base mode) gives it."""
    return Mode(None, parts=FakeParts(gradient_accumulation_steps=accumulation, layout=(dp, rank)))


def fake_trainer(dp: int, rank: int, accumulation: int, **extra) -> SimpleNamespace:
    return SimpleNamespace(mode=fake_mode(dp, rank, accumulation), **extra)


class CountingMetrics:
    """The metrics processor's batch counters (``RunMetrics.record_batch`` on them)."""

    record_batch = RunMetrics.record_batch

    def __init__(self):
        self.ntokens_since_last_log, self.data_loading_times = 0, []


def test_each_step_consumes_exactly_its_global_microbatch_ids():
    replicas, shards, accumulation = 2, 3, 2
    per_step = replicas * accumulation  # M
    for step in (1, 2, 7):
        ids = []
        for replica in range(replicas):
            for shard in range(shards):
                trainer = fake_trainer(replicas * shards, replica * shards + shard, accumulation)
                for n in trainer.mode.local_batches(step):
                    g, s = divmod(n, shards)
                    assert s == shard  # a rank only ever reads its own shard's rows
                    ids.append(g)
        # every id of the step, once per shard rank: replica microbatches [(t-1) M, t M)
        assert sorted(ids) == sorted(list(range((step - 1) * per_step, step * per_step)) * shards)


def test_batches_start_at_the_next_step_and_split_for_pipeline(default_data):
    loader = AddressableDataLoader.Config(dataset_path=str(default_data)).build(
        dp_world_size=2, dp_rank=1, seq_len=16, local_batch_size=4
    )
    trainer = fake_trainer(
        2, 1, 1,
        dataloader=loader,
        config=SimpleNamespace(training=SimpleNamespace(local_batch_size=4)),
        num_pipeline_parallel_microbatches=2,
        metrics_processor=CountingMetrics(),
    )
    batches = RecoverTrainer._addressable_batches(trainer, first_step=3)
    first, second = next(batches), next(batches)
    expected_inputs, expected_labels = loader.local_batch((3 - 1) * 2 + 1, 4)  # step 3, rank 1
    assert torch.equal(torch.cat([first[1], second[1]]), expected_labels)
    assert torch.equal(first[0]["input"], expected_inputs["input"][:2])
    assert trainer.metrics_processor.ntokens_since_last_log == 4 * 16
    following = next(batches)[1]
    assert torch.equal(following, loader.local_batch(3 * 2 + 1, 4)[1][:2])  # then step 4


def test_every_mode_the_config_accepts_is_registered():
    import titan_recover.recover.modes.registered  # noqa: F401
    from titan_recover.recover.config import MODE_NAMES
    from titan_recover.recover.modes.base import MODES

    assert sorted(MODE_NAMES) == MODES.names()
