"""Lightning's ``BaseFinetuning`` callbacks (``BackboneFinetuning``, ...) under ZeRO.

The optimizer's groups list the model's parameters between steps
(``zero_core/param_groups.py``), so the callbacks' name mapping and
``optimizer.add_param_group`` work as under DDP. Two things need the strategy:

- ``filter_on_optimizer`` asks ``torch.equal`` whether a parameter to unfreeze
  is already in the optimizer. A stage-3 parameter at rest has no values on
  any rank, so the callbacks' epoch hook runs inside
  ``engine.comparable_parameters()`` (every rank runs it alike), where such
  comparisons are answered exactly.
- On resume the callbacks re-create the groups they added in ``on_fit_start``
  from their saved state. Lightning restores callback state before
  ``on_fit_start`` only for strategies that load checkpoints before setup;
  ours loads after (the engine must exist), so the strategy does that part
  itself, right before the optimizer state is loaded (from a sharded
  directory or a consolidated file alike): the order of one process or DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
from torch.optim import Optimizer

from zero_core import engine_of


class _EpochHookWithComparableParameters:
    """A callback's ``on_train_epoch_start``, run inside ``engine.comparable_parameters()``."""

    def __init__(self, hook: Callable[..., Any]):
        self.hook = hook

    def __call__(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any, **kwargs: Any) -> Any:
        engine = engine_of(pl_module)
        comparable = engine.comparable_parameters() if engine is not None else contextlib.nullcontext()
        with comparable:
            return self.hook(trainer, pl_module, *args, **kwargs)


def finetuning_callbacks(trainer: "pl.Trainer") -> list[BaseFinetuning]:
    return [c for c in trainer.callbacks if isinstance(c, BaseFinetuning)]


def make_parameters_comparable(callbacks: list[BaseFinetuning]) -> None:
    """Wrap each callback's epoch hook once (a second fit finds it wrapped)."""
    for callback in callbacks:
        if not isinstance(callback.on_train_epoch_start, _EpochHookWithComparableParameters):
            callback.on_train_epoch_start = _EpochHookWithComparableParameters(callback.on_train_epoch_start)  # type: ignore[method-assign]


@contextlib.contextmanager
def param_groups_restored(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer, saved_callbacks: dict[str, Any]
) -> Iterator[list[str]]:
    """What Lightning does for strategies that load before setup: each callback's saved state,
    then its ``on_fit_start``, which puts back the param groups it had added. Yields the
    callbacks' state keys, which the caller takes out of the checkpoint so Lightning does not
    load them a second time (that would leave them restarting into the next ``fit``). What
    raises inside puts callbacks and groups back as they were."""
    callbacks = [c for c in finetuning_callbacks(trainer) if saved_callbacks.get(c.state_key)]
    before = [(callback, callback.state_dict()) for callback in callbacks]
    groups_before = optimizer.param_groups
    try:
        for callback in callbacks:
            callback.load_state_dict(saved_callbacks[callback.state_key])
            callback.on_fit_start(trainer, pl_module)
        yield [callback.state_key for callback in callbacks]
    except BaseException:
        for callback, state in before:
            callback.load_state_dict(state)
            callback.on_fit_start(trainer, pl_module)  # applies the earlier state and ends its restart
        optimizer.param_groups = groups_before
        raise


def without_callback_states(checkpoint: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    if keys and isinstance(checkpoint.get("callbacks"), dict):
        checkpoint["callbacks"] = {k: v for k, v in checkpoint["callbacks"].items() if k not in keys}
    return checkpoint
