"""Launcher behind ``./run_train.sh``: check the config, prepare data, then hand over to torchrun.

    python -m titan_recover.launch [CONFIG.toml] [launcher options] [--section.key value ...]

Launcher options (everything else is a config override):

    --help                print this help and exit
    --print-config        print the fully resolved config as TOML and exit
    --list-models         list registered models and flavors and exit
    --nproc-per-node N    processes on this node (default: the product of the config's parallel degrees); with
                          replica groups: the processes of one group
    --nnodes N            nodes in the job (default 1; with more, also pass --rdzv-endpoint and --node-rank)
    --rdzv-endpoint H:P   without replica groups: torchrun's c10d rendezvous address. With replica groups: where
                          node 0's launcher hosts the job's store (a free port of node 0, reachable from every
                          node; not needed with recover.store = "etcd://...")
    --node-rank R         this node's rank (0 ... N-1); with replica groups node 0 hosts the job's store and runs
                          the coordinator, and node R runs its block of the replica groups
    --rdzv-id ID          without replica groups, on many nodes: torchrun's run id, the same on every node (default
                          $SLURM_JOB_ID, else torchrun's "none"); names the job's in-memory snapshots (docs/phoenix.md)
    --dry-run             do every check, print the torchrun command (or this node's groups), start nothing
    --reference           also run the same config without [chaos] into <dump_folder>-reference (or reuse the one
                          there, if it ran the same resolved config), then print the largest per-step difference
                          of the loss and write the overlay, <dump_folder>/reference.png (one node)
    --verbose             with replica groups: every process's full output on the console, prefixed (default: one
                          line per committed step and per resilience event; each process's output in
                          <run>/logs/)

With replica groups ([recover] replicas >= 2) run one launcher per node, each with the same config: each replica
group runs on one node, node R a contiguous block of them (docs/deploy.md "Running on many nodes").

Every check that can fail does so here, before any process starts: unknown keys, wrong types, parallel degrees
that do not multiply to the process count, batch sizes that do not divide, data that does not fit the model.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

from titan_recover.config.apply import ConfigError

_FLAGS = {"--help", "-h", "--print-config", "--list-models", "--dry-run", "--verbose", "--reference"}
_OPTIONS = {"--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--node-rank", "--rdzv-id"}


def split_args(argv: list[str]) -> tuple[str | None, dict[str, str | bool], list[str]]:
    """Split into (toml path, launcher options, config overrides)."""
    toml_path = None
    if argv and not argv[0].startswith("-"):
        toml_path, argv = argv[0], argv[1:]
    options: dict[str, str | bool] = {}
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, sep, value = token.partition("=")
        if name in _FLAGS:
            options[name] = True
        elif name in _OPTIONS:
            if not sep:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                i += 1
                value = argv[i]
            options[name] = value
        else:
            overrides.append(token)
        i += 1
    return toml_path, options, overrides


def _int_option(options: dict, name: str, default: int) -> int:
    raw = options.get(name, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")
    return value


def _default_nproc(config, device: str) -> int:
    p = config.parallelism
    product = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
    product *= p.pipeline_parallel_degree
    if p.data_parallel_shard_degree != -1:
        return product * p.data_parallel_shard_degree
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    raise ConfigError(
        "parallelism.data_parallel_shard_degree = -1 (infer from the process count) but no process count was "
        "given: set the degree in the TOML or pass --nproc-per-node N"
    )


def check_replica_layout(config, layout, nnodes: int) -> None:
    if layout.dp_replicate != 1:
        raise ConfigError(
            f"[recover] replicas = {config.recover.replicas} replaces data parallel replication: set "
            f"parallelism.data_parallel_replicate_degree = 1 (got {layout.dp_replicate}); each replica group is "
            "sharded by the remaining degrees"
        )
    if config.recover.diloco_mode and config.checkpoint.enable:
        raise ConfigError(
            "[recover] mode = \"diloco\" keeps the job's state in the syncer (its checkpoint every "
            "recover.diloco.checkpoint_interval_s) and a restarted learner pulls the global model: set "
            "checkpoint.enable = false"
        )


def check_replay_determinism(config, device: str) -> None:
    """The replay vote compares two replicas' gradients of the same microbatch bit for bit: on a GPU only
    deterministic kernels give the same bits (atomics in a backward do not), so a replay there without them would
    evict healthy replicas or stop the job at its first replay."""
    if device == "cuda" and config.recover.localize.replay_interval > 0 and not config.debug.deterministic:
        raise ConfigError(
            f"[recover.localize] replay_interval = {config.recover.localize.replay_interval} on GPUs needs "
            "deterministic kernels (the replayed microbatch must give the same bits on two replicas): set "
            "debug.deterministic = true, or replay_interval = 0"
        )


def node_plan(config, options: dict):
    """This node's part of a replica-group job (``recover/nodes.py``): ``--nnodes``, ``--node-rank`` and
    ``--rdzv-endpoint`` checked against the config; ConfigError saying what is wrong."""
    from titan_recover.recover.nodes import node_groups, NodePlan, parse_endpoint

    recover = config.recover
    nnodes = _int_option(options, "--nnodes", 1)
    if nnodes > 1 and "--node-rank" not in options:
        raise ConfigError(f"--nnodes {nnodes} with replica groups needs --node-rank R (0 ... {nnodes - 1}): node 0 "
                          "hosts the job's store and runs the coordinator")
    try:
        rank = int(options.get("--node-rank", 0))
    except ValueError:
        raise ConfigError(f"--node-rank must be an integer, got {options['--node-rank']!r}") from None
    endpoint = None
    if "--rdzv-endpoint" in options:
        try:
            endpoint = parse_endpoint(options["--rdzv-endpoint"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif nnodes > 1 and not recover.store:
        raise ConfigError(f"--nnodes {nnodes} with replica groups needs --rdzv-endpoint HOST:PORT: where node 0's "
                          "launcher hosts the job's store (node 0's address and a free port every node can reach), "
                          "or an etcd cluster as recover.store")
    try:
        return NodePlan(nnodes, rank, node_groups(recover.groups, nnodes, rank), endpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def group_placement(config, nproc: int, device: str, groups: int | None = None) -> list[list[str]] | None:
    """The GPUs of each replica group on this node (None on CPU); refuses too few GPUs before any process starts.
    ``groups``: the replica groups this node runs (default: all of the job's)."""
    if device != "cuda":
        if config.recover.ftpg.backend == "nccl":
            raise ConfigError(f"[recover.ftpg] backend = \"nccl\" reduces on CUDA devices, and this job runs on "
                              f"{device}: use backend = \"auto\" (nccl on CUDA, gloo elsewhere) or \"gloo\"")
        return None
    import torch

    from titan_recover.recover.placement import check_backend_on_shared_devices, group_devices, visible_devices

    recover = config.recover
    try:
        if groups is not None and groups != recover.groups:  # one node's block of the groups
            devices = group_devices(groups, nproc, visible_devices(torch.cuda.device_count),
                                    share=recover.share_devices)
        else:
            devices = group_devices(recover.groups, nproc, visible_devices(torch.cuda.device_count),
                                    share=recover.share_devices, spares=recover.spares)
        if not recover.diloco_mode:  # learners reduce nothing across each other
            check_backend_on_shared_devices(recover.ftpg.backend, devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return devices


def evaluation_placement(config, devices: list[list[str]] | None) -> str:
    """Where the diloco syncer evaluates the global model (``[recover.diloco] eval_device``), checked against the
    replica groups' GPUs (``devices``, None on CPU) before any process starts; ``"cpu"`` or ``"GPU <id>"``."""
    recover = config.recover
    eval_device = recover.diloco.eval_device
    if not recover.diloco_mode or eval_device == "cpu":
        return "cpu"
    if devices is None:
        raise ConfigError(f"recover.diloco.eval_device = {eval_device!r} needs a GPU node and this run is on CPU: "
                          "use 'cpu'")
    import torch

    from titan_recover.recover.placement import evaluation_device, visible_devices

    try:
        device = evaluation_device(eval_device, devices, visible_devices(torch.cuda.device_count),
                                   share=recover.share_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return f"GPU {device}"


def checkpoint_restart_job(config, toml_path: str | None, overrides: list[str]):
    """``[recover] mode = "checkpoint_restart"``: the same job as the replica groups, as the baseline runs it: one
    torchrun whose replicated data-parallel dimension is the replica groups (same global batch, same microbatch
    ids), TorchTitan's checkpoints, and torchrun restarting every process on any failure. Returns the job's config
    and the overrides its processes get."""
    from titan_recover.job_config import build_config

    recover = config.recover
    if config.parallelism.data_parallel_replicate_degree != 1:
        raise ConfigError(
            f"[recover] mode = \"checkpoint_restart\" makes the {recover.replicas} replica groups the replicated "
            "data-parallel dimension: set parallelism.data_parallel_replicate_degree = 1 (got "
            f"{config.parallelism.data_parallel_replicate_degree})"
        )
    if not config.checkpoint.enable:
        raise ConfigError("[recover] mode = \"checkpoint_restart\" resumes from TorchTitan's checkpoints: set "
                          "checkpoint.enable = true (and checkpoint.interval, checkpoint.async_mode = \"async\")")
    if recover.max_restarts < 1:
        raise ConfigError("[recover] mode = \"checkpoint_restart\" survives as many failures as torchrun may restart "
                          "the job: set recover.max_restarts >= 1")
    overrides = [*overrides, "--parallelism.data_parallel_replicate_degree", str(recover.replicas)]
    return build_config(toml_path, overrides), overrides


def prepare_data(config) -> None:
    from titan_recover.config.validate import check_model_data
    from titan_recover.data.addressable import TokenFileMeta
    from titan_recover.data.prepare import DEFAULT_DATA_DIR, prepare

    path = config.dataloader.dataset_path
    if not path:
        return
    if not os.path.exists(os.path.join(path, "meta.json")):
        if os.path.normpath(path) != os.path.normpath(DEFAULT_DATA_DIR):
            raise ConfigError(
                f"dataloader.dataset_path {path!r} holds no prepared data; run "
                f"python -m titan_recover.data.prepare --input YOUR_FILES --out {path}"
            )
        print(f"[titan_recover] preparing the default dataset in {path} (once)", file=sys.stderr)
        prepare(path)
    check_model_data(config.model_spec.model.vocab_size, TokenFileMeta.read(path).vocab_size, path)


def list_models() -> None:
    from titan_recover import platform

    platform.activate()
    from titan_recover.models import registered_models

    for m in registered_models():
        print(f"{m.name:8s} {m.flavor:12s} {m.hardware}")


def load_config(toml_path: str | None, overrides: list[str]):
    """The run's config and the overrides its processes get (checkpoint-restart mode adds its own)."""
    from titan_recover.job_config import build_config

    config = build_config(toml_path, overrides)
    if config.recover.checkpoint_restart_mode:
        config, overrides = checkpoint_restart_job(config, toml_path, overrides)
    return config, overrides


def check_fits(config, layout, device: str, *, groups: int, ranks: int) -> None:
    """What the ranks would find wrong only once started: a seed checkpoint's conditions, the model against the
    layout, the pipeline, options a CPU cannot run, faults aimed at nothing (config/validate.py)."""
    from titan_recover.config.validate import (check_cpu_options, check_fault_targets, check_model_fits,
                                               check_pipeline, check_seed_checkpoint)

    check_seed_checkpoint(config, layout.world_size)  # (with replica groups refused whatever the count)
    check_model_fits(config, layout)
    check_pipeline(config, layout)
    check_cpu_options(config, device)
    check_fault_targets(config, groups, ranks)


def check_job(config, options: dict):
    """Process counts and layout against the config; returns (processes on this node, nodes, layout)."""
    from titan_recover.config.validate import check_batch, resolve_layout
    from titan_recover.platform import active_device

    device = active_device()
    if config.recover.preemption_grace_s and not config.checkpoint.enable:
        raise ConfigError(f"recover.preemption_grace_s = {config.recover.preemption_grace_s} stops the job with a "
                          "checkpoint at SIGTERM: set checkpoint.enable = true, or preemption_grace_s = 0")
    if not config.recover.diloco_mode and any(f.phase == "block_end" for f in config.chaos.faults):
        raise ConfigError('chaos fault phase "block_end" (between two blocks of a diloco learner) never comes in '
                          f'mode {config.recover.resolved_mode!r}: use another phase, or recover.mode = "diloco"')
    if config.recover.resolved_mode != "sync" and any(f.phase == "stop_save" for f in config.chaos.faults):
        raise ConfigError('chaos fault phase "stop_save" (before a replica group writes a stop\'s checkpoint) never '
                          f'comes in mode {config.recover.resolved_mode!r}: use replica groups (recover.replicas > 1 '
                          'in recover.mode = "sync")')
    nnodes = _int_option(options, "--nnodes", 1)
    nproc = _int_option(options, "--nproc-per-node", 0) if "--nproc-per-node" in options else None
    if config.recover.enabled:  # a replica group's processes all run on its node
        nproc = nproc or _default_nproc(config, device)
        layout = resolve_layout(config.parallelism, nproc)
        check_batch(config.training, config.parallelism, layout)
        check_replica_layout(config, layout, nnodes)
        check_fits(config, layout, device, groups=config.recover.replicas + config.recover.spares, ranks=nproc)
        check_replay_determinism(config, device)
        if "--rdzv-id" in options:
            raise ConfigError("--rdzv-id is torchrun's run id of a job without replica groups; each replica group "
                              "is a torchrun of its own node (--standalone): drop --rdzv-id")
        plan = node_plan(config, options)
        evaluation_placement(config, group_placement(config, nproc, device, len(plan.groups)))
        return nproc, nnodes, layout
    if config.recover.store:
        print(f"[titan_recover] warning: recover.store = {config.recover.store!r} has no effect without replica "
              "groups (recover.replicas >= 2, mode sync or diloco)", file=sys.stderr)
    if nproc is None and config.parallelism.data_parallel_shard_degree == -1:
        nproc = _default_nproc(config, device)  # every device of this node (the shard degree follows the count)
    elif nproc is None:
        total = _default_nproc(config, device)
        if total % nnodes:
            raise ConfigError(f"{total} processes cannot be spread evenly over --nnodes {nnodes}")
        nproc = total // nnodes
    layout = resolve_layout(config.parallelism, nproc * nnodes)
    check_batch(config.training, config.parallelism, layout)
    replicas = layout.dp_replicate if config.recover.checkpoint_restart_mode else 1  # its faults' replicas
    check_fits(config, layout, device, groups=replicas, ranks=layout.world_size // replicas)
    if nnodes > 1 and "--rdzv-endpoint" not in options:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the rendezvous host's address)")
    if nnodes == 1 and "--rdzv-id" in options:
        raise ConfigError("--rdzv-id names a job of many nodes: one node runs torchrun --standalone, which draws a "
                          "fresh run id for every launch (kept across its restarts); drop --rdzv-id")
    return nproc, nnodes, layout


def replica_job(config, options: dict, toml_path: str | None, overrides: list[str], nproc: int,
                metrics_rank: int) -> int:
    """Replica groups (sync or diloco): the coordinator and one torchrun per group (recover/launcher.py)."""
    from titan_recover.platform import active_device

    recover = config.recover
    plan = node_plan(config, options)
    devices = group_placement(config, nproc, active_device(), len(plan.groups))
    if options.get("--dry-run"):
        spares = f" + {recover.spares} spare(s)" if recover.spares else ""
        if recover.diloco_mode:
            print(f"coordinator + syncer + {recover.replicas} learners x {nproc} processes")
            print(f"the syncer evaluates on {evaluation_placement(config, devices)}")
        else:
            print(f"coordinator + {recover.replicas} replica groups{spares} x {nproc} processes")
        if plan.many:
            hosts = "; hosts the job's store and runs the coordinator" + (" and the syncer" if recover.diloco_mode
                                                                           else "")
            standbys = "; runs a standby coordinator" + (" and a standby syncer" if recover.diloco_mode else "")
            print(plan.describe() + (standbys if recover.store else hosts if plan.rank == 0 else ""))
        if devices is not None:
            print("GPUs per group: " + "; ".join(f"{g}: {','.join(d)}" for g, d in zip(plan.groups, devices)))
        return 0
    from titan_recover.recover.launcher import launch_replicas

    return launch_replicas(config, toml_path, overrides, nproc, metrics_rank, devices=devices, plan=plan,
                           verbose=bool(options.get("--verbose")))


def rank_log_dir(config) -> str:
    """Where a one-node job without replica groups writes the output of the ranks the console does not show
    (torchrun's ``--log-dir``: ``<run id>/attempt_<restart>/<local rank>/{stdout,stderr}.log`` under it)."""
    return os.path.join(os.path.abspath(config.dump_folder), "logs", "ranks")


def torchrun_command(config, options: dict, toml_path: str | None, overrides: list[str], nproc: int, nnodes: int,
                     metrics_rank: int) -> tuple[list[str], dict]:
    """The one torchrun of a job without replica groups, and its environment."""
    from titan_recover.recover.chaos.config import JOB_START_ENV
    from titan_recover.train import SEPARATE_ROUND_STORES_ENV

    cmd = [sys.executable, "-m", "titan_recover.torchrun", f"--nproc-per-node={nproc}"]
    if config.recover.preemption_grace_s:  # SIGTERM to the agent: a stop with a checkpoint (torchrun.py)
        cmd.insert(3, f"--preemption-grace-s={config.recover.preemption_grace_s}")
    if nnodes == 1:
        cmd += ["--standalone", f"--local-ranks-filter={metrics_rank}"]
        others = [r for r in range(nproc) if r != metrics_rank]
        if others:  # the ranks the console does not show write their output to files, so a rank's death is readable
            cmd += [f"--log-dir={rank_log_dir(config)}", "--redirects=" + ",".join(f"{r}:3" for r in others)]
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={options['--rdzv-endpoint']}"]
        run_id = options.get("--rdzv-id") or os.environ.get("SLURM_JOB_ID")
        if run_id:  # the job's run id on every node (a requeue keeps SLURM's): the snapshots' names
            cmd += [f"--rdzv-id={run_id}"]
        if "--node-rank" in options:
            cmd += [f"--node-rank={options['--node-rank']}"]
    env = dict(os.environ, LOG_RANK=str(metrics_rank))
    env.setdefault(JOB_START_ENV, repr(time.time()))  # time-triggered faults count from here, across restarts
    if config.metrics.enable_wandb:  # the metrics rank's run, named like a replica-group job's (docs/outputs.md)
        from titan_recover.recover.job_log import run_name

        env.setdefault("WANDB_RUN_NAME", run_name(toml_path, config.metrics.wandb_run_name, config.dump_folder))
    if config.recover.max_restarts:
        # torchrun restarts every worker when one dies; gloo must not connect at group creation for that
        cmd += [f"--max-restarts={config.recover.max_restarts}"]
        env["TORCH_GLOO_LAZY_INIT"] = "1"
        env[SEPARATE_ROUND_STORES_ENV] = "1"  # a fresh store for every round, on every node (train.py)
    cmd += ["-m", "titan_recover.train"] + ([toml_path] if toml_path else []) + overrides
    return cmd, env


def torchrun_job(config, options: dict, toml_path: str | None, overrides: list[str], nproc: int, nnodes: int,
                 metrics_rank: int) -> int:
    """A job without replica groups: torchrun replaces this process (or runs next to a snapshot keeper)."""
    cmd, env = torchrun_command(config, options, toml_path, overrides, nproc, nnodes, metrics_rank)
    keeper_here = config.recover.snapshot.interval > 0 and not config.recover.snapshot.keepers
    if options.get("--dry-run"):
        print(("snapshot keeper + " if keeper_here else "") + shlex.join(cmd))
        return 0
    print(f"[titan_recover] {shlex.join(cmd)}", file=sys.stderr, flush=True)
    if nnodes == 1 and nproc > 1:
        print(f"[titan_recover] the console shows rank {metrics_rank}; every other rank's output: "
              f"{rank_log_dir(config)}/<run>/attempt_<n>/<rank>/", file=sys.stderr, flush=True)
    if keeper_here:
        from titan_recover.recover.phoenix.keeper import run_with_keeper

        return run_with_keeper(cmd, env, many_nodes=nnodes > 1)
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


def reference_job(config, options: dict, toml_path: str | None, overrides: list[str]) -> int:
    """``--reference``: the run, its failure-free reference and the comparison (``reference.py``)."""
    from titan_recover.reference import reference_folder, reference_overrides, run_with_reference

    if _int_option(options, "--nnodes", 1) > 1:
        raise ConfigError("--reference runs the job and its reference one after the other on one node: start the "
                          "reference yourself on many nodes (--chaos.faults '[]' --dump_folder ...-reference)")
    launcher_args = [f"--nproc-per-node={options['--nproc-per-node']}"] if "--nproc-per-node" in options else []
    launcher_args += ["--verbose"] if options.get("--verbose") else []
    if options.get("--dry-run"):
        ref = reference_overrides(overrides, config.dump_folder, config.metrics.wandb_run_name)
        print(f"run into {config.dump_folder}, then the reference into {reference_folder(config.dump_folder)} "
              f"(unless it holds this config's reference) with {shlex.join(ref[len(overrides):])}, then the "
              "comparison")
        return 0
    return run_with_reference(config, toml_path, overrides, launcher_args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        toml_path, options, overrides = split_args(argv)
        if options.get("--help") or options.get("-h"):
            print(__doc__.strip())
            return 0
        if options.get("--list-models"):
            list_models()
            return 0
        config, overrides = load_config(toml_path, overrides)
        if options.get("--print-config"):
            from titan_recover.config.render import render_toml

            print(render_toml(config), end="")
            return 0
        nproc, nnodes, layout = check_job(config, options)
        prepare_data(config)
        from titan_recover.config.validate import check_paths

        check_paths(config)
        if options.get("--reference"):
            return reference_job(config, options, toml_path, overrides)
    except ConfigError as e:
        print(f"titan_recover: config error: {e}", file=sys.stderr)
        return 2

    metrics_rank = 0 if layout.pp == 1 else (layout.world_size // layout.pp) * (layout.pp - 1)
    if config.recover.enabled:
        return replica_job(config, options, toml_path, overrides, nproc, metrics_rank)
    return torchrun_job(config, options, toml_path, overrides, nproc, nnodes, metrics_rank)


if __name__ == "__main__":
    from titan_recover.process_exit import leave

    leave(main())  # every child ended and every log is closed: without the interpreter's teardown
