"""The check that a process ``accelerate-zero launch`` started really trains with ZeRO.

A plain ``accelerate.Accelerator`` or ``transformers.Trainer`` never reads the ZeRO settings: launched with
them it would train with plain DDP and nothing would say so. Accelerate has no hook for "an accelerator was
built", so the check watches for training itself, through torch's public global forward pre-hook: the first
forward of a module in training mode with gradients enabled, while no ``ZeroAccelerator`` has prepared a model
in this process, raises on every process (each runs the same script to the same point) before any step.
Evaluation or generation before ``prepare`` (``eval()`` or ``no_grad``) passes; the hook is removed at the
first ``prepare`` of a model, so it costs nothing afterwards.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

PLAIN_TRAINING_ERROR = (
    "accelerate-zero launch: this process started training ({module} ran a forward in training mode) but no "
    "ZeroAccelerator has prepared a model: a plain accelerate.Accelerator or transformers.Trainer ignores the "
    "ZeRO settings and would train with DDP. Build accelerate_zero.ZeroAccelerator instead of Accelerator, or "
    "accelerate_zero.ZeroTrainer instead of Trainer (the same arguments), and prepare the model before "
    "training with it; to train without ZeRO, use `accelerate launch`."
)


class Check(Enum):
    """Where this process's check stands (read by the hook; set at install and at the first prepare)."""

    OFF = auto()  # not launched by accelerate-zero (or already decided): nothing is watched
    WATCHING = auto()  # launched with ZeRO settings, no model prepared yet: a training forward is refused
    ZERO_IN_USE = auto()  # a ZeroAccelerator prepared a model: training is ZeRO's


_check = Check.OFF
_handle: RemovableHandle | None = None


def _on_forward(module: nn.Module, args: Any) -> None:
    if _check is Check.WATCHING and module.training and torch.is_grad_enabled():
        _stop_watching(Check.OFF)  # said once: a script that catches it is not stopped at every forward
        raise RuntimeError(PLAIN_TRAINING_ERROR.format(module=type(module).__name__))


def _stop_watching(outcome: Check) -> None:
    global _check, _handle
    _check = outcome
    if _handle is not None:
        _handle.remove()
        _handle = None


def watch_for_plain_training() -> None:
    global _check, _handle
    if _handle is None:
        _handle = register_module_forward_pre_hook(_on_forward)
    _check = Check.WATCHING


def zero_model_prepared() -> None:
    """Called by ``ZeroAccelerator.prepare`` when it shards a model: the check is satisfied for good."""
    if _check is Check.WATCHING:
        _stop_watching(Check.ZERO_IN_USE)
