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
  itself, right before the optimizer state is loaded: the same order as under
  DDP.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning

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


def restore_param_groups(trainer: "pl.Trainer", pl_module: "pl.LightningModule", extra: dict[str, Any]) -> None:
    """What Lightning does for strategies that load before setup: each callback's saved
    state, then its ``on_fit_start``, which puts back the param groups it had added."""
    saved = extra.get("callbacks") or {}
    for callback in finetuning_callbacks(trainer):
        state = saved.get(callback.state_key)
        if state:
            callback.load_state_dict(state)
            callback.on_fit_start(trainer, pl_module)
