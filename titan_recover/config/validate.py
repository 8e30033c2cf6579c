"""Checks across fields that TorchTitan only discovers after processes have started.

Run by the launcher before any process starts; each error spells out the arithmetic and how to fix it.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

from titan_recover.config.apply import ConfigError


@dataclass(frozen=True)
class Layout:
    """Resolved parallel degrees of one run."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int

    @property
    def batch_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def replica_and_rank(self, rank: int) -> tuple[int, int]:
        """``(replica, rank inside it)`` of a global rank whose replicated data-parallel dimension is the replica
        groups (checkpoint-restart mode). TorchTitan's mesh is (pp, dp_replicate, dp_shard, cp, tp), row-major:
        pipeline stages are outermost. Inside a replica group's own torchrun the mesh is the same without
        dp_replicate, so the rank inside is the rank with the replicate coordinate removed."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        per_stage = self.world_size // self.pp
        inner = per_stage // self.dp_replicate  # dp_shard x cp x tp
        stage, within = divmod(rank, per_stage)
        replica, offset = divmod(within, inner)
        return replica, stage * inner + offset


def resolve_layout(parallelism, world_size: int) -> Layout:
    """Resolve ``data_parallel_shard_degree = -1`` and check the degrees multiply to the world size."""
    p = parallelism
    fixed = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    for name, degree in fixed.items():
        if degree < 1:
            raise ConfigError(f"parallelism.{name} must be >= 1, got {degree}")
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
    others *= p.pipeline_parallel_degree
    formula = (
        f"dp_replicate ({p.data_parallel_replicate_degree}) x dp_shard ({{shard}}) x cp ({p.context_parallel_degree})"
        f" x tp ({p.tensor_parallel_degree}) x pp ({p.pipeline_parallel_degree})"
    )
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world_size % others:
            raise ConfigError(
                f"world size {world_size} is not divisible by dp_replicate x cp x tp x pp = {others}, so "
                "parallelism.data_parallel_shard_degree = -1 cannot be inferred; change the degrees or the "
                "number of processes (--nproc-per-node / nnodes)"
            )
        shard = world_size // others
    elif shard < 1:
        raise ConfigError(f"parallelism.data_parallel_shard_degree must be -1 (infer) or >= 1, got {shard}")
    if others * shard != world_size:
        raise ConfigError(
            f"parallel degrees do not match the world size: {formula.format(shard=shard)} = {others * shard}, "
            f"but the job has {world_size} processes. Make the product equal the process count, e.g. set "
            "parallelism.data_parallel_shard_degree = -1 to infer it"
        )
    return Layout(world_size, p.data_parallel_replicate_degree, shard, p.context_parallel_degree,
                  p.tensor_parallel_degree, p.pipeline_parallel_degree)


def check_batch(training, parallelism, layout: Layout) -> int:
    """Check batch divisibility; return the gradient-accumulation steps."""
    lbs = training.local_batch_size
    if lbs < 1:
        raise ConfigError(f"training.local_batch_size must be >= 1, got {lbs}")
    per_step = lbs * layout.batch_degree
    gbs = training.global_batch_size
    if gbs == -1:
        gbs = per_step
    if gbs < 1 or gbs % per_step:
        raise ConfigError(
            f"training.global_batch_size ({gbs}) must be a positive multiple of local_batch_size ({lbs}) x "
            f"data-parallel degree (dp_replicate {layout.dp_replicate} x dp_shard {layout.dp_shard} = "
            f"{layout.batch_degree}) = {per_step}; {gbs} % {per_step} = {gbs % per_step if gbs > 0 else gbs}"
        )
    mbs = parallelism.pipeline_parallel_microbatch_size
    if layout.pp > 1 and lbs % mbs:
        raise ConfigError(
            f"training.local_batch_size ({lbs}) must be divisible by "
            f"parallelism.pipeline_parallel_microbatch_size ({mbs}) with pipeline parallelism; "
            f"{lbs} % {mbs} = {lbs % mbs}"
        )
    return gbs // per_step


def check_model_data(model_vocab_size: int, data_vocab_size: int, dataset_path: str) -> None:
    if data_vocab_size > model_vocab_size:
        raise ConfigError(
            f"the data in {dataset_path} uses a vocabulary of {data_vocab_size} tokens but the model's embedding "
            f"has {model_vocab_size}; prepare the data with --vocab-size {model_vocab_size} or pick a larger model"
        )


def check_values(config) -> None:
    """Values of TorchTitan's sections that the project sets or relies on and that TorchTitan itself accepts
    although they cannot mean anything (a run of ``training.steps = -5`` trains nothing and exits 0)."""
    training = config.training
    bounds = [
        ("training.steps", training.steps, 1, "the number of optimizer steps to train"),
        ("training.seq_len", training.seq_len, 1, "tokens per sequence"),
        ("training.gc_freq", training.gc_freq, 1, "steps between garbage collections"),
        ("lr_scheduler.warmup_steps", config.lr_scheduler.warmup_steps, 0, "steps of learning-rate warmup"),
    ]
    for name, value, lowest, meaning in bounds:
        if value < lowest:
            raise ConfigError(f"{name} must be >= {lowest} ({meaning}), got {value}")
    if not training.max_norm > 0:
        raise ConfigError(f"training.max_norm must be > 0 (gradients are clipped to this total norm; a value <= 0 "
                          f"would scale them by a negative or zero factor), got {training.max_norm}")
    if not str(config.dump_folder).strip():
        raise ConfigError("dump_folder is empty: set the run folder (default: outputs/<toml name>)")


def check_seed_checkpoint(config, world_size: int) -> None:
    """``[checkpoint] create_seed_checkpoint`` (TorchTitan's): the model initialised once, unsharded, saved as the
    step-0 checkpoint that runs of any layout then load (``initial_load_path``), so that they start from the same
    weights; as in TorchTitan's own entry point, only in one process, with checkpoints enabled, and not with
    replica groups (their runs load it as any job does). ``world_size``: the job's processes in all."""
    if not config.checkpoint.create_seed_checkpoint:
        return
    if config.recover.enabled:
        raise ConfigError("checkpoint.create_seed_checkpoint is a single-process job: set recover.replicas = 1")
    if world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint needs a single process (the model unsharded), got "
                          f"{world_size}: set every parallel degree to 1 (--nproc-per-node 1)")
    if not config.checkpoint.enable:
        raise ConfigError("checkpoint.create_seed_checkpoint needs checkpoint.enable = true")


