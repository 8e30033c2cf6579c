"""The project's checkpoint manager (``titan_recover/checkpoint.py``), in one process.

Which durable step recovery loads (the newest verified one, or the user's explicit ``load_step``), with TorchTitan's
own load logic and only the DCP read recorded; the ``checkpoint_choice`` event; the refill from a keeper's
in-memory snapshot after the durable load (a real keeper store, a fresh model restored bitwise); and the replica
groups' one checkpoint folder (docs/replica_groups.md "Checkpoints"): only the writer saves into it, with real DCP
files under a one-rank process group, a fresh replica loads it whoever wrote it, and the purge counts only complete
checkpoints.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from test_state_transfer import Replica
from titan_recover.checkpoint import publish, RecoverCheckpointManager, stale_checkpoints, staging_name, \
    verified_load_step
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


def test_a_start_founding_the_epoch_after_a_cold_restart_loads_the_coordinators_step(tmp_path, monkeypatch):
    """After losing every replica, every group loads the step the coordinator chose (its launcher passes it),
    not the newest its own listing of the folder shows (a shared file system may show a newer step to some nodes
    first), nor the user's explicit ``load_step``; and the coordinator chooses as the manager would."""
    from titan_recover.recover.coordinator_process import newest_checkpoint
    from titan_recover.recover.groups.member import FOUNDING_STEP_ENV

    run = tmp_path / "run"
    folder = run / "checkpoint"
    checkpoints(folder)
    assert newest_checkpoint(str(folder), verified=True).step == 6  # no verification record: the newest
    mark_verified(str(folder), 2)
    mark_verified(str(folder), 4)
    chosen = newest_checkpoint(str(folder), verified=True)
    assert chosen.step == 4 and chosen.why.startswith("newest verified checkpoint, step 4 (unverified newer: [6])")
    assert newest_checkpoint(str(folder), verified=False).step == 6
    assert newest_checkpoint(str(tmp_path / "none"), verified=True) is None
    assert newest_checkpoint("", verified=True) is None  # checkpoints off

    monkeypatch.setenv(FOUNDING_STEP_ENV, "2")
    for load_verified in (True, False):
        founder = manager(RecordingManager, run, Replica(seed=0), enable=True, load_verified=load_verified)
        assert founder.load() and founder.loaded == ["step-2"]
        assert founder.load(step=6) and founder.loaded == ["step-2", "step-2"]
    choices = [e for e in read_events(run / "events.jsonl") if e["event"] == "checkpoint_choice"]
    assert [e["step"] for e in choices] == [2] * 4 and "chosen by the coordinator" in choices[0]["reason"]


def test_the_manager_refills_from_the_keeper_after_the_durable_load(tmp_path, monkeypatch):
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

    another_job = Replica(seed=4)  # another job (its own folder) sharing the keeper finds nothing of this one
    assert not manager(RecoverCheckpointManager, tmp_path / "another", another_job, enable=False,
                       _snapshot=snapshot).load()
    assert another_job.step == 0

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

    # checkpoint.load_step names a step: torchrun's restarts (which pass it again) refill from the snapshots taken
    # since; the first start loads the step asked for and discards the snapshots of the timeline it rolls back from
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = Replica(seed=5)
    assert manager(RecoverCheckpointManager, tmp_path, restarted, enable=False, _snapshot=snapshot).load(step=2)
    assert restarted.step == 3
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    named = Replica(seed=3)
    assert not manager(RecoverCheckpointManager, tmp_path, named, enable=False, _snapshot=snapshot).load(step=2)
    assert named.step == 0
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert not manager(RecoverCheckpointManager, tmp_path, Replica(seed=6), enable=False, _snapshot=snapshot).load()


