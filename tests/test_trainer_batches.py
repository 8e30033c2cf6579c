"""The trainer's data order: which microbatch ids each rank consumes per step (no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from titan_recover.data.loader import AddressableDataLoader
from titan_recover.trainer import RecoverTrainer


def fake_trainer(dp: int, rank: int, accumulation: int, **extra) -> SimpleNamespace:
    fake = SimpleNamespace(gradient_accumulation_steps=accumulation, batch_layout=lambda: (dp, rank), learner=None,
                           **extra)
    fake.microbatch_order = lambda step: RecoverTrainer.microbatch_order(fake, step)
    return fake


def test_each_step_consumes_exactly_its_global_microbatch_ids():
    replicas, shards, accumulation = 2, 3, 2
    per_step = replicas * accumulation  # M
    for step in (1, 2, 7):
        ids = []
        for replica in range(replicas):
            for shard in range(shards):
                trainer = fake_trainer(replicas * shards, replica * shards + shard, accumulation)
                for n in trainer.microbatch_order(step):
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
        metrics_processor=SimpleNamespace(ntokens_since_last_log=0, data_loading_times=[]),
    )
    batches = RecoverTrainer._addressable_batches(trainer, first_step=3)
    first, second = next(batches), next(batches)
    expected_inputs, expected_labels = loader.local_batch((3 - 1) * 2 + 1, 4)  # step 3, rank 1
    assert torch.equal(torch.cat([first[1], second[1]]), expected_labels)
    assert torch.equal(first[0]["input"], expected_inputs["input"][:2])
    assert trainer.metrics_processor.ntokens_since_last_log == 4 * 16
    following = next(batches)[1]
    assert torch.equal(following, loader.local_batch(3 * 2 + 1, 4)[1][:2])  # then step 4