def check_model_fits(config, layout: Layout) -> None:
    """What TorchTitan checks in every rank once the processes run, checked before they start: the model against
    the layout (its own ``update_from_config``, on a copy: tensor parallelism dividing the heads, the sequence within
    RoPE's range, no weight tying with pipelines), and the sequence against sequence / context parallelism (its
    trainer's rule)."""
    model = copy.deepcopy(config.model_spec.model)
    try:
        if hasattr(model, "update_from_config"):  # TorchTitan's decoders have it
            model.update_from_config(config=config)
    except (ValueError, NotImplementedError) as error:
        raise ConfigError(f"the model ({config.model_spec.name} {config.model_spec.flavor}) does not fit the "
                          f"layout: {error}") from None
    sequence_parallel = layout.tp if config.parallelism.enable_sequence_parallel else 1
    divisor = sequence_parallel * (2 * layout.cp if layout.cp > 1 else 1)
    if config.training.seq_len % divisor:
        raise ConfigError(
            f"training.seq_len ({config.training.seq_len}) must be divisible by {divisor}: the tensor-parallel degree "
            f"with sequence parallelism ({sequence_parallel}) x 2 x the context-parallel degree ({layout.cp}) when it "
            f"is above 1; {config.training.seq_len} % {divisor} = {config.training.seq_len % divisor}")


