"""The check that a process ``accelerate-zero launch`` started really trains with ZeRO.

A plain ``accelerate.Accelerator`` or ``transformers.Trainer`` never reads the ZeRO settings: launched with
them it would train with plain DDP and nothing would say so. Accelerate has no hook for "an accelerator was
built", so the check watches for training itself, through torch's public global optimizer-step pre-hook: the
first ``optimizer.step()`` while no ``ZeroAccelerator`` has prepared a model in this process raises on every
process (each runs the same script to the same point), before the optimizer changes anything. Forwards and
backwards before it (evaluation, lazy initialisation, transforms and metrics in training mode) pass; the hook
is removed at the first ``prepare`` of a model, so it costs nothing afterwards.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

PLAIN_TRAINING_ERROR = (
    "accelerate-zero launch: this process started training ({optimizer}.step() was called) but no "
    "ZeroAccelerator has prepared a model: a plain accelerate.Accelerator or transformers.Trainer ignores the "
    "ZeRO settings and would train with DDP. Build accelerate_zero.ZeroAccelerator instead of Accelerator, or "
    "accelerate_zero.ZeroTrainer instead of Trainer (the same arguments), and prepare the model before "
    "training with it; to train without ZeRO, use `accelerate launch`."
)


class Check(Enum):
    """Where this process's check stands (read by the hook; set at install and at the first prepare)."""

    OFF = auto()  # not launched by accelerate-zero (or already decided): nothing is watched
    WATCHING = auto()  # launched with ZeRO settings, no model prepared yet: an optimizer step is refused
    ZERO_IN_USE = auto()  # a ZeroAccelerator prepared a model: training is ZeRO's


_check = Check.OFF
_handle: RemovableHandle | None = None


def _on_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if _check is Check.WATCHING:
        _stop_watching(Check.OFF)  # said once: a script that catches it is not stopped at every step
        raise RuntimeError(PLAIN_TRAINING_ERROR.format(optimizer=type(optimizer).__name__))


def _stop_watching(outcome: Check) -> None:
    global _check, _handle
    _check = outcome
    if _handle is not None:
        _handle.remove()
        _handle = None


def watch_for_plain_training() -> None:
    global _check, _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_on_step)
    _check = Check.WATCHING


def zero_model_prepared() -> None:
    """Called by ``ZeroAccelerator.prepare`` when it shards a model: the check is satisfied for good."""
    if _check is Check.WATCHING:
        _stop_watching(Check.ZERO_IN_USE)
