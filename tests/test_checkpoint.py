"""The project's checkpoint manager (``titan_recover/checkpoint.py``), in one process, without a process group.

Which durable step recovery loads (the newest verified one, or the user's explicit ``load_step``), with TorchTitan's
own load logic and only the DCP read recorded; the ``checkpoint_choice`` event; and the refill from a keeper's
in-memory snapshot after the durable load (a real keeper store, a fresh model restored bitwise).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from test_state_transfer import Replica
from titan_recover.checkpoint import RecoverCheckpointManager, verified_load_step
from titan_recover.recover.events import read_events
from titan_recover.recover.phoenix.snapshots import SnapshotConfig
from titan_recover.recover.scout.verified import mark_verified


class TrainState:
    """TorchTitan's trainer as its checkpoint manager sees it: a ``Stateful`` step and token count."""

    def __init__(self, replica: Replica):
        self.replica, self.ntokens_seen = replica, 0

    def state_dict(self):
        return {"step": self.replica.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.replica.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class RecordingManager(RecoverCheckpointManager):
    """Everything of the manager but the DCP read, which records the checkpoint it was asked for."""

    def dcp_load(self, state_dict, checkpoint_id, **_kwargs):
        self.loaded.append(checkpoint_id.rsplit("/", 1)[-1])


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TITAN_RECOVER_RUN_DIR", "TITAN_RECOVER_REPLICA",
                 "TITAN_RECOVER_SNAPSHOT_KEEPERS"):
        monkeypatch.delenv(name, raising=False)


def manager(cls, run, replica: Replica, **config):
    built = cls(cls.Config(**config), dataloader=None, model_parts=[replica.model], optimizers=[replica.optimizer],
                lr_schedulers=replica.scheduler, states={"train_state": TrainState(replica)}, sd_adapter=None,
                base_folder=str(run))
    built.loaded = []
    return built


def checkpoints(folder, complete=(2, 4, 6), incomplete=(8,)):
    for step in (*complete, *incomplete):
        (folder / f"step-{step}").mkdir(parents=True)
    for step in complete:
        (folder / f"step-{step}" / ".metadata").write_text("x")


def test_the_step_chosen_is_the_newest_verified_complete_one_unless_the_user_named_one(tmp_path):
    folder = tmp_path / "checkpoint"
    checkpoints(folder)
    assert verified_load_step(str(folder), -1) == (-1, "no verification record: TorchTitan's newest checkpoint")
    for step in (2, 4, 8):  # 8 is verified, but its save never completed
        mark_verified(str(folder), step)
    step, reason = verified_load_step(str(folder), -1)
    assert step == 4 and "unverified newer: [6]" in reason
    assert verified_load_step(str(folder), 6) == (6, None)  # an explicit step is the user's choice


def test_the_manager_loads_the_newest_verified_checkpoint_and_says_why(tmp_path):
    run = tmp_path / "run"
    checkpoints(run / "checkpoint")
    mark_verified(str(run / "checkpoint"), 2)
    mark_verified(str(run / "checkpoint"), 4)
    verified = manager(RecordingManager, run, Replica(seed=0), enable=True, load_verified=True)
    assert verified.load() and verified.loaded == ["step-4"]
    assert verified.load(step=6) and verified.loaded == ["step-4", "step-6"]
    choices = [e for e in read_events(run / "events.jsonl") if e["event"] == "checkpoint_choice"]
    assert [(e["step"], e["source"]) for e in choices] == [(4, "0/0")]  # one choice: the explicit load has none
    assert "unverified newer: [6]" in choices[0]["reason"]

    newest = manager(RecordingManager, run, Replica(seed=0), enable=True, load_verified=False)
    assert newest.load() and newest.loaded == ["step-6"]  # TorchTitan's own choice
    off = manager(RecordingManager, run, Replica(seed=0), enable=False, load_verified=True)
    assert not off.load() and off.loaded == []
    assert len([e for e in read_events(run / "events.jsonl") if e["event"] == "checkpoint_choice"]) == 1


def test_the_manager_refills_from_the_keeper_after_the_durable_load(tmp_path):
    keeper = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    snapshot = SnapshotConfig(interval=1, keepers=[f"127.0.0.1:{keeper.port}"])
    trained = Replica(seed=0)
    taking = manager(RecoverCheckpointManager, tmp_path, trained, enable=False, _snapshot=snapshot)
    for batch in range(3):
        trained.train_step(batch)
    taking._train_state.ntokens_seen = 120
    assert taking.snapshots.take(trained.step)
    taking.snapshots.wait()
    expected = {k: v.clone() for k, v in trained.model.state_dict().items()}

    fresh = Replica(seed=1)
    restoring = manager(RecoverCheckpointManager, tmp_path, fresh, enable=False, _snapshot=snapshot)
    assert restoring.load()  # no durable checkpoint (off), the snapshot of step 3
    assert fresh.step == 3 and restoring._train_state.ntokens_seen == 120
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    restored = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "snapshot_restored"]
    assert [(e["step"], e["rank"], e["durable_step"]) for e in restored] == [(3, 0, 0)]

    without = manager(RecoverCheckpointManager, tmp_path, Replica(seed=2), enable=False)
    assert without.snapshots is None and not without.load()
