"""The contract of a training mode, and what TorchTitan built that a mode may use.

:class:`~titan_recover.trainer.RecoverTrainer` builds one mode, chosen by ``[recover] mode``, and calls it at
TorchTitan's seams, in this order and nothing else (docs/architecture.md):

* ``start(step)`` once TorchTitan built everything, returning the step to count from;
* ``should_continue(scheduled)`` from ``should_continue_training`` (``scheduled``: TorchTitan's own answer);
* ``local_batches(step)`` from ``batch_generator``: the local-batch indices this rank trains in ``step``;
* ``train_step(step, titan_step)`` from ``train_step``: runs the step, either through ``titan_step`` (TorchTitan's
  own step, which calls ``forward_backward`` once per microbatch) or by itself; returns a :class:`StepReport`;
* ``forward_backward(step, ...)`` from ``forward_backward_step``, inside TorchTitan's step;
* ``train(run)`` around TorchTitan's whole loop (``run``): returns a :class:`Stop` when the job must end early;
* ``close()``.

A mode receives :class:`TrainerParts` (TorchTitan's components, never the trainer) and builds its own components
from its config sections. Data flows down: the trainer calls the mode, the mode calls its components, and what
the trainer must apply (tokens seen, an early stop) comes back as a return value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from titan_recover.registry import Registry

MODES: Registry[type["Mode"]] = Registry("training mode")
"""``[recover] mode`` name -> mode class."""


def register_mode(name: str):
    def add(cls: type[Mode]) -> type[Mode]:
        cls.name = name
        return MODES.register(name)(cls)

    return add


@dataclass(frozen=True, kw_only=True)
class TrainerParts:
    """What TorchTitan's ``Trainer.__init__`` built, as a mode may use it.

    ``forward_backward`` is TorchTitan's own forward and backward of one microbatch
    (``Trainer.forward_backward_step``, keyword arguments ``input_dict``, ``labels``, ``global_valid_tokens``), not
    the trainer's override; ``train_state`` is the trainer's step and tokens seen through TorchTitan's ``Stateful``
    protocol only (``state_dict`` / ``load_state_dict``, what its checkpointer saves as ``train_state``): state
    transfer carries it as the checkpointer does.
    """

    config: Any
    model_parts: list[torch.nn.Module]
    optimizers: Any
    lr_schedulers: Any
    checkpointer: Any
    dataloader: Any
    metrics_processor: Any
    parallel_dims: Any
    device: torch.device
    gradient_accumulation_steps: int
    pp_microbatches: int
    pp_has_last_stage: bool
    forward_backward: Callable[..., torch.Tensor]
    train_state: Any

    def batch_layout(self) -> tuple[int, int]:
        """``(batch_degree, batch_rank)``: data-parallel size inside this job (or replica group) and this rank's
        index, replicate-major."""
        if not self.parallel_dims.dp_enabled:
            return 1, 0
        mesh = self.parallel_dims.get_mesh("batch")
        return mesh.size(), mesh.get_local_rank()


@dataclass(frozen=True)
class StepReport:
    """What the trainer applies after a step a mode ran itself."""

    ntokens_seen: int
    """Tokens of the global batches committed so far (TorchTitan's ``ntokens_seen``, checkpointed with the step)."""

    checkpoint_writer: bool = True
    """This replica writes the step's durable checkpoint, if the step has one (sync mode: only the lowest member
    of the epoch that committed the step; the others hold the same bytes and skip the save)."""

    checkpoint_now: bool = False
    """The step has a durable checkpoint whatever the interval says (one was requested while the job trains on:
    sync mode, a node that left on a preemption notice); written by the ``checkpoint_writer``."""


@dataclass(frozen=True)
class Stop:
    """The job ends before its last step (too few replicas left): the trainer returns to ``step``, the last one
    committed, and ``ntokens_seen`` after it, saves a durable checkpoint if ``save`` and exits with
    ``exit_code``."""

    step: int
    ntokens_seen: int
    reason: str
    save: bool
    exit_code: int


class Mode:
    """A training mode: TorchTitan's step as it is, or made resilient. Subclasses register with
    :func:`register_mode` and override what they change."""

    name: ClassVar[str] = ""

    def __init__(self, config, *, parts: TrainerParts):
        self.config = config
        self.parts = parts

    def start(self, step: int) -> int:
        """Called once TorchTitan built everything; returns the step the trainer counts from (``step``: its own;
        a restarted DiLoCo learner continues the job's count)."""
        return step

    def should_continue(self, scheduled: bool) -> bool:
        return scheduled

    def local_batches(self, step: int) -> Iterator[int]:
        """Local-batch indices ``n`` this rank consumes in ``step`` (1-based), one per gradient-accumulation step:
        ``n = ((step - 1) * A + a) * dp + r``. In HSDP terms (``r = replica * shard_degree + shard``), ``n`` is
        replica microbatch ``g = ((step - 1) * A + a) * replicas + replica`` at shard rank ``shard``, the id the
        ``even`` quota gives that replica in replica mode (which fetches ``n = g * S + shard``)."""
        dp, r = self.parts.batch_layout()
        accumulation = self.parts.gradient_accumulation_steps
        for a in range(accumulation):
            yield ((step - 1) * accumulation + a) * dp + r

    def train_step(self, step: int, titan_step: Callable[[], None]) -> StepReport | None:
        titan_step()
        return None

    def forward_backward(self, step: int, **batch) -> torch.Tensor:
        return self.parts.forward_backward(**batch)

    def train(self, run: Callable[[], None]) -> Stop | None:
        run()
        return None

    def next_stop_save(self, stop: Stop, saved: bool) -> bool:
        """Called after the trainer acted on ``stop.save`` (``saved``: this replica wrote the checkpoint), and again
        after each save it asks for: True if this replica must now write the stop's checkpoint (the replica whose
        turn it was did not; sync mode's handover, :mod:`~titan_recover.recover.groups.stop_checkpoint`)."""
        return False

    def stopped(self, stop: Stop, checkpoint_saved: bool) -> None:
        """The trainer acted on ``stop`` (``checkpoint_saved``: a durable checkpoint of ``stop.step`` exists)."""

    def close(self) -> None:
        pass


def build_mode(config, *, parts: TrainerParts) -> Mode:
    """The registered mode ``config.recover`` resolves to, built from its config sections."""
    import titan_recover.recover.modes.registered  # noqa: F401  (registers the project's modes)

    return MODES.get(config.recover.resolved_mode)(config, parts=parts)