@pytest.fixture
def process_group():
    """The one-rank process group TorchTitan's trainer would have (its purge asks for the rank)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def trained(steps: int, seed: int = 0) -> Replica:
    replica = Replica(seed=seed)
    for batch in range(steps):
        replica.train_step(batch)
    return replica


def test_replica_groups_share_the_run_checkpoint_folder(tmp_path, monkeypatch):
    from titan_recover.job_config import build_config
    from titan_recover.train import place_replica_outputs

    monkeypatch.setenv("TITAN_RECOVER_REPLICA", "1")
    monkeypatch.setenv("TITAN_RECOVER_RUN_DIR", str(tmp_path))
    config = build_config("train_configs/replicas.toml", ["--dump_folder", str(tmp_path)])
    place_replica_outputs(config)
    assert config.dump_folder == str(tmp_path / "replica_1")
    assert config.checkpoint.folder == str(tmp_path / "checkpoint")
    assert config.metrics.enable_wandb is False  # the job's one wandb run is the launcher's (docs/outputs.md)


def test_the_managers_events_are_named_as_the_modes_are(monkeypatch):
    """A checkpoint-restart job is one torchrun whose replicated dimension is the replicas: the config loader hands
    the manager its ``[parallelism]``, and global rank 5 of 2 replicas x 2 shards x 2 pipeline stages (8 ranks,
    pipeline stages outermost) is named ``0/3`` (replica 0, rank 3 in it), as the mode names it. A replica group's
    own torchrun (no layout handed over) names it by ``REPLICA_ENV`` and the rank."""
    from titan_recover.checkpoint import event_source
    from titan_recover.config.validate import resolve_layout
    from titan_recover.job_config import build_config

    config = build_config("train_configs/replicas.toml", [  # as the launcher hands it to the job's processes
        "--recover.mode", "checkpoint_restart", "--recover.replicas", "2", "--parallelism.data_parallel_shard_degree",
        "2", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2"])
    assert config.checkpoint._replicas_in is config.parallelism
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert event_source(config.checkpoint._replicas_in) == (0, 3)
    assert event_source(config.checkpoint._replicas_in) == resolve_layout(config.parallelism, 8).replica_and_rank(5)
    monkeypatch.setenv("TITAN_RECOVER_REPLICA", "1")
    assert event_source(None) == (1, 5)
    assert build_config("train_configs/replicas.toml", []).checkpoint._replicas_in is None  # sync mode


def test_one_replica_writes_the_checkpoint_and_a_restart_loads_it_whoever_wrote_it(tmp_path, process_group):
    """Two replica groups holding the same state, as after a commit: only the writer's ranks write; when the writer
    is lost the next one writes into the same folder; a fresh replica (a restarted group, or the whole job started
    again) loads the newest, bitwise."""
    shared = tmp_path / "checkpoint"
    replicas = [trained(2), trained(2)]
    managers = [manager(RecoverCheckpointManager, tmp_path / f"replica_{i}", r, enable=True, interval=2,
                        folder=str(shared)) for i, r in enumerate(replicas)]
    managers[1].writer = False  # replica 0 is the lowest member
    assert managers[0].save(curr_step=2) and not managers[1].save(curr_step=2)
    assert list(tmp_path.rglob(".metadata")) == [shared / "step-2" / ".metadata"]  # one copy, the writer's
    managers[0].close()

    survivor = replicas[1]  # replica 0 is lost: replica 1 is the lowest member now
    for batch in (2, 3):
        survivor.train_step(batch)
    managers[1].writer = True
    assert managers[1].save(curr_step=4)
    managers[1].close()
    assert sorted(os.listdir(shared)) == ["step-2", "step-4"]

    fresh = Replica(seed=7)
    restarted = manager(RecoverCheckpointManager, tmp_path / "replica_0", fresh, enable=True, interval=2,
                        folder=str(shared))
    assert restarted.load() and fresh.step == 4
    # the weights, bitwise (the optimizer's state goes through TorchTitan's optimizer container in a job, which a
    # plain torch optimizer here is not: the multiprocess restart tests check the losses after a load bitwise)
    assert all(torch.equal(a, b) for a, b in zip(survivor.model.parameters(), fresh.model.parameters(), strict=True))
    restarted.close()


def test_an_async_save_says_when_its_checkpoint_is_complete(tmp_path, process_group):
    """An asynchronous save returns after its blocking part and writes on in the background; once the write
    succeeded the manager logs ``checkpoint_complete`` with how long it took after the blocking part (the simulator's
    ``checkpoint_write_s``). When that event is in the log the checkpoint is complete (its ``.metadata`` is there); a
    save that fails logs nothing."""
    replica = trained(2)
    saver = manager(RecoverCheckpointManager, tmp_path, replica, enable=True, interval=2, async_mode="async",
                    folder="checkpoint")
    assert saver.save(curr_step=2)
    saver.maybe_wait_for_saving()
    [complete] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_complete"]
    assert complete["step"] == 2 and complete["write_s"] >= 0
    assert (tmp_path / "checkpoint" / "step-2" / ".metadata").is_file()

    from concurrent.futures import Future
    failed = Future()
    saver._report_complete(4, failed)
    failed.set_exception(OSError("disk full"))
    assert [e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_complete"] == [2]
    saver.close()


def test_a_wait_for_an_async_save_returns_once_its_completion_is_logged(tmp_path, process_group):
    """A future wakes the threads waiting for it before it runs its done-callbacks, so the manager's wait for a save
    also waits for the callback that logs ``checkpoint_complete`` (held here for 0.5 s after the write completed):
    without that the event could come after the wait, or never at the end of a job."""
    import threading
    import time
    from concurrent.futures import Future

    saver = manager(RecoverCheckpointManager, tmp_path, trained(2), enable=True, interval=2, async_mode="async",
                    folder="checkpoint")
    logged = []

    class SlowLog:
        def emit(self, event, **fields):
            time.sleep(0.5)
            logged.append((event, fields["step"]))

    saver._events = SlowLog()
    write = Future()
    saver.save_future = write
    saver._report_complete(4, write)
    threading.Timer(0.1, write.set_result, args=(None,)).start()
    saver.maybe_wait_for_saving()
    assert logged == [("checkpoint_complete", 4)]
    assert saver.save_future is None
    saver.close()


def test_a_stops_checkpoint_resumes_the_full_state_whatever_the_final_export_settings(tmp_path, process_group):
    """TorchTitan's final save (``last_step=True``) is an export: with its default ``last_save_model_only`` (kept by
    the llama3 8B/70B/405B configs) it writes the model alone, in ``export_dtype``, and a later start, which loads the
    full state of any step but 0, fails on the missing keys. A stop's checkpoint is one the job resumes from: the
    optimizer's state and the step are in it, and a fresh replica resumes from it."""
    from torch.distributed.checkpoint import FileSystemReader

    def keys(step):
        return set(FileSystemReader(str(tmp_path / "checkpoint" / f"step-{step}")).read_metadata().state_dict_metadata)

    stopped = trained(3)
    export = dict(enable=True, interval=500, folder=str(tmp_path / "checkpoint"), last_save_model_only=True,
                  export_dtype="bfloat16")
    writer = manager(RecoverCheckpointManager, tmp_path / "replica_0", stopped, **export)
    writer.writer = False
    assert not writer.save_resumable(3)  # not the writer: nothing written
    writer.writer = True
    assert writer.save_resumable(3) and writer.save(curr_step=4, last_step=True)  # the stop's, then an export
    writer.close()
    model = {name for name, _ in stopped.model.named_parameters()}
    assert keys(4) == model  # what the export leaves: the weights alone
    assert keys(3) >= model | {"optimizer", "lr_scheduler.last_epoch", "train_state.step", "dataloader"}, keys(3)

    fresh = Replica(seed=7)
    resumed = manager(RecoverCheckpointManager, tmp_path / "replica_1", fresh, load_step=3, **export)
    assert resumed.load(step=3) and fresh.step == 3
    assert all(torch.equal(a, b) for a, b in zip(stopped.model.parameters(), fresh.model.parameters()))
    resumed.close()


