"""A replica group's rank as the step recovery manager's worker: microbatches by id, accumulated locally.

:meth:`ReplicaWorker.compute` fetches this rank's shard of replica microbatch ``g`` from the addressable loader and
runs TorchTitan's own forward and backward on it, with the loss scaled by the constant ``1 / tokens of the global
batch`` (never by the live replicas), so the summed gradient of any assignment of ids is the failure-free one.
FSDP2 reduces over the replica's own ranks as usual. With ``[recover.quota] exact`` every microbatch's gradient is
moved into a float64 accumulator right away (the committed gradient then does not depend on who computed what).
Otherwise the gradients accumulate in the parameters' ``.grad``. A post-accumulate-grad hook on every parameter
(autograd's, or FSDP2's after its reduce-scatter) tells an overlapped reduction when the last microbatch's backward
has finished each one (:meth:`ReplicaWorker.gradient_parts`); in exact mode the hook first moves that gradient into
the parameter's float64 accumulator, which is then final.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from titan_recover import platform
from titan_recover.recover.modes.base import TrainerParts
from titan_recover.recover.phoenix.state_transfer import local_tensor, optimizer_tensors
from titan_recover.recover.scout.consensus import fingerprint


def local_parameters(model_parts) -> list[torch.Tensor]:
    return [local_tensor(p.data) for m in model_parts for p in m.parameters()]


def _set_grad(p: torch.Tensor, local: torch.Tensor, placements=None) -> None:
    """Make ``local`` (this rank's part, shaped as ``p``'s local tensor) the gradient of ``p``, a DTensor with
    ``placements`` (default: the parameter's; a gradient may differ, e.g. ``Partial`` for a tensor-parallel
    parameter used in a sequence-parallel region: :func:`needs_gradient_placements`)."""
    if isinstance(p, DTensor):
        p.grad = DTensor.from_local(local.view(local_tensor(p).shape), p.device_mesh, placements or p.placements,
                                    run_check=False, shape=p.shape, stride=p.stride())
    else:
        p.grad = local.view_as(p)


def needs_gradient_placements(p: torch.Tensor) -> bool:
    """A DTensor parameter sharded on no mesh dimension (a tensor-parallel norm weight, replicated): its gradient
    may be ``Partial`` (each rank holds a summand) where the parameter is ``Replicate``, so a gradient built for it
    must take the placements its backward gives, not the parameter's. A sharded parameter's gradient has the
    parameter's placements (FSDP2's reduce-scatter, a sharded TP weight)."""
    return isinstance(p, DTensor) and not any(placement.is_shard() for placement in p.placements)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when contiguous (reduced in place), else a copy (which the committed step writes back)."""
    return t if t.is_contiguous() else t.contiguous()


def _nothing(*_args) -> None:
    pass


def _never() -> bool:
    return False


@dataclass(frozen=True)
class ComputeHooks:
    """Where liveness and fault injection meet a microbatch's computation (the mode chooses them)."""

    before: Callable[[int], None] = _nothing
    """``before(step)``: the microbatch is about to be fetched and run."""
    after_backward: Callable[[], None] = _nothing
    """Its backward finished (its gradient is in ``.grad``)."""
    after: Callable[[int, float], None] = _nothing
    """``after(step, seconds)``: it is accumulated; ``seconds`` of compute since its data was loaded."""
    timed: Callable[[], bool] = _never
    """Whether ``after`` needs the microbatch's device time: the worker then waits for the device before reading
    the clock (a wait per microbatch, which a GPU pays in lost overlap; a ``slow`` fault asks for it)."""


