"""The registered fault kinds (``[[chaos.faults]] kind``): one function each, given the rank's
:class:`~titan_recover.recover.chaos.monkey.ChaosMonkey` and the fault's spec.

A new kind of fault is a new function registered here by name (:func:`register_fault`), not an edit of the
injector.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, TYPE_CHECKING

import torch

from titan_recover.registry import Registry

if TYPE_CHECKING:  # a kind acts on the monkey it is given; the injector imports this module, not the reverse
    from titan_recover.recover.chaos.config import FaultSpec
    from titan_recover.recover.chaos.monkey import ChaosMonkey

FAULTS: Registry[Callable[["ChaosMonkey", "FaultSpec"], None]] = Registry("chaos fault kind")
register_fault = FAULTS.register


def fault_kinds() -> list[str]:
    return FAULTS.names()


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` fault: an ordinary crash of the training code."""


@register_fault("kill")
def _kill(_monkey, _spec) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@register_fault("hang")
def _hang(_monkey, _spec) -> None:
    """The whole process stops (SIGSTOP): no heartbeat, sockets stay open."""
    os.kill(os.getpid(), signal.SIGSTOP)


@register_fault("stall")
def _stall(_monkey, _spec) -> None:
    """The main thread is stuck forever while the process (and its heartbeat thread) lives on."""
    while True:
        time.sleep(1.0)


@register_fault("desync")
def _desync(monkey, _spec) -> None:
    """At phase ``collective``: this rank issues a different collective than its peers (another shape)."""
    monkey.desync_due = True


@register_fault("raise")
def _raise(_monkey, _spec) -> None:
    raise InjectedFault("injected exception")


@register_fault("slow")
def _slow(monkey, spec) -> None:
    """From this step on, every microbatch of this rank takes ``factor`` times as long (a straggler)."""
    monkey.slowdown = spec.factor


@register_fault("bitflip")
def _bitflip(monkey, spec) -> None:
    """Flip bit ``bit`` of element ``element`` of this rank's first local parameter (now), of its gradient (after
    the current microbatch's backward) or of the next forward's first activation: silent data corruption."""
    if spec.target == "parameter":
        flip_bit(monkey.tensors["parameter"]()[0], spec.element, spec.bit)
    else:
        monkey.pending[spec.target] = spec


def flip_bit(tensor: torch.Tensor, element: int, bit: int) -> None:
    """Flip one bit of one element in place (the tensor's own storage)."""
    width = 8 * tensor.element_size()
    words = tensor.detach().view({16: torch.int16, 32: torch.int32, 64: torch.int64}[width]).reshape(-1)
    if words.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise ValueError("bit flips need a contiguous tensor")
    mask = -(1 << bit) if bit == width - 1 else 1 << bit  # the sign bit as a signed word
    words[element % words.numel()] ^= mask