class DyingManager(RecoverCheckpointManager):
    """A writer that dies mid-save: it truncates the data file it writes, writes half of it, and is gone."""

    def dcp_save(self, state_dict, checkpoint_id, **_kwargs):
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as half:
            half.write(b"\0" * 64)
        raise RuntimeError("killed mid-save")


def snapshot_of(folder) -> dict:
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_a_resumable_checkpoint_is_published_whole_and_never_written_over(tmp_path, process_group, monkeypatch):
    """A stop's (or a requested) checkpoint is written into the writer's own staging folder and renamed into place
    as ``step-N`` once complete: a folder of the step left incomplete by a save that died is replaced; a second
    writer of the same step (a stop's writer named lost that still saves, and the next in turn) that dies
    mid-save leaves the first's checkpoint byte for byte, and one that finishes leaves it too and removes its copy."""
    shared = tmp_path / "checkpoint"
    (shared / "step-3").mkdir(parents=True)
    (shared / "step-3" / "__0_0.distcp").write_bytes(b"partial")  # an earlier save of step 3 died: no .metadata
    stopped = trained(3)
    config = dict(enable=True, interval=500, folder=str(shared))
    monkeypatch.setenv("TITAN_RECOVER_REPLICA", "0")
    first = manager(RecoverCheckpointManager, tmp_path / "replica_0", stopped, **config)
    assert first.save_resumable(3)
    first.close()
    assert sorted(os.listdir(shared)) == ["step-3"]  # no staging folder, no incomplete folder left
    published = snapshot_of(shared / "step-3")
    assert ".metadata" in published and published["__0_0.distcp"][1] != b"partial"

    monkeypatch.setenv("TITAN_RECOVER_REPLICA", "1")
    dying = manager(DyingManager, tmp_path / "replica_1", trained(3), **config)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        dying.save_resumable(3)
    dying.close()
    assert snapshot_of(shared / "step-3") == published  # written in place, it would have truncated the data file
    second = manager(RecoverCheckpointManager, tmp_path / "replica_1", trained(3), **config)
    assert second.save_resumable(3)  # the same state, complete: the first copy stands
    second.close()
    assert snapshot_of(shared / "step-3") == published
    assert sorted(os.listdir(shared)) == ["step-3"]  # its staging folder, where the dying save left its half, removed

    fresh = Replica(seed=7)
    resumed = manager(RecoverCheckpointManager, tmp_path / "replica_2", fresh, load_step=3, **config)
    assert resumed.load(step=3) and fresh.step == 3
    assert all(torch.equal(a, b) for a, b in zip(stopped.model.parameters(), fresh.model.parameters()))
    resumed.close()

    (shared / "gone").mkdir()
    assert not publish(str(shared / "missing"), str(shared / "step-3"))  # purged by the writer that stood first
    with pytest.raises(FileNotFoundError):
        publish(str(shared / "missing"), str(shared / "gone"))