class ReplicaWorker:
    def __init__(self, parts: TrainerParts, *, per_step: int, exact: bool, hooks: ComputeHooks = ComputeHooks(),
                 reports_final: bool = True):
        """``per_step``: M, microbatches of the global batch. ``reports_final``: whether the backward can report
        each gradient final (a hook on every parameter) for an overlapped reduction (:meth:`gradient_parts`);
        without it no hook is registered."""
        self.parts = parts
        config = parts.config
        self.exact = exact
        self.shard_degree, self.shard_rank = parts.batch_layout()
        self.local_batch = config.training.local_batch_size
        self.tokens_per_microbatch = self.shard_degree * self.local_batch * config.training.seq_len
        """Tokens of one replica microbatch (all its shards)."""
        self.global_token_count = per_step * self.tokens_per_microbatch
        self.global_tokens = torch.tensor(self.global_token_count, device=parts.device)
        self.params = [p for m in parts.model_parts for p in m.parameters() if p.requires_grad]
        self.numel = sum(local_tensor(p).numel() for p in self.params)
        self.hooks = hooks
        self.step = 0
        self._loss = torch.zeros((), dtype=torch.float64, device=parts.device)
        self._computed = 0
        self._loaded = False
        self._recording = True
        """Whether fetched batches count in TorchTitan's throughput metrics (not when computed again)."""
        self._exact_parts: list[torch.Tensor] = []
        """Exact mode: each parameter's float64 accumulator (flat, in parameter order): what the step reduces."""
        self._moved: set[int] = set()
        """Exact mode: parameters whose gradient the running backward's hooks moved into the accumulator already."""
        self._on_final: Callable[[int], None] | None = None
        """Set while a microbatch runs whose backward reports final gradient parts (:meth:`compute`)."""
        self._grad_placements: list = [None] * len(self.params)
        """Each parameter's gradient placements as a backward made them (None: not seen yet), for the gradients
        this worker builds itself (zeros, a restored backup, a reduced sum where it computed nothing)."""
        self._placements_unknown = [i for i, p in enumerate(self.params) if needs_gradient_placements(p)]
        self._backward_seen = False
        self.reports_final = reports_final
        if reports_final:
            for index, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(self._final_hook(index))

    def _final_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def final(param: torch.Tensor) -> None:
            if self._on_final is not None:
                if self.exact:
                    self._move_to_accumulator(index, param)
                self._on_final(index)
        return final

    def begin_step(self, step: int) -> None:
        self.step = step
        self._loss.zero_()
        self._computed = 0
        self._loaded = False
        self._recording = True
        if self.exact:
            if not self._exact_parts:
                self._exact_parts = [torch.zeros(local_tensor(p).numel(), dtype=torch.float64, device=self.parts.device)
                                     for p in self.params]
            torch._foreach_zero_(self._exact_parts)  # one launch, not one per parameter

    def compute(self, g: int, witness: str | None = None, on_final: Callable[[int], None] | None = None) -> int | None:
        """Forward and backward of replica microbatch ``g`` (this rank's shard of it), accumulated locally.

        ``witness``: called before anything was accumulated in this step; returns the signature of ``g``'s
        gradient shards and loss. ``"holder"`` keeps the gradient, ``"replay"`` drops it (docs/scout.md).
        ``on_final(i)``: called from the backward as soon as parameter ``i``'s gradient has its final value (after
        :meth:`gradient_parts`)."""
        self.hooks.before(self.step)
        replay = witness == "replay"
        inputs, targets, loaded = self._fetch(g, record=self._recording and not replay)
        pp = self.parts.parallel_dims.pp_enabled
        self._on_final = on_final
        self._moved.clear()
        try:
            loss = self.parts.forward_backward(input_dict=inputs if pp else inputs[0],
                                               labels=targets if pp else targets[0],
                                               global_valid_tokens=self.global_tokens)
        finally:
            self._on_final = None
        self.hooks.after_backward()
        self._backward_seen = True
        if self._placements_unknown:
            self._note_placements()
        last_stage = not pp or self.parts.pp_has_last_stage
        signature = None
        if witness is not None:
            grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
            signature = fingerprint(grads, extra=[float(loss.detach().sum())] if last_stage else [])
        if replay:
            for p in self.params:
                p.grad = None
            return signature
        if last_stage:
            self._loss += loss.detach().to(torch.float64).sum()
        self._computed += 1
        if self.exact:
            self._move_gradients_to_accumulator()
        if self.hooks.timed():
            self.synchronize()
        self.hooks.after(self.step, time.perf_counter() - loaded)
        return signature

    def synchronize(self) -> None:
        """Wait for the device to finish the work issued so far (a no-op on CPU)."""
        platform.synchronize(self.parts.device)

    def _fetch(self, g: int, record: bool):
        """This rank's shard of microbatch ``g``, split into the pipeline's chunks, on the device."""
        parts = self.parts
        start = time.perf_counter()
        input_dict, labels = parts.dataloader.microbatch(g, self.shard_rank, shard_degree=self.shard_degree,
                                                         batch_size=self.local_batch)
        loaded = time.perf_counter()
        chunks = parts.pp_microbatches
        inputs, targets = [], []
        for c in range(chunks):
            part = slice(c * self.local_batch // chunks, (c + 1) * self.local_batch // chunks)
            inputs.append({k: v[part].to(parts.device) for k, v in input_dict.items()})
            targets.append(labels[part].to(parts.device))
            if record:
                parts.metrics_processor.record_batch(targets[-1].numel(), (loaded - start) / chunks)
                self._loaded = True
        return inputs, targets, loaded

    def needs_backward(self) -> bool:
        """No backward has run in this process while tensor parallelism is on (a spare before its first
        microbatch): a gradient it builds could be placed as its parameter, not as the backward would. The same
        answer on every rank of the replica, which all compute the microbatch it leads to together (whether each
        rank's own parameters need it differs between pipeline stages)."""
        return self.parts.parallel_dims.tp_enabled and not self._backward_seen

    def _note_placements(self) -> None:
        """Record the placements of the gradients the backward made, for the parameters whose gradients may be
        placed otherwise than the parameter (:func:`needs_gradient_placements`), until each was seen."""
        for i in list(self._placements_unknown):
            grad = self.params[i].grad
            if isinstance(grad, DTensor):
                self._grad_placements[i] = grad.placements
                self._placements_unknown.remove(i)

    def _placements(self, i: int):
        """The placements of parameter ``i``'s gradient: the present gradient's, else as a backward made them,
        else the parameter's."""
        grad = self.params[i].grad
        if isinstance(grad, DTensor):
            return grad.placements
        return self._grad_placements[i]

    def _zero_gradient(self, i: int) -> torch.Tensor:
        p = self.params[i]
        if not isinstance(p, DTensor):
            return torch.zeros_like(p)
        return DTensor.from_local(torch.zeros_like(local_tensor(p)), p.device_mesh, self._placements(i) or p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())

    def _move_to_accumulator(self, index: int, p: torch.Tensor) -> None:
        """Add parameter ``index``'s gradient to its float64 accumulator and zero it."""
        if p.grad is not None:
            with torch.no_grad():
                g = local_tensor(p.grad)
                self._exact_parts[index].add_(g.reshape(-1))
                g.zero_()
        self._moved.add(index)

    def _move_gradients_to_accumulator(self) -> None:
        for index, p in enumerate(self.params):
            if index not in self._moved:  # not moved by its hook in this backward
                self._move_to_accumulator(index, p)

    def gradient_parts(self) -> list[torch.Tensor] | None:
        """What the step reduces in place, for an overlapped reduction: every parameter's local gradient, made to
        exist (zeros where none yet: the next backward accumulates into them in place, as into any existing
        gradient), or in exact mode its float64 accumulator (the hook moves the last backward's gradient in before it
        reports the part final). None with pipeline parallelism (a stage's backward runs once
        per pipeline chunk, so a hook does not mean final) and when built without ``reports_final``."""
        if not self.reports_final or self.parts.parallel_dims.pp_enabled:
            return None
        if self.exact:
            return list(self._exact_parts)
        if self._placements_unknown:  # a zero gradient would be placed as its parameter: wait for a backward
            return None
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    p.grad = self._zero_gradient(i)
        parts = [local_tensor(p.grad) for p in self.params]
        return parts if all(t.is_contiguous() for t in parts) else None

    def contribution(self) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor, float]:
        """``(gradient, loss, mean_loss)``: the local accumulation (every parameter's local gradient in order, or
        in exact mode its float64 accumulator: the step reduces them in place), the summed loss share and the mean
        token loss of what this rank computed in the step (0: nothing)."""
        if self.exact:
            gradient = list(self._exact_parts)
        else:
            gradient = [_contiguous(local_tensor(p.grad)) if p.grad is not None else torch.zeros_like(local_tensor(p))
                        for p in self.params]
        loss = self._loss.detach().cpu()  # the mean loss below is a host number: one small wait for the device
        local_tokens = self._computed * self.local_batch * self.parts.config.training.seq_len
        mean_loss = float(loss) * self.global_token_count / local_tokens if local_tokens else 0.0
        return gradient, loss, mean_loss

    def replace_gradient(self, parts: list[torch.Tensor]) -> None:
        """After an aborted reduction: ``parts`` (fresh tensors, the values before it) become the accumulation."""
        if self.exact:
            self._exact_parts = list(parts)  # taken as they are: no copy of the accumulation
            return
        for i, (p, part) in enumerate(zip(self.params, parts)):
            _set_grad(p, part, self._placements(i))

    def discard(self) -> None:
        """After an aborted reduction without a backup: drop the step's accumulation (new storage from here on; the
        abandoned collective keeps the old) so that its microbatches are computed again from nothing."""
        self._loss = torch.zeros_like(self._loss)
        self._computed = 0
        self._recording = False
        if self.exact:
            self._exact_parts = [torch.zeros_like(part) for part in self._exact_parts]
        for p in self.params:
            p.grad = None

    def write_gradient(self, summed: list[torch.Tensor], scale: float) -> None:
        """The committed gradient in the parameters' ``.grad`` (``scale``: 1 unless ``drop`` lost microbatches):
        copied from the exact-mode accumulator, else already there (reduced in place; a parameter that had no
        gradient gets the reduced zeros it contributed)."""
        with torch.no_grad():
            if self.exact:
                self._copy_into_grads(summed, scale)
            else:
                for i, (p, part) in enumerate(zip(self.params, summed)):
                    if p.grad is None or local_tensor(p.grad).data_ptr() != part.data_ptr():
                        _set_grad(p, part, self._placements(i))
                    if scale != 1:
                        local_tensor(p.grad).mul_(scale)
        if not self._loaded:  # a spare computed nothing; TorchTitan averages the loading times it logs
            self.parts.metrics_processor.record_batch(0, 0.0)

    def _copy_into_grads(self, summed: list[torch.Tensor], scale: float) -> None:
        for i, (p, part) in enumerate(zip(self.params, summed)):
            if p.grad is None:
                p.grad = self._zero_gradient(i)
            g = local_tensor(p.grad)
            part = part.view_as(g)
            g.copy_((part * scale if scale != 1 else part).to(g.dtype))

    def parameter_signature(self) -> int:
        """The signature of this rank's parameter shards alone."""
        return fingerprint(local_parameters(self.parts.model_parts))

    def state_signature(self) -> int:
        """The signature the parameter vote compares (docs/scout.md): this rank's parameter shards and its
        optimizer state (AdamW's moments and step count), the tensors a state transfer sends. A flipped bit of a
        moment changes it at once, before the next optimizer step carries the flip into the parameters."""
        return fingerprint([*local_parameters(self.parts.model_parts), *optimizer_tensors(self.parts.optimizers)])
