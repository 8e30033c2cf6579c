"""The checkpoint-restart baseline (``[recover] mode = "checkpoint_restart"``, docs/evidence.md): the replica-group
job as one torchrun, restarted whole from TorchTitan's newest async checkpoint when a rank dies."""

from __future__ import annotations

import pytest

from conftest import launch, read_metrics
from titan_recover.recover.events import read_events

pytestmark = pytest.mark.multiprocess

LOSS = "loss_metrics/global_avg_loss"


def test_a_killed_rank_restarts_the_whole_job_from_its_newest_checkpoint(default_data, tmp_path):
    steps = 6
    proc = launch(
        "train_configs/replicas.toml", "--model.flavor", "tiny", "--metrics.no_enable_wandb",
        "--training.steps", str(steps), "--recover.replicas", "2", "--parallelism.data_parallel_shard_degree", "1",
        "--recover.mode", "checkpoint_restart", "--recover.max_restarts", "1",
        "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
        "--chaos.faults", '[{kind = "kill", replica = 1, rank = 0, step = 4, phase = "optimizer"}]',
        "--dump_folder", str(tmp_path), timeout=240,
    )
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    assert "dp_replicate=2" in proc.stdout + proc.stderr  # the replica groups became TorchTitan's replicate dimension
    events = read_events(tmp_path / "events.jsonl")
    fired = [e for e in events if e["event"] == "fault_injected"]
    assert [(e["replica"], e["rank"], e["step"]) for e in fired] == [(1, 0, 4)]  # once: not again after the restart
    starts = [e for e in events if e["event"] == "training_started" and e["source"] == "0/0"]
    assert [e["incarnation"] for e in starts] == [0, 1]
    resumed = starts[1]["resumed_from"]
    # the kill came before step 4's save; step 2's async save is the newest unless it had not completed
    assert starts[0]["resumed_from"] == 0 and resumed in (0, 2)
    # each asynchronous save says when its checkpoint is complete: step 4's after the restart (step 6's, the last,
    # is written synchronously); and a step-2 checkpoint said complete before the kill is the one resumed from
    complete = [e for e in events if e["event"] == "checkpoint_complete" and e["source"] == "0/0"]
    assert 4 in [e["step"] for e in complete if e["time"] > starts[1]["time"]], complete
    assert resumed == 2 or not [e for e in complete if e["step"] == 2 and e["time"] < starts[1]["time"]], complete
    # the checkpoint manager names its events as the mode does: replica 1's rank 0 is "1/0", not global rank "0/1"
    sources = {e["source"] for e in events if e["event"] in ("checkpoint_complete", "training_started")}
    assert sources == {"0/0", "1/0"}, sources
    records = [(r["step"], r[LOSS], r["grad_norm"]) for r in read_metrics(tmp_path)]
    first_start = records[:3]  # steps 1-3 were logged, step 4 died in its optimizer phase
    assert [s for s, _, _ in first_start] == [1, 2, 3]
    after_restart = records[3:]
    assert [s for s, _, _ in after_restart] == list(range(resumed + 1, steps + 1))
    # the restarted job retrains the steps after its checkpoint exactly as they were trained the first time
    retrained = [r for r in after_restart if r[0] <= 3]
    assert retrained and retrained == first_start[resumed:]
    assert (tmp_path / "checkpoint" / f"step-{steps}").is_dir()