def test_the_purge_keeps_complete_checkpoints_over_a_lost_writers_partial_one(tmp_path, process_group):
    assert stale_checkpoints([2, 4, 6, 8, 10], complete=[2, 4, 8], keep=2) == [2]  # 6 partial, 10 in flight
    assert stale_checkpoints([2, 4, 6], complete=[2], keep=2) == []  # too few complete: purge nothing
    assert stale_checkpoints([2, 4, 6], complete=[2, 4, 6], keep=2) == [2]
    assert stale_checkpoints([2, 4], complete=[2, 4], keep=0) == []  # keep_latest_k = 0: TorchTitan keeps all

    shared = tmp_path / "checkpoint"
    replica = trained(2)
    writer = manager(RecoverCheckpointManager, tmp_path / "replica_1", replica, enable=True, interval=2,
                     folder=str(shared), keep_latest_k=2)
    assert writer.save(curr_step=2) and writer.save(curr_step=4)
    (shared / "step-6").mkdir()  # the previous writer died saving step 6: no .metadata
    (shared / staging_name(6, 0)).mkdir()  # one that died staging a resumable checkpoint of step 6
    (shared / staging_name(9, 2)).mkdir()  # one staging step 9 now: newer than any complete checkpoint
    assert writer.save(curr_step=8)
    writer.close()  # joins the purge thread
    # TorchTitan's own purge would keep step-6 and step-8 only, no complete checkpoint but the newest
    assert sorted(os.listdir(shared)) == [staging_name(9, 2), "step-4", "step-6", "step-8"]


def test_a_joiner_whose_admission_had_not_committed_never_writes_the_stops_checkpoint():
    """A stop during an admission: the stop's epoch still lists the joiner (replica 0, the lowest); the checkpoint
    of the last committed step comes from the lowest replica that committed it (then the next, in turn), and
    from nobody if only joiners are left (their state is partly received, or an older checkpoint's)."""
    from titan_recover.recover.groups.stop_checkpoint import candidates

    assert candidates((0, 2, 3), committed=(1, 2, 3)) == (2, 3)
    assert candidates((2, 0, 1), committed=(0, 1, 2)) == (0, 1, 2)  # admitted and committed since: a member like any
    assert candidates((0,), committed=(1, 2)) == ()
    assert candidates((), committed=(1, 2)) == ()