def check_pipeline(config, layout: Layout) -> None:
    """A pipeline's stages against the model's layers and its microbatches against its schedule, as TorchTitan's
    pipeline split (its own functions) and torch's schedules check them in the ranks."""
    if layout.pp == 1:
        return
    from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B,
                                                        ScheduleInterleavedZeroBubble)
    from torchtitan.distributed.pipeline_parallel import (_generate_llm_fqn_per_model_part,
                                                          _get_pipeline_metadata, get_schedule_class)

    parallelism = config.parallelism
    try:  # the layout stands in for TorchTitan's parallel dims: only its ``pp`` is read
        stages, layers, first, last = _get_pipeline_metadata(layout, parallelism, config.model_spec.model)
        _generate_llm_fqn_per_model_part(stages, layers, first, last)
        schedule = get_schedule_class(parallelism.pipeline_parallel_schedule)
    except ValueError as error:
        raise ConfigError(f"the pipeline does not fit the model ({len(config.model_spec.model.layers)} layers, "
                          f"pipeline_parallel_degree {layout.pp}, schedule "
                          f"{parallelism.pipeline_parallel_schedule}): {error}") from None
    csv = parallelism.pipeline_parallel_schedule_csv
    if csv:  # the schedule is the file's (TorchTitan then runs it with torch's runtime schedule)
        if not os.path.isfile(csv):
            raise ConfigError(f"parallelism.pipeline_parallel_schedule_csv {csv!r} is not a file")
        return
    microbatches = config.training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    if issubclass(schedule, (Schedule1F1B, ScheduleDualPipeV)) and microbatches < layout.pp:
        raise ConfigError(
            f"pipeline schedule {parallelism.pipeline_parallel_schedule} needs at least as many microbatches as "
            f"stages ({layout.pp}); training.local_batch_size ({config.training.local_batch_size}) / "
            f"parallelism.pipeline_parallel_microbatch_size ({parallelism.pipeline_parallel_microbatch_size}) = "
            f"{microbatches}")
    rounds = max(1, microbatches // layout.pp)
    if issubclass(schedule, (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)) and microbatches % rounds:
        raise ConfigError(
            f"pipeline schedule {parallelism.pipeline_parallel_schedule} needs the microbatches ({microbatches} = "
            f"local_batch_size / pipeline_parallel_microbatch_size) to be a multiple of its rounds, microbatches // "
            f"pipeline_parallel_degree = {rounds}: use a multiple of {layout.pp} microbatches")


CPU_INCAPABLE = (
    ("checkpoint.async_mode",
     lambda c: c.checkpoint.enable and getattr(c.checkpoint, "async_mode", "") == "async_with_pinned_mem",
     "pins host memory for copies from a GPU", 'use checkpoint.async_mode = "async" or "disabled"'),
    ("training.enable_cpu_offload", lambda c: c.training.enable_cpu_offload,
     "offloads a GPU's parameters to the host, where they already are", "drop it"),
    ("parallelism.enable_fsdp_symm_mem", lambda c: c.parallelism.enable_fsdp_symm_mem,
     "allocates FSDP's buffers in a GPU's symmetric memory", "drop it"),
    ("parallelism.context_parallel_degree", lambda c: c.parallelism.context_parallel_degree > 1,
     "needs FlexAttention, which has no backward on a CPU (the CPU platform uses SDPA, docs/platform.md)",
     "set it to 1"),
)
"""(option, set in a config, what it does, how to fix): options that cannot run on a CPU."""


def check_cpu_options(config, device: str) -> None:
    """Refuse, on a CPU, options that only a GPU can run (they fail in the ranks, some after steps of work)."""
    if device != "cpu":
        return
    for option, is_set, what, fix in CPU_INCAPABLE:
        if is_set(config):
            raise ConfigError(f"{option} {what}: it cannot run on this CPU job (platform.device = cpu); {fix}")


def check_fault_targets(config, groups: int, ranks: int) -> None:
    """Every ``[[chaos.faults]]`` entry hits something that exists: a replica group among the job's ``groups``
    (replicas and spares; 1 without replica groups), a rank among a group's ``ranks``, a step the run reaches (sync
    and single modes; a diloco learner counts its own steps). A fault that names none would never fire, silently."""
    recover = config.recover
    for spec in config.chaos.faults:
        if spec.process != "trainer":
            continue
        where = f"chaos fault {spec.kind!r} at replica {spec.replica} rank {spec.rank}"
        if spec.replica >= groups:
            raise ConfigError(f"{where}: the job has {groups} replica group(s) (replicas + spares), numbered from 0, "
                              f"so it would never fire")
        if spec.rank >= ranks:
            raise ConfigError(f"{where}: a replica group has {ranks} rank(s), numbered from 0, so it would never fire")
        if spec.at_s is None and not recover.diloco_mode and spec.step > config.training.steps:
            raise ConfigError(f"{where} step {spec.step}: the run trains {config.training.steps} step(s) "
                              f"(training.steps), so it would never fire")


def check_paths(config) -> None:
    """Files a run reads at its start, there before it starts: the checkpoint it loads and the tokenizer's folder."""
    checkpoint = config.checkpoint
    path = checkpoint.initial_load_path
    if checkpoint.enable and path and "://" not in path and not os.path.isdir(path):  # a remote URI is not checked
        raise ConfigError(f"checkpoint.initial_load_path {checkpoint.initial_load_path!r} is not a folder (a "
                          f"TorchTitan checkpoint, e.g. outputs/seed/checkpoint/step-0)")
    if checkpoint.enable and checkpoint.load_step > 0 and not config.recover.enabled:  # (groups: a folder each)
        step = os.path.join(config.dump_folder, checkpoint.folder, f"step-{checkpoint.load_step}")
        if not os.path.isdir(step):
            raise ConfigError(f"checkpoint.load_step = {checkpoint.load_step} but there is no {step}: a step this run "
                              f"folder saved (or load_step = -1, the newest)")
    if config.hf_assets_path and not os.path.isdir(config.hf_assets_path):
        raise ConfigError(f"hf_assets_path {config.hf_assets_path!r} is not a folder (the tokenizer's: by default "
                          f"the dataset folder, which holds it)")
