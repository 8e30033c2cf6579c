"""The TOML + CLI configuration layer: precedence, strictness, messages (no processes)."""

from __future__ import annotations

import dataclasses

import os
import pathlib
import signal
import sys
import textwrap

import pytest
import tomli
import torch  # imported before the launcher fixture forbids processes (its first import may run ldconfig)

from titan_recover.config.apply import ConfigError
from titan_recover.job_config import build_config
from titan_recover.config.render import render_toml
from titan_recover.config.validate import check_batch, resolve_layout

from conftest import ROOT


def write(tmp_path: pathlib.Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_toml_overrides_model_config_and_cli_overrides_toml(tmp_path):
    path = write(
        tmp_path,
        """
        [model]
        name = "llama3"
        flavor = "tiny"
        [training]
        steps = 7
        seq_len = 64
        [optimizer]
        implementation = "foreach"
        """,
    )
    config = build_config(path, ["--training.steps", "9", "--metrics.enable_wandb", "--training.max_norm=0.5"])
    assert config.model_spec.flavor == "tiny" and config.model_spec.model.dim == 64
    assert config.training.steps == 9  # CLI beats TOML
    assert config.training.seq_len == 64  # TOML beats the model's registered config (2048)
    assert config.optimizer.implementation == "foreach"
    assert config.metrics.enable_wandb is True  # bare boolean flag
    assert config.training.max_norm == 0.5
    assert config.training.local_batch_size == 8  # untouched: llama3_debugmodel's value
    assert config.dump_folder.endswith("run")  # named after the TOML file
    assert type(config.recover).__name__ == "RecoverConfig"


def test_cpu_platform_defaults_and_model_adaptation():
    config = build_config(None, ["--model.flavor", "tiny"])  # first: it activates the platform before TorchTitan
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    assert config.training.mixed_precision_param == "float32"
    inner = [layer.attention.inner_attention for layer in config.model_spec.model.layers]
    assert all(isinstance(a, ScaledDotProductAttention.Config) for a in inner)
    assert hasattr(config.model_spec.parallelize_fn, "__wrapped__")  # sum-only FSDP reductions for gloo
    assert config.dataloader.document_positions is False  # SDPA takes no document masks
    assert config.recover.step.overlap_reduction is False  # the collective would share the cores with the backward
    assert config.recover.step.abort_recovery == "recompute"  # the backup's copy would too

    kept = build_config(None, ["--model.flavor", "tiny", "--platform.attention", "model",
                               "--platform.sum_only_reductions", "off", "--training.mixed_precision_param", "bfloat16",
                               "--recover.step.overlap_reduction", "--recover.step.abort_recovery", "backup"])
    assert all(isinstance(l.attention.inner_attention, FlexAttention.Config) for l in kept.model_spec.model.layers)
    assert not hasattr(kept.model_spec.parallelize_fn, "__wrapped__")
    assert kept.training.mixed_precision_param == "bfloat16"  # user's value beats the platform default
    assert kept.recover.step.overlap_reduction is True
    assert kept.recover.step.abort_recovery == "backup"
    assert kept.dataloader.document_positions is True  # FlexAttention builds block-causal masks from them


def test_unknown_section_names_closest(tmp_path):
    path = write(tmp_path, "[trainig]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section 'trainig'.*Did you mean 'training'\?"):
        build_config(path)


def test_unknown_key_names_closest_and_section(tmp_path):
    path = write(tmp_path, "[training]\nsetps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'setps' in \[training\]\. Did you mean 'steps'\?"):
        build_config(path)
    with pytest.raises(ConfigError, match=r"unknown key 'seq_lenn' in \[training\]\. Did you mean 'seq_len'\?"):
        build_config(None, ["--training.seq_lenn", "3"])
    with pytest.raises(ConfigError, match=r"unknown key 'replica' in \[recover\]"):
        build_config(write(tmp_path, "[recover]\nreplica = 2\n", "r.toml"))


def test_wrong_type_names_path_and_expected_type(tmp_path):
    path = write(tmp_path, '[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"training\.steps: expected int, got 'ten' \(str\)"):
        build_config(path)
    path = write(tmp_path, '[training]\nmixed_precision_param = "fp8"\n', "b.toml")
    with pytest.raises(ConfigError, match=r"training\.mixed_precision_param: expected one of 'bfloat16', 'float32'"):
        build_config(path)
    with pytest.raises(ConfigError, match=r"training\.steps: expected int"):
        build_config(None, ["--training.steps", "2.5"])
    with pytest.raises(ConfigError, match=r"only boolean settings can be given as bare flags"):
        build_config(None, ["--training.steps"])


def test_component_sections_name_their_registered_choices(tmp_path):
    """[recover.ftpg], [recover.step] and [recover.quota] pick a registered component; a name that is not
    registered fails at config time with the section's path and the registered names."""
    config = build_config(None, ["--recover.replicas", "2", "--recover.ftpg.poll_s", "0.02"])
    assert (config.recover.ftpg.backend, config.recover.ftpg.poll_s) == ("auto", 0.02)
    assert config.recover.step.manager == "recompute" and config.recover.resolved_mode == "sync"
    cases = {
        ("--recover.ftpg.backend", "mpi"): r"\[recover\.ftpg\] fault-tolerant group backend 'mpi' is not "
                                            r"registered; registered: gloo, (in_memory, )?nccl",
        ("--recover.ftpg.chunk_mb", "0"): r"recover\.ftpg\.chunk_mb must be > 0",
        ("--recover.step.manager", "restart"): r"\[recover\.step\] step recovery manager 'restart' is not "
                                                 r"registered; registered: recompute",
        ("--recover.quota.policy", "fastest"): r"\[recover\.quota\] quota policy 'fastest' is not registered",
        ("--recover.step.max_epochs_per_step", "0"): r"recover\.step\.max_epochs_per_step must be >= 1",
        ("--recover.step.abort_recovery", "copy"): r"recover\.step\.abort_recovery must be one of 'backup', "
                                                     r"'recompute', got 'copy'",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            build_config(None, ["--recover.replicas", "2", *override])
    with pytest.raises(ConfigError, match=r'recover\.mode = "single" trains one replica'):
        build_config(None, ["--recover.replicas", "2", "--recover.mode", "single"])


def test_unknown_model_flavor_suggests(tmp_path):
    path = write(tmp_path, '[model]\nname = "llama3"\nflavor = "tinny"\n')
    with pytest.raises(ConfigError, match=r"flavor = 'tinny'.*did you mean 'tiny'\?"):
        build_config(path)
    with pytest.raises(ConfigError, match=r"did you mean 'llama3'\?"):
        build_config(None, ["--model.name", "llama"])


def test_parallel_degrees_must_match_world_size():
    config = build_config(None, ["--parallelism.tensor_parallel_degree", "2",
                                 "--parallelism.data_parallel_shard_degree", "2"])
    assert resolve_layout(config.parallelism, 4).dp_shard == 2
    with pytest.raises(ConfigError) as err:
        resolve_layout(config.parallelism, 6)
    message = str(err.value)
    assert "dp_replicate (1) x dp_shard (2) x cp (1) x tp (2) x pp (1) = 4" in message
    assert "6 processes" in message

    inferred = build_config(None, ["--parallelism.tensor_parallel_degree", "2"])
    assert resolve_layout(inferred.parallelism, 8).dp_shard == 4
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by dp_replicate x cp x tp x pp = 2"):
        resolve_layout(inferred.parallelism, 3)


def test_checkpoint_restart_ranks_map_to_the_replica_group_job():
    """In checkpoint-restart mode the replica groups are TorchTitan's dp_replicate dimension, inside the pipeline
    stages (mesh order pp, dp_replicate, dp_shard, cp, tp). A global rank's (replica, rank inside) must be where the
    same shard sits in the replica-group job, whose per-replica mesh is (pp, dp_shard, cp, tp)."""
    import torch

    from titan_recover.config.validate import Layout

    pp, replicas, shard, tp = 2, 3, 2, 2
    layout = Layout(world_size=pp * replicas * shard * tp, dp_replicate=replicas, dp_shard=shard, cp=1, tp=tp, pp=pp)
    world = torch.arange(layout.world_size).reshape(pp, replicas, shard, 1, tp)
    for replica in range(replicas):
        group = world[:, replica].reshape(-1)  # the replica's ranks, in its own torchrun's rank order
        for inside, rank in enumerate(group.tolist()):
            assert layout.replica_and_rank(rank) == (replica, inside)
    assert Layout(4, 4, 1, 1, 1, 1).replica_and_rank(3) == (3, 0)  # no pipeline: replica-major
    with pytest.raises(ValueError, match="rank 24 is not in a world of 24"):
        layout.replica_and_rank(24)


def test_batch_divisibility_spelled_out():
    config = build_config(None, ["--training.local_batch_size", "2", "--training.global_batch_size", "6",
                                 "--parallelism.data_parallel_shard_degree", "2"])
    layout = resolve_layout(config.parallelism, 2)
    with pytest.raises(ConfigError, match=r"global_batch_size \(6\).*local_batch_size \(2\) x data-parallel degree.*= 4; 6 % 4 = 2"):
        check_batch(config.training, config.parallelism, layout)
    config.training.global_batch_size = 8
    assert check_batch(config.training, config.parallelism, layout) == 2  # gradient accumulation steps

    with pytest.raises(ConfigError, match=r"local_batch_size \(3\) must be evenly divisible by.*microbatch_size \(2\)"):
        build_config(None, ["--training.local_batch_size", "3", "--parallelism.pipeline_parallel_degree", "2",
                            "--parallelism.pipeline_parallel_microbatch_size", "2"])


def plain(value):
    """A config's values as TOML can hold them: dataclasses as dicts, tuples as lists (TOML has arrays only, so
    AdamW's ``betas`` come back a list, which the optimizer takes alike)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def test_print_config_is_valid_toml_that_rebuilds_the_same_config(tmp_path):
    """Non-default values of every kind (int, float, bool, string, list, nested sections, an array of tables) come
    back equal, section by section, compared as dataclasses (not through the printer a dropped key would cancel in)."""
    overrides = ["--model.flavor", "tiny", "--training.steps", "11", "--training.max_norm", "0.25",
                 "--checkpoint.enable", "--checkpoint.interval", "7", "--recover.replicas", "3",
                 "--recover.ftpg.poll_s", "0.02", "--recover.quota.policy", "drop",
                 "--recover.localize.replay_interval", "3", "--chaos.faults",
                 '[{kind = "slow", replica = 1, step = 2, factor = 3.0}]', "--dump_folder", str(tmp_path / "run")]
    config = build_config(None, overrides)
    text = render_toml(config)
    parsed = tomli.loads(text)
    assert parsed["model"] == {"name": "llama3", "flavor": "tiny"}
    assert parsed["training"]["steps"] == 11
    again = build_config(write(tmp_path, text, "printed.toml"))
    sections = [f.name for f in dataclasses.fields(config) if f.name != "model_spec"]
    assert [name for name in sections if plain(getattr(again, name)) != plain(getattr(config, name))] == []
    assert again.recover.ftpg.poll_s == 0.02 and again.chaos.faults[0].factor == 3.0  # the values were set
    assert render_toml(again) == text


def test_checkpoint_section_selects_the_project_manager_and_keeps_torchtitan_keys(tmp_path):
    from titan_recover.checkpoint import RecoverCheckpointManager

    path = write(tmp_path, """
        [checkpoint]
        enable = true
        interval = 3
        keep_latest_k = 4
        [recover]
        max_restarts = 1
        [recover.snapshot]
        interval = 2
        """)
    config = build_config(path, ["--model.flavor", "tiny"])
    checkpoint = config.checkpoint
    assert type(checkpoint) is RecoverCheckpointManager.Config and checkpoint._owner is RecoverCheckpointManager
    assert (checkpoint.enable, checkpoint.interval, checkpoint.keep_latest_k) == (True, 3, 4)
    assert checkpoint.load_verified is False  # no replica groups: no votes, TorchTitan's newest
    assert checkpoint._snapshot is config.recover.snapshot and checkpoint._snapshot.interval == 2
    printed = tomli.loads(render_toml(config))
    assert "_snapshot" not in printed["checkpoint"] and printed["checkpoint"]["load_verified"] is False
    assert printed["recover"]["snapshot"]["interval"] == 2  # set in [recover.snapshot], shown there only

    voting = build_config(None, ["--model.flavor", "tiny", "--recover.replicas", "2"])
    assert voting.checkpoint.load_verified is True and voting.checkpoint._snapshot.interval == 0
    assert build_config(None, ["--model.flavor", "tiny", "--recover.replicas", "2",
                               "--recover.localize.vote=false"]).checkpoint.load_verified is False
    assert build_config(None, ["--model.flavor", "tiny", "--recover.replicas", "2",
                               "--checkpoint.load_verified=false"]).checkpoint.load_verified is False
    with pytest.raises(ConfigError, match="unknown key '_snapshot' in \\[checkpoint\\]"):
        build_config(None, ["--model.flavor", "tiny", "--checkpoint._snapshot.interval", "1"])


def test_bad_config_fails_in_the_launcher_before_any_process(tmp_path, launcher):
    path = write(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 3\ntensor_parallel_degree = 2\n")
    code, _, err = launcher(path, "--nproc-per-node", "4")
    assert code == 2, err
    assert "config error" in err and "= 6, but the job has 4 processes" in err


def test_checkpoint_restart_mode_is_checked_and_becomes_the_replicate_dimension(launcher):
    base = ("train_configs/replicas.toml", "--recover.mode", "checkpoint_restart")
    code, _, err = launcher(*base)
    assert code == 2 and "set checkpoint.enable = true" in err
    code, _, err = launcher(*base, "--checkpoint.enable")
    assert code == 2 and "set recover.max_restarts >= 1" in err
    code, _, err = launcher(*base, "--checkpoint.enable", "--recover.max_restarts", "2", "--recover.spares", "1")
    assert code == 2 and "there is no share for a spare to take over" in err
    code, out, err = launcher(*base, "--checkpoint.enable", "--recover.max_restarts", "2", "--dry-run")
    assert code == 0, err
    # one torchrun of both groups' 2 processes, restarted by torchrun, the groups as data_parallel_replicate_degree
    assert "--nproc-per-node=4" in out and "--max-restarts=2" in out
    assert out.rstrip().endswith("--parallelism.data_parallel_replicate_degree 2")


def test_a_fault_between_two_diloco_blocks_is_refused_where_no_block_ends(launcher):
    fault = '[{kind = "hang", replica = 1, step = 3, phase = "block_end"}]'
    code, _, err = launcher("train_configs/replicas.toml", "--chaos.faults", fault, "--dry-run")
    assert code == 2 and 'phase "block_end" (between two blocks of a diloco learner) never comes in mode \'sync\'' \
        in err, err
    code, _, err = launcher("train_configs/diloco.toml", "--chaos.faults", fault, "--dry-run")
    assert code == 0, err
    fault = '[{kind = "kill", replica = 0, phase = "stop_save"}]'  # the turn to write a stop's checkpoint
    code, _, err = launcher("train_configs/diloco.toml", "--chaos.faults", fault, "--dry-run")
    assert code == 2 and 'phase "stop_save" (before a replica group writes a stop\'s checkpoint) never comes in ' \
        "mode 'diloco'" in err, err
    code, _, err = launcher("train_configs/replicas.toml", "--chaos.faults", fault, "--dry-run")
    assert code == 0, err


def test_a_preemption_grace_is_checked_before_launch_and_reaches_the_agent(launcher):
    """``[recover] preemption_grace_s``: SIGTERM becomes a stop with a checkpoint, so it needs checkpoints and a
    synchronous job; the agent of a job without replica groups gets it as its own option."""
    code, _, err = launcher("train_configs/debug_model.toml", "--recover.preemption_grace_s", "-1", "--dry-run")
    assert code == 2 and "recover.preemption_grace_s must be >= 0" in err, err
    code, _, err = launcher("train_configs/debug_model.toml", "--recover.preemption_grace_s", "25", "--dry-run")
    assert code == 2 and "set checkpoint.enable = true, or preemption_grace_s = 0" in err, err
    code, _, err = launcher("train_configs/diloco.toml", "--recover.preemption_grace_s", "25", "--checkpoint.enable",
                            "--dry-run")
    assert code == 2 and "a diloco job's state is its syncer's checkpoint" in err, err
    code, out, err = launcher("train_configs/debug_model.toml", "--recover.preemption_grace_s", "25",
                              "--checkpoint.enable", "--dry-run")
    assert code == 0, err
    assert out.split()[:4] == [sys.executable, "-m", "titan_recover.torchrun", "--preemption-grace-s=25.0"], out
    code, out, err = launcher("train_configs/debug_model.toml", "--dry-run")
    assert code == 0 and "--preemption-grace-s" not in out, out


def test_a_sigterm_to_a_replica_launcher_with_a_grace_is_a_stop_request_until_the_grace_is_over(tmp_path, monkeypatch):
    """With ``preemption_grace_s``, the first SIGTERM once the job started asks for a stop with a checkpoint (the
    children run on); once the grace is over, or at a second SIGTERM, the children get SIGTERM. Before anything
    started, or without a grace, SIGTERM ends the job at once."""
    from titan_recover.recover import launcher_stop
    from titan_recover.recover.launcher import ReplicaJob

    now = [100.0]
    monkeypatch.setattr(launcher_stop.time, "monotonic", lambda: now[0])
    signalled = []
    monkeypatch.setattr(launcher_stop, "signal_group", lambda child, sig: signalled.append((child, sig)))

    def job(*extra):
        config = build_config(None, ["--recover.replicas", "2", "--dump_folder", str(tmp_path), *extra])
        return ReplicaJob(config, None, [], 1, 0)

    graced = job("--recover.preemption_grace_s", "20")
    graced.on_signal(signal.SIGTERM, None)  # nothing started yet: nothing to checkpoint
    assert graced.stopped_by == signal.SIGTERM and graced.stop_requested is None
    graced = job("--recover.preemption_grace_s", "20")
    graced.children = ["coordinator", "replica 0"]
    graced.on_signal(signal.SIGTERM, None)
    assert graced.stop_requested == signal.SIGTERM and graced.stopped_by is None and not signalled
    now[0] += 19.9
    graced.end_after_grace()
    assert graced.stopped_by is None and not signalled
    now[0] += 0.1
    graced.end_after_grace()
    assert graced.stopped_by == signal.SIGTERM
    assert signalled == [("coordinator", signal.SIGTERM), ("replica 0", signal.SIGTERM)]
    signalled.clear()
    twice = job("--recover.preemption_grace_s", "20")
    twice.children = ["replica 0"]
    twice.on_signal(signal.SIGTERM, None)
    twice.on_signal(signal.SIGTERM, None)  # at once: the same notice by a second path (srun forwarding it)
    assert twice.stopped_by is None and not signalled
    now[0] += 1.0
    twice.on_signal(signal.SIGTERM, None)
    assert twice.stopped_by == signal.SIGTERM and signalled == [("replica 0", signal.SIGTERM)]
    signalled.clear()
    plain = job()
    plain.children = ["replica 0"]
    plain.on_signal(signal.SIGTERM, None)
    assert plain.stopped_by == signal.SIGTERM and plain.stop_requested is None
    # a node whose loss the job survives (not node 0 of the embedded store; any node with etcd) marks itself
    # preempted in the job's store; its groups leave as a lost node's do while the nodes not preempted run
    # min_replicas groups, and the whole job stops with a checkpoint when they do not (every node preempted: the
    # last to read the marks keeps its groups to write it)
    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.nodes import NodePlan

    etcd = ("--recover.store", "etcd://h:2379")
    for extra, rank, others_preempted, leaves in (((), 1, False, True), (etcd, 0, False, True), (etcd, 0, True, False)):
        config = build_config(None, ["--recover.replicas", "4", "--dump_folder", str(tmp_path),
                                     "--recover.preemption_grace_s", "20", "--recover.min_replicas", "2", *extra])
        node = ReplicaJob(config, None, [], 1, 0, plan=NodePlan(2, rank, range(2 * rank, 2 * rank + 2)))
        node.store, stops = HashStore(), []
        node.stop_job = lambda reason, leaving=frozenset(): stops.append((reason, leaving))
        if others_preempted:
            node.store.set(GroupKeys.PREEMPTED_PREFIX + str(1 - rank), "1")
        assert not node.holds_the_job
        node.children = [f"replica {2 * rank}"]
        node.on_signal(signal.SIGTERM, None)
        assert node.stop_requested == signal.SIGTERM and node.stopped_by is None  # decided in the loop
        node.honour_stop_request()
        assert node.store.get(GroupKeys.PREEMPTED_PREFIX + str(rank)) == b"1"
        if leaves:
            assert node.stopped_by == signal.SIGTERM and node.left_on_notice and not stops
            assert signalled[-1] == (f"replica {2 * rank}", signal.SIGTERM)
            assert f"a preemption notice to node {rank}, whose loss the job survives" in node._stopped_by_signal()
        else:
            assert node.stopped_by is None and not node.left_on_notice and len(stops) == 1
            reason, leaving = stops[0]
            assert "the nodes not preempted run fewer than recover.min_replicas groups" in reason
            assert leaving == {2, 3}  # node 1's groups are leaving: neither may be chosen to write the checkpoint
            assert node.store.get(GroupKeys.STOP_SIGNAL) == str(int(signal.SIGTERM)).encode()
    assert graced.holds_the_job  # one node: the only one
    interrupted = job("--recover.preemption_grace_s", "20")  # Ctrl-C stays a stop at once
    interrupted.children = ["replica 0"]
    interrupted.on_signal(signal.SIGINT, None)
    assert interrupted.stopped_by == signal.SIGINT and interrupted.stop_requested is None


def test_launcher_prints_config_and_help_without_training(launcher):
    code, out, err = launcher("train_configs/tp.toml", "--print-config", "--training.steps", "5")
    assert code == 0, err
    printed = tomli.loads(out)
    assert printed["training"]["steps"] == 5 and printed["parallelism"]["tensor_parallel_degree"] == 2
    code, out, _ = launcher("--help")
    assert code == 0 and "--print-config" in out


def test_all_shipped_configs_resolve():
    for toml in sorted((ROOT / "train_configs").glob("*.toml")):
        config = build_config(str(toml))
        assert config.model_spec.name == "llama3", toml


def test_each_replica_group_gets_its_own_gpus():
    from titan_recover.recover.placement import group_devices, visible_devices

    assert visible_devices(lambda: 3, environ={}) == ["0", "1", "2"]
    assert visible_devices(lambda: 8, environ={"CUDA_VISIBLE_DEVICES": "4,5, 7"}) == ["4", "5", "7"]
    visible = [str(i) for i in range(8)]
    assert group_devices(4, 2, visible) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    with pytest.raises(ValueError, match=r"3 replica groups \(recover.replicas 2 \+ recover.spares 1\) x 4 "
                                         r"processes need 12 GPUs, this node has 8: .*recover.share_devices"):
        group_devices(3, 4, visible, spares=1)
    # shared (tests): consecutive devices, wrapping around, still distinct inside each group
    assert group_devices(3, 2, ["0", "1", "2"], share=True) == [["0", "1"], ["2", "0"], ["1", "2"]]
    from titan_recover.recover.placement import check_backend_on_shared_devices, shared_devices

    assert shared_devices([["0", "1"], ["2", "0"]]) == ["0"] and shared_devices([["0"], ["1"]]) == []
    check_backend_on_shared_devices("auto", [["0"], ["1"]])  # own GPUs: NCCL is fine
    check_backend_on_shared_devices("gloo", [["0"], ["0"]])
    for backend in ("auto", "nccl"):
        with pytest.raises(ValueError, match=r"GPU\(s\) 0, .* refuses a communicator with two ranks on one GPU"):
            check_backend_on_shared_devices(backend, [["0"], ["0"]])
    with pytest.raises(ValueError, match=r"a replica group of 4 processes needs 4 GPUs, this node has 2"):
        group_devices(1, 4, ["0", "1"], share=True)


def test_the_syncer_evaluates_on_cpu_or_a_gpu_no_learner_uses():
    from titan_recover.recover.diloco.config import DilocoConfig
    from titan_recover.recover.placement import evaluation_device, group_devices

    visible = ["4", "5", "6", "7"]  # CUDA_VISIBLE_DEVICES=4,5,6,7: cuda:N is its N-th, in the syncer as here
    groups = group_devices(3, 1, visible)
    assert evaluation_device("cpu", groups, visible) is None
    assert evaluation_device("cuda:3", groups, visible) == "7"
    with pytest.raises(ValueError, match=r"'cuda:0' is replica group 0's GPU: .* use 'cpu' or a GPU no group uses "
                                         r"\(cuda:3\), or set recover.share_devices = true"):
        evaluation_device("cuda:0", groups, visible)
    with pytest.raises(ValueError, match=r"'cuda:4', but this node has 4 GPUs"):
        evaluation_device("cuda:4", groups, visible)
    assert evaluation_device("cuda:1", groups, visible, share=True) == "5"
    with pytest.raises(ValueError, match=r"use 'cpu' \(every GPU is a group's\)"):
        evaluation_device("cuda:1", group_devices(2, 2, visible), visible)
    for bad in ("cuda", "gpu:1", "cuda:x"):  # a bare "cuda" would be cuda:0, the first learner's
        with pytest.raises(ValueError, match="eval_device must be 'cpu' or 'cuda:N'"):
            DilocoConfig(eval_device=bad)


def test_the_syncer_timeout_is_checked(launcher):
    from titan_recover.recover.diloco.config import DilocoConfig

    with pytest.raises(ValueError, match=r"recover.diloco.syncer_timeout_s must be > 0, got 0"):
        DilocoConfig(syncer_timeout_s=0)
    code, _, err = launcher("train_configs/diloco.toml", "--recover.diloco.syncer_timeout_s", "0.05", "--dry-run")
    assert code == 2 and "syncer_timeout_s (0.05) must be larger than recover.heartbeat_interval_s (0.1)" in err, err


def test_the_launcher_checks_where_the_syncer_evaluates(launcher, monkeypatch):
    """On CPU a GPU cannot be named; on a (mocked) node with 4 GPUs and 3 learners of 1 process, the fourth GPU can,
    a learner's cannot."""
    from titan_recover import platform

    code, out, err = launcher("train_configs/diloco.toml", "--dry-run")
    assert code == 0 and "the syncer evaluates on cpu" in out, err
    code, _, err = launcher("train_configs/diloco.toml", "--recover.diloco.eval_device", "cuda:0", "--dry-run")
    assert code == 2 and "'cuda:0' needs a GPU node and this run is on CPU" in err, err
    monkeypatch.setattr(platform, "active_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    code, out, err = launcher("train_configs/diloco.toml", "--recover.diloco.eval_device", "cuda:3", "--dry-run")
    assert code == 0 and "the syncer evaluates on GPU 3" in out, err
    code, _, err = launcher("train_configs/diloco.toml", "--recover.diloco.eval_device", "cuda:0", "--dry-run")
    assert code == 2 and "'cuda:0' is replica group 0's GPU" in err, err


def test_the_launcher_splits_the_gpus_between_replica_groups(launcher, monkeypatch):
    """On a (mocked) node with 4 GPUs: 3 groups and a spare of 1 process get a GPU each; 3 groups of 2 processes
    are refused before any process starts, with the arithmetic, unless sharing is allowed."""
    from titan_recover import platform

    monkeypatch.setattr(platform, "active_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    code, out, err = launcher("train_configs/rejoin.toml", "--dry-run")
    assert code == 0, err
    assert "GPUs per group: 0: 0; 1: 1; 2: 2; 3: 3" in out
    code, _, err = launcher("train_configs/replicas.toml", "--recover.replicas", "3", "--dry-run")
    assert code == 2 and "3 replica groups x 2 processes need 6 GPUs, this node has 4" in err, err
    code, _, err = launcher("train_configs/replicas.toml", "--recover.replicas", "3", "--recover.share_devices",
                            "--dry-run")  # NCCL (auto on CUDA) refuses two ranks of a communicator on one GPU
    assert code == 2 and "GPU(s) 0,1" in err and 'set recover.ftpg.backend = "gloo"' in err, err
    code, out, err = launcher("train_configs/replicas.toml", "--recover.replicas", "3", "--recover.share_devices",
                              "--recover.ftpg.backend", "gloo", "--dry-run")
    assert code == 0 and "GPUs per group: 0: 0,1; 1: 2,3; 2: 0,1" in out, err


def test_a_job_of_many_nodes_without_replica_groups_uses_every_gpu_of_each_node(launcher, monkeypatch):
    """data_parallel_shard_degree = -1 follows the process count: on (mocked) nodes of 8 GPUs, 8 processes a node,
    not the node's count split over the nodes."""
    from titan_recover import platform

    monkeypatch.setattr(platform, "active_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # torchrun's run id on every node: a requeue keeps it
    code, out, err = launcher("train_configs/debug_model.toml", "--parallelism.data_parallel_shard_degree", "-1",
                              "--nnodes", "2", "--rdzv-endpoint", "head:29500", "--dry-run")
    assert code == 0 and "--nproc-per-node=8" in out and "--nnodes=2" in out, (out, err)
    assert "--rdzv-id=4242" in out, out
    code, out, err = launcher("train_configs/debug_model.toml", "--parallelism.data_parallel_shard_degree", "-1",
                              "--nnodes", "2", "--rdzv-endpoint", "head:29500", "--rdzv-id", "run-7", "--dry-run")
    assert code == 0 and "--rdzv-id=run-7" in out and "4242" not in out, (out, err)  # the user's id wins


def test_torchruns_restarts_meet_on_a_fresh_store_every_round_on_one_node_or_many():
    """A node whose workers torchrun restarts because another node's failed counts no restart, so the nodes' restart
    counts differ within a round: the launcher has torchrun give every round a fresh store of its own; a multi-node
    torchrun started by hand without it is refused at its start, not left to hang at the first restart."""
    from titan_recover.job_config import build_config
    from titan_recover.launch import torchrun_command
    from titan_recover.train import fresh_store_after_restart, SEPARATE_ROUND_STORES_ENV

    config = build_config("train_configs/debug_model.toml", ["--recover.max_restarts", "2"])
    for nnodes, options in ((1, {}), (2, {"--rdzv-endpoint": "head:29500"})):
        cmd, env = torchrun_command(config, options, None, [], 2, nnodes, 0)
        assert "--max-restarts=2" in cmd and env[SEPARATE_ROUND_STORES_ENV] == "1"

    by_hand = {"TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
               "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}
    with pytest.raises(RuntimeError, match=f"needs {SEPARATE_ROUND_STORES_ENV}=1"):
        fresh_store_after_restart(dict(by_hand))
    for fine in ({"TORCHELASTIC_MAX_RESTARTS": "0"}, {"TORCHELASTIC_USE_AGENT_STORE": "False"},
                 {"WORLD_SIZE": "8"}):  # no restarts, the launcher's separate stores, one node's first start
        environ = dict(by_hand, **fine)
        fresh_store_after_restart(environ)
        assert environ == dict(by_hand, **fine)


def test_a_run_id_is_refused_where_torchrun_would_not_use_it(launcher):
    """``--rdzv-id`` names a job of many nodes without replica groups (its snapshots' names): on one node torchrun
    runs standalone with a fresh id, and each replica group is a standalone torchrun, so the id would be dropped
    without a word."""
    code, _, err = launcher("train_configs/debug_model.toml", "--rdzv-id", "run-7", "--dry-run")
    assert code == 2 and "--rdzv-id names a job of many nodes" in err, err
    code, _, err = launcher("train_configs/replicas.toml", "--rdzv-id", "run-7", "--dry-run")
    assert code == 2 and "each replica group is a torchrun of its own node" in err, err


def test_a_replay_on_gpus_without_deterministic_kernels_is_refused_before_launch(launcher, monkeypatch):
    from titan_recover import platform

    code, _, err = launcher("train_configs/scout.toml", "--dry-run")
    assert code == 0, err  # CPU kernels are deterministic
    monkeypatch.setattr(platform, "active_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    code, _, err = launcher("train_configs/scout.toml", "--dry-run")
    assert code == 2 and "replay_interval = 5 on GPUs needs deterministic kernels" in err, err
    code, _, err = launcher("train_configs/scout.toml", "--debug.deterministic", "--dry-run")
    assert code == 0, err


def test_the_nccl_backend_on_a_cpu_job_is_refused_before_launch(launcher):
    code, _, err = launcher("train_configs/replicas.toml", "--recover.ftpg.backend", "nccl", "--dry-run")
    assert code == 2 and 'backend = "nccl" reduces on CUDA devices, and this job runs on cpu' in err, err


def test_a_replica_group_is_started_on_its_own_gpus(tmp_path):
    from titan_recover.recover.children import ReplicaSlot
    from titan_recover.recover.launcher import ReplicaJob

    config = build_config(None, ["--recover.replicas", "2", "--dump_folder", str(tmp_path)])
    started = []

    class Recording(ReplicaJob):
        def _start(self, cmd, env, prefix, death_signal=None, log=""):
            started.append((prefix, env))

    job = Recording(config, None, [], 2, 0, devices=[["0", "1"], ["2", "3"]])
    job.start_replica(ReplicaSlot(1, 0))
    job.start_replica(ReplicaSlot(0, 0))
    assert [(prefix, env["CUDA_VISIBLE_DEVICES"]) for prefix, env in started] == [
        ("[replica 1] ", "2,3"), ("[replica 0] ", "0,1")]
    cpu = Recording(config, None, [], 2, 0)
    cpu.start_replica(ReplicaSlot(0, 0))
    assert started[-1][1].get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # no split on CPU


def test_the_verdict_of_a_committed_job_stands_after_a_late_signal(tmp_path, capsys):
    """A SIGTERM that arrives once the coordinator recorded the budget committed (the groups were closing) does not
    turn the job's exit code into 128 + 15; before that verdict it does, and a stopped job says so."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.launcher import ReplicaJob

    config = build_config(None, ["--recover.replicas", "2", "--dump_folder", str(tmp_path)])
    job = ReplicaJob(config, None, [], 1, 0)
    job.store = HashStore()
    job.slots = [SimpleNamespace(proc=SimpleNamespace(returncode=code)) for code in (0, -15)]
    job.stopped_by = signal.SIGTERM
    assert job.result() == 128 + signal.SIGTERM
    job.stopped_by = signal.SIGHUP  # the terminal closed: said so, with what to do
    assert job.result() == 128 + signal.SIGHUP
    assert "stopped by SIGHUP: the terminal or SSH session that ran the launcher closed (run it under nohup" in \
        capsys.readouterr().err
    job.stopped_by = signal.SIGTERM
    job.store.set(GroupKeys.FINISHED, "trained")
    assert job.result() == 0
    job.stopped_by = None
    job.store.set(GroupKeys.FINISHED, "stopped")
    assert job.result() == 1
    # a stop asked for by a signal to any node's launcher: every node exits 128 + that signal
    job.store.set(GroupKeys.STOP_SIGNAL, str(int(signal.SIGTERM)))
    assert job.result() == 128 + signal.SIGTERM
    job.stop_requested = signal.SIGUSR1  # this node's own request
    assert job.result() == 128 + signal.SIGUSR1


def test_a_launchers_stop_leaves_failed_and_leaving_groups_out_of_the_stops_epoch(tmp_path):
    """The stop's epoch names who may write its checkpoint (the lowest member that holds the last committed
    state): a member the coordinator has judged failed, or a group known to be leaving, is left out of it, so the
    writer is one that stays. The epoch's fault flag is raised with the stop."""
    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.protocol import CoordinatorState, decode_members, encode_members
    from titan_recover.recover.launcher import ReplicaJob

    config = build_config(None, ["--recover.replicas", "4", "--dump_folder", str(tmp_path)])
    job = ReplicaJob(config, None, [], 1, 0)
    job.store = HashStore()
    job.store.set(GroupKeys.members(0), encode_members((0, 1, 2, 3), "all replicas registered"))
    job.store.set(GroupKeys.EPOCH, "0")
    job.store.set(GroupKeys.COORDINATOR_STATE, CoordinatorState(0, (0, 1, 2, 3), "", excluded=(0,)).encode())
    job.stop_job("stop requested (a test)", leaving=frozenset({2}))
    assert decode_members(job.store.get(GroupKeys.members(1))) == ((1, 3), "stop requested (a test)")
    assert job.store.get(GroupKeys.STOP) == b"stop requested (a test)" and job.store.check([GroupKeys.fault(0)])


def test_a_replica_group_jobs_processes_run_without_nccls_heartbeat_monitor(tmp_path, monkeypatch):
    """On GPUs, NCCL's heartbeat monitor of a process's first group (TorchTitan's) ends the process minutes after any
    group's watchdog saw an error: a fault-tolerant group's abandoned pieces after a peer died would kill the
    survivors. Every process of a replica-group job gets it off, whatever the environment said."""
    from titan_recover.recover.ftpg import nccl
    from titan_recover.recover.launcher import (NCCL_ASYNC_ERROR_HANDLING_ENV, NCCL_MONITORING_ENV,
                                                NCCL_NONBLOCKING_TIMEOUT_ENV, ReplicaJob)

    monkeypatch.setenv(NCCL_MONITORING_ENV, "1")
    monkeypatch.delenv(NCCL_NONBLOCKING_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(NCCL_ASYNC_ERROR_HANDLING_ENV, raising=False)
    config = build_config(None, ["--recover.replicas", "2", "--dump_folder", str(tmp_path),
                                 "--recover.collective_timeout_s", "45"])
    env = ReplicaJob(config, None, [], 1, 0).base_env
    assert env[NCCL_MONITORING_ENV] == "0"
    assert env[NCCL_NONBLOCKING_TIMEOUT_ENV] == "45"  # before any communicator: torch reads it once per process
    # present from the start (torch's default), so the nccl group's switch replaces it rather than adding it
    assert env[NCCL_ASYNC_ERROR_HANDLING_ENV] == "3" and nccl.ASYNC_ERROR_HANDLING_ENV == NCCL_ASYNC_ERROR_HANDLING_ENV
    monkeypatch.setenv(NCCL_NONBLOCKING_TIMEOUT_ENV, "600")  # the user's choice stands
    assert ReplicaJob(config, None, [], 1, 0).base_env[NCCL_NONBLOCKING_TIMEOUT_ENV] == "600"


def test_a_group_that_crashed_as_the_last_one_running_is_still_restarted(tmp_path):
    """The watch goes on while a group that ended with an error has restarts left (it may have been the last one
    running when it ended), not once the job is over, and not without restarts."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.launcher import ReplicaJob

    config = build_config(None, ["--recover.replicas", "2", "--dump_folder", str(tmp_path)])
    job = ReplicaJob(config, None, [], 1, 0)
    job.store = HashStore()
    crashed = SimpleNamespace(proc=SimpleNamespace(poll=lambda: 1), restarts_left=1, index=1)
    ended = SimpleNamespace(proc=SimpleNamespace(poll=lambda: 0), restarts_left=1, index=0)
    job.slots = [ended, crashed]
    assert job.restart_pending()
    crashed.restarts_left = 0
    assert not job.restart_pending()
    crashed.restarts_left = 1
    job.store.set(GroupKeys.FINISHED, "trained")
    assert not job.restart_pending()


def test_a_pass_of_the_launchers_loop_reads_its_keys_once_and_reads_again_after_a_stop(tmp_path):
    """The questions a pass of the launcher's loop asks (over or stopping, a cold restart, each group's drop, the
    coordinator's beat) are answered from one read at its start (one request on etcd: tests/test_stores.py); a
    change in the store meanwhile is seen at the next pass, except the stop the launcher writes itself, which the
    rest of its pass reads."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.launcher import ReplicaJob

    class Counting(HashStore):
        reads = 0

        def check(self, keys):
            Counting.reads += 1
            return super().check(keys)

    config = build_config(None, ["--recover.replicas", "2", "--dump_folder", str(tmp_path)])
    job = ReplicaJob(config, None, [], 1, 0)
    job.store = Counting()
    job.slots = [SimpleNamespace(index=0), SimpleNamespace(index=1)]
    job.store.set(GroupKeys.dropped(1), "2|1700000000.5")
    job.store.set(GroupKeys.COLD_RESTART, "3")
    job._pass()
    reads = Counting.reads
    job.store.set(GroupKeys.FINISHED, "trained")  # written after the pass read: the next pass sees it
    assert job.job_state() == (False, {0: None, 1: 2})
    assert job.cold_restart_due() == 3 and job._coordinator_beat() == b""
    assert Counting.reads == reads  # every answer from the pass's read
    job._pass()
    assert job.job_over()
    job.store.delete_key(GroupKeys.FINISHED)
    job._pass()
    job.stop_job("stopping for the test")
    assert job.job_over()  # the launcher's own stop, within the pass that wrote it


def test_a_cold_restart_is_published_with_its_step_and_every_group_is_started_to_load_it(tmp_path, monkeypatch):
    """Losing every replica: the coordinator writes the checkpoint step it chose ahead (in its state) and before
    the cold restart itself; each node's launcher starts every group it supervises with that step to load, and
    names each start as the founder of the next epoch."""
    from torch.distributed import HashStore

    from titan_recover.recover.config import RecoverConfig
    from titan_recover.recover.groups.coordinator import Coordinator
    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.member import FOUNDING_STEP_ENV
    from titan_recover.recover.groups.protocol import CoordinatorState
    from titan_recover.recover.children import ReplicaSlot
    from titan_recover.recover.launcher import ReplicaJob

    class Order(HashStore):
        written = []

        def set(self, key, value):
            Order.written.append(key)
            return super().set(key, value)

    store = Order()
    coordinator = Coordinator(RecoverConfig(replicas=2), store, replicas=2, ranks_per_replica=1, run_dir=str(tmp_path))
    coordinator._publish(3, (), (0, 1), "every replica lost", timing={}, cold=4)
    assert CoordinatorState.decode(store.get(GroupKeys.COORDINATOR_STATE)).durable_step == 4
    written = Order.written
    assert written.index(GroupKeys.founding_step(3)) < written.index(GroupKeys.COLD_RESTART)
    assert store.get(GroupKeys.founding_step(3)) == b"4" and store.get(GroupKeys.COLD_RESTART) == b"3"
    assert any(GroupKeys.founding_step(3).startswith(prefix) for prefix in GroupKeys.of_epoch(3)[1])  # collected

    config = build_config(None, ["--recover.replicas", "2", "--dump_folder", str(tmp_path)])
    job = ReplicaJob(config, None, [], 1, 0)
    job.store, started = store, []
    job.slots = [ReplicaSlot(0, restarts_left=1), ReplicaSlot(1, restarts_left=0)]
    for slot in job.slots:
        slot.incarnation = job.next_start(slot.index)  # their first starts
    monkeypatch.setattr(job, "_start", lambda cmd, env, *args, **kwargs: started.append(env))
    job._pass()
    assert job.restart_every_group() and not job.restart_every_group()  # once per cold restart
    assert [env[FOUNDING_STEP_ENV] for env in started if "TITAN_RECOVER_REPLICA" in env] == ["4"]
    assert store.get(GroupKeys.founding(3, 0)) == b"1" and store.get(GroupKeys.founding(3, 1)) == b"-1"


def test_a_launcher_replacing_a_lost_nodes_numbers_its_groups_starts_after_the_lost_ones(tmp_path, monkeypatch):
    """Every start of a group takes its number from the job's counter, whichever node's launcher makes it: node 1's
    launcher starts group 2 (start 0) and restarts it (start 1), then is lost; the launcher that replaces it starts
    the group as start 2, never as a start the job has seen (which would be taken for the lost one: ended as
    dropped, refused admission)."""
    from torch.distributed import HashStore

    from titan_recover.recover.groups.keys import GroupKeys
    from titan_recover.recover.groups.member import INCARNATION_ENV
    from titan_recover.recover.launcher import ReplicaJob
    from titan_recover.recover.nodes import NodePlan

    store, started = HashStore(), []
    config = build_config(None, ["--recover.replicas", "3", "--recover.max_restarts", "1", "--dump_folder", str(tmp_path)])

    def node_1() -> ReplicaJob:
        job = ReplicaJob(config, None, [], 1, 0)
        job.plan, job.store = NodePlan(2, 1, range(2, 3)), store
        monkeypatch.setattr(job, "_start", lambda cmd, env, *args, **kwargs: started.append(env) or _Exited())
        return job

    lost = node_1()
    lost.start_replicas()
    lost.restart_if_crashed(lost.slots[0], over=False)
    replacement = node_1()
    replacement.start_replicas()
    assert [env[INCARNATION_ENV] for env in started] == ["0", "1", "2"]
    assert replacement.slots[0].incarnation == 2 and int(store.add(GroupKeys.starts(2), 0)) == 3


def test_a_launcher_whose_node_key_names_another_launcher_ends(tmp_path):
    """Many nodes: each launcher (node 0's too on etcd) names itself in its node's key, and a launcher started in its
    place overwrites it. A launcher that finds another named there (it was stopped or cut off meanwhile) ends with
    its own processes only (they carry its process id), never the replacement's on the same host."""
    from torch.distributed import HashStore

    from titan_recover.recover.children import LAUNCHER_ENV
    from titan_recover.recover.job_store import launcher_identity, NodeReplaced
    from titan_recover.recover.launcher import ReplicaJob
    from titan_recover.recover.nodes import NodeKeys, NodePlan

    config = build_config(None, ["--recover.replicas", "3", "--dump_folder", str(tmp_path)])
    job = ReplicaJob(config, None, [], 1, 0, plan=NodePlan(2, 1, range(2, 3)))
    job.store = HashStore()
    assert job.owns_node_key and job.base_env[LAUNCHER_ENV] == str(os.getpid())
    job.store.set(NodeKeys.launcher(1), launcher_identity())
    job._pass()  # its own name: it carries on
    job.store.set(NodeKeys.launcher(1), "spare-host/pid42")
    with pytest.raises(NodeReplaced, match=r"node 1's launcher was replaced by spare-host/pid42 \(this one, .*/pid\d+, "
                                           r"was stopped or cut off meanwhile\)"):
        job._pass()
    node0 = ReplicaJob(config, None, [], 1, 0, plan=NodePlan(2, 0, range(0, 2)))
    assert not node0.owns_node_key  # it hosts the embedded store: nobody replaces it


class _Exited:
    """A started process that already exited with an error (for a launcher's restart)."""

    returncode, pid = 1, -1

    def poll(self) -> int:
        return self.returncode


def test_a_taken_port_for_the_jobs_store_is_named_as_such(tmp_path):
    from torch.distributed import TCPStore

    from titan_recover.recover.job_store import NoJobStore
    from titan_recover.recover.launcher import ReplicaJob

    taken = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    config = build_config(None, ["--recover.replicas", "2", "--dump_folder", str(tmp_path),
                                 "--recover.coordinator_port", str(taken.port)])
    job = ReplicaJob(config, None, [], 1, 0)
    with pytest.raises(NoJobStore, match=rf"could not host the job's store on port {taken.port} .*is another job "
                                         r"using it\? Choose a free port \(recover.coordinator_port\)"):
        job.host_store()


def test_a_seed_checkpoint_is_refused_where_torchtitan_refuses_it(launcher):
    """By the launcher before any process starts (exit 2), and by a rank started another way (torchrun itself)."""
    from titan_recover.config.validate import check_seed_checkpoint

    seed = ["--model.flavor", "tiny", "--checkpoint.create_seed_checkpoint"]
    check_seed_checkpoint(build_config(None, [*seed, "--checkpoint.enable"]), 1)  # one process, checkpoints on
    with pytest.raises(ValueError, match="needs a single process .* got 2"):
        check_seed_checkpoint(build_config(None, [*seed, "--checkpoint.enable"]), 2)
    with pytest.raises(ValueError, match="needs checkpoint.enable = true"):
        check_seed_checkpoint(build_config(None, seed), 1)
    with pytest.raises(ValueError, match="set recover.replicas = 1"):
        check_seed_checkpoint(build_config(str(ROOT / "train_configs/replicas.toml"), [*seed, "--checkpoint.enable"]), 1)
    one = ["--parallelism.data_parallel_shard_degree", "1"]
    code, out, err = launcher(*seed, *one, "--checkpoint.enable", "--dry-run")
    assert code == 0, err
    code, _, err = launcher(*seed, *one, "--dry-run")
    assert code == 2 and "needs checkpoint.enable = true" in err, err
    code, _, err = launcher(*seed, "--checkpoint.enable", "--nproc-per-node", "2", "--dry-run")  # shard degree -1
    assert code == 2 and "needs a single process (the model unsharded), got 2" in err, err
    code, _, err = launcher("train_configs/replicas.toml", *seed, "--checkpoint.enable", "--dry-run")
    assert code == 2 and "set recover.replicas = 1" in err, err


def test_a_rank_that_loses_a_store_says_so_in_one_line_and_returns_1_with_its_trainer_closed(capsys):
    """``train.run`` with a trainer whose training raises what a lost store raises (the bounded store's error) ends
    with exit code 1, the trainer closed, the traceback and then one line naming the rank, its replica and the
    reason; the protocol's orderly stop keeps its own code; any other error is not taken for a lost connection."""
    from types import SimpleNamespace

    from torch.distributed import DistNetworkError

    from titan_recover.recover.groups.member import REPLICA_ENV
    from titan_recover.train import store_lost, run

    lost = "no answer to a check from 10.0.0.1:29500 in 60.0 s: its host is gone or this one is cut off from it"

    class Trainer:
        def __init__(self, error):
            self.error, self.closed = error, False

        def train(self):
            raise self.error

        def close(self):
            self.closed = True

    def config(trainer):
        return SimpleNamespace(build=lambda: trainer, checkpoint=SimpleNamespace(create_seed_checkpoint=False))

    trainer = Trainer(DistNetworkError(lost))
    assert run(config(trainer)) == 1 and trainer.closed
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" in err[0] and err[-2] == f"torch.distributed.DistNetworkError: {lost}"
    assert err[-1].startswith("[titan_recover] rank ") and f"({lost}); ending this rank (exit 1)" in err[-1]
    assert store_lost(DistNetworkError(lost), {"RANK": "3", REPLICA_ENV: "2"}).startswith(
        "[titan_recover] rank 3 of replica 2: lost its connection to a store (no answer to a check")

    trainer = Trainer(SystemExit(2))
    assert run(config(trainer)) == 2 and trainer.closed
    trainer = Trainer(RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        run(config(trainer))
    assert trainer.closed and "lost its connection" not in capsys.readouterr().err

NONSENSE = [
    (("--training.steps", "0"), "training.steps must be >= 1"),
    (("--training.seq_len", "0"), "training.seq_len must be >= 1"),
    (("--training.max_norm", "-1"), "training.max_norm must be > 0"),
    (("--training.gc_freq", "0"), "training.gc_freq must be >= 1"),
    (("--lr_scheduler.warmup_steps", "-1"), "lr_scheduler.warmup_steps must be >= 0"),
    (("--metrics.log_freq", "0"), "metrics.log_freq must be >= 1"),
    (("--metrics.enable_wandb", "--metrics.wandb_project", " "), "metrics.wandb_project is empty"),
    (("--dump_folder", ""), "dump_folder is empty"),
    (("--recover.coordinator_port", "70000"), "recover.coordinator_port must be a TCP port"),
    (("--checkpoint.initial_load_model_only",), "has no effect without checkpoint.initial_load_path"),
]


def test_nonsense_values_are_refused_with_what_is_wrong():
    for overrides, message in NONSENSE:
        with pytest.raises(ConfigError, match=message.replace(".", "\\.")):
            build_config(None, ["--model.flavor", "tiny", *overrides])


def test_negative_steps_fail_in_the_launcher_before_any_process(launcher):
    code, _, err = launcher("train_configs/debug_model.toml", "--training.steps", "-5")
    assert code == 2, err
    assert "titan_recover: config error: training.steps must be >= 1" in err and "got -5" in err


def test_building_the_config_warns_about_nothing_the_user_did_not_set(caplog, tmp_path):
    """TorchTitan's checkpoint default ``initial_load_model_only = True`` is resolved by the project's section (off
    without a path, where it means nothing), so no start warns about it; with a path it is TorchTitan's default."""
    caplog.set_level("WARNING")
    config = build_config("train_configs/rejoin.toml")
    assert not [r for r in caplog.records if r.levelname == "WARNING"], [r.getMessage() for r in caplog.records]
    assert config.checkpoint.initial_load_model_only is False
    with_path = build_config(None, ["--model.flavor", "tiny", "--checkpoint.initial_load_path", str(tmp_path)])
    assert with_path.checkpoint.initial_load_model_only is True
    explicit = build_config(None, ["--model.flavor", "tiny", "--checkpoint.initial_load_path", str(tmp_path),
                                   "--checkpoint.no_initial_load_model_only"])
    assert explicit.checkpoint.initial_load_model_only is False


def test_reference_is_planned_as_a_sibling_run_without_faults(launcher):
    code, out, err = launcher("train_configs/rejoin.toml", "--reference", "--dry-run")
    assert code == 0, err
    assert "then the reference into outputs/rejoin-reference" in out and "--chaos.faults '[]'" in out
    code, _, err = launcher("train_configs/rejoin.toml", "--reference", "--nnodes", "2", "--node-rank", "0",
                           "--rdzv-endpoint", "127.0.0.1:29999")
    assert code == 2 and "--reference runs the job and its reference one after the other on one node" in err


def test_what_the_ranks_would_find_wrong_once_started_is_refused_before_anything_starts(launcher, tmp_path):
    """Each of these passed the launcher's checks and then failed in the ranks (a traceback after torchrun started
    them, one after a first step's work), or, for a fault aimed at nothing, ran without it: now exit 2 with the
    arithmetic, before any process starts."""
    tiny = ["train_configs/debug_model.toml", "--model.flavor", "tiny", "--dump_folder", str(tmp_path / "run")]
    one = [*tiny, "--parallelism.data_parallel_shard_degree", "1"]
    refused = {
        "tensor_parallel_degree (3) must divide n_heads (4)": [
            *one, "--parallelism.tensor_parallel_degree", "3", "--training.seq_len", "258"],
        "exceeds attention RoPE maximum supported sequence length 4096": [*one, "--training.seq_len", "8192"],
        "training.seq_len (255) must be divisible by 2": [
            *one, "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "255"],
        "Number of stages (6) cannot be greater than effective layers (4)": [
            *one, "--parallelism.pipeline_parallel_degree", "3"],
        "needs at least as many microbatches as stages (2)": [
            "train_configs/pp.toml", "--model.flavor", "tiny", "--parallelism.pipeline_parallel_microbatch_size", "2"],
        "checkpoint.async_mode pins host memory": [
            *tiny, "--checkpoint.enable", "--checkpoint.async_mode", "async_with_pinned_mem"],
        "training.enable_cpu_offload offloads": [*tiny, "--training.enable_cpu_offload"],
        "parallelism.enable_fsdp_symm_mem allocates": [*tiny, "--parallelism.enable_fsdp_symm_mem"],
        "parallelism.context_parallel_degree needs FlexAttention": [
            *one, "--parallelism.context_parallel_degree", "2"],
        "the job has 2 replica group(s) (replicas + spares), numbered from 0, so it would never fire": [
            "train_configs/replicas.toml", "--chaos.faults", '[{kind = "kill", replica = 5, rank = 0, step = 1}]'],
        "a replica group has 2 rank(s)": [
            "train_configs/replicas.toml", "--chaos.faults", '[{kind = "kill", replica = 1, rank = 7, step = 1}]'],
        "the run trains 10 step(s)": [*tiny, "--training.steps", "10", "--chaos.faults",
                                      '[{kind = "raise", step = 50}]'],
        "checkpoint.initial_load_path '/nonexistent/step-0' is not a folder": [
            *tiny, "--checkpoint.enable", "--checkpoint.initial_load_path", "/nonexistent/step-0"],
        "checkpoint.load_step = 5 but there is no": [*tiny, "--checkpoint.enable", "--checkpoint.load_step", "5"],
        "hf_assets_path '/nonexistent' is not a folder": [*tiny, "--hf_assets_path", "/nonexistent"],
        "pipeline_parallel_schedule_csv '/nonexistent.csv' is not a file": [
            "train_configs/pp.toml", "--model.flavor", "tiny", "--parallelism.pipeline_parallel_schedule_csv",
            "/nonexistent.csv"],
    }
    for message, argv in refused.items():
        code, _, err = launcher(*argv, "--dry-run")
        assert code == 2 and message in err, (message, err)
    code, _, err = launcher(*one, "--parallelism.tensor_parallel_degree", "2", "--dry-run")  # fits: accepted
    assert code == 0, err
