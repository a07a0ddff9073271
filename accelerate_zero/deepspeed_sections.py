"""A DeepSpeed config's ``optimizer`` and ``scheduler`` sections under ``ZeroAccelerator``, as Accelerate's own
DeepSpeed integration takes them (``Accelerator._prepare_deepspeed``): the script passes
``accelerate.utils.DummyOptim(params, lr=..., weight_decay=...)`` and ``DummyScheduler(optimizer,
total_num_steps=..., warmup_num_steps=...)`` to ``prepare`` and gets back the optimizer and schedule the config
describes (``zero_core.deepspeed``'s builders), their "auto"s filled from the dummies' arguments as Accelerate
fills them. The schedule steps as DeepSpeed's engine steps it: after each optimizer step that was not skipped,
while the prepared scheduler's own ``step()`` does nothing (Accelerate's ``DeepSpeedSchedulerWrapper``).

A DummyOptim without an optimizer section, a real optimizer beside one, and the same for schedulers, are
refused in Accelerate's words.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DummyOptim, DummyScheduler
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zero_core.deepspeed import DeepSpeedSettings, build_optimizer, build_scheduler, built_from_config


class ConfigScheduler(AcceleratedScheduler):
    """The config's schedule, prepared: stepped by the optimizer's step (as DeepSpeed's engine steps it), so the
    loop's ``lr_scheduler.step()`` does nothing, as under Accelerate's DeepSpeed integration."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass


def _refuse_mismatches(optimizer: Any, scheduler: Any, sections: DeepSpeedSettings | None) -> None:
    """Accelerate's checks (``_prepare_deepspeed``), in its words. An optimizer or scheduler the config's section
    built (ZeroTrainer builds them itself) is the config's, not the script's."""
    has_optimizer = sections is not None and sections.optimizer is not None
    has_scheduler = sections is not None and sections.scheduler is not None
    if isinstance(optimizer, Optimizer) and has_optimizer and not built_from_config(optimizer):
        raise ValueError(
            "You cannot specify an optimizer in the config file and in the code at the same time. Please remove the "
            "optimizer from the config file or create `accelerate.utils.DummyOptim` in the code."
        )
    if isinstance(optimizer, DummyOptim) and not has_optimizer:
        raise ValueError("You cannot create a `DummyOptim` without specifying an optimizer in the config file.")
    if isinstance(scheduler, LRScheduler) and has_scheduler and not built_from_config(scheduler):
        raise ValueError(
            "You cannot specify a scheduler in the config file and in the code at the same time. Please remove the "
            "scheduler from the config file or create `accelerate.utils.DummyScheduler` in the code."
        )
    if isinstance(scheduler, DummyScheduler) and not has_scheduler and scheduler.lr_scheduler_callable is None:
        raise ValueError(
            "Either specify a scheduler in the config file or pass in the `lr_scheduler_callable` parameter when "
            "using `accelerate.utils.DummyScheduler`."
        )
    if isinstance(optimizer, DummyOptim) and scheduler is not None and not isinstance(scheduler, DummyScheduler):
        raise ValueError(
            "You can only specify `accelerate.utils.DummyScheduler` in the code when using "
            "`accelerate.utils.DummyOptim`."
        )


class SectionBuilder:
    """What ``ZeroAccelerator.prepare`` hands in place of the dummies, remembered across ``prepare`` calls (a
    DummyScheduler prepared after its DummyOptim is built over the optimizer built for it)."""

    def __init__(self, sections: DeepSpeedSettings | None, num_processes: int, split_batches: bool) -> None:
        self.sections = sections
        self.num_processes = num_processes
        self.split_batches = split_batches
        self.built: dict[int, Any] = {}  # id(dummy) -> what was built for it
        self.config_schedulers: list[LRScheduler] = []

    def replace_dummies(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        optimizer = next((a for a in args if isinstance(a, (Optimizer, DummyOptim))), None)
        scheduler = next((a for a in args if isinstance(a, (LRScheduler, DummyScheduler))), None)
        _refuse_mismatches(optimizer, scheduler, self.sections)
        if isinstance(optimizer, DummyOptim):
            model = next((a for a in args if isinstance(a, nn.Module)), None)  # names mark Muon's matrices
            self.built[id(optimizer)] = self._optimizer(optimizer, model)
        if isinstance(scheduler, DummyScheduler):
            self.built[id(scheduler)] = self._scheduler(scheduler)
        elif scheduler is None and self._builds_schedule_alone(optimizer):
            # DeepSpeed's engine builds and steps the config's schedule even when the script passes none.
            self._scheduler(DummyScheduler(optimizer))
        return tuple(self.built.get(id(a), a) for a in args)

    def _builds_schedule_alone(self, optimizer: Any) -> bool:
        """A DummyOptim, or the script's optimizer, prepared with no scheduler while the config has one (an
        optimizer built from the config by ZeroTrainer comes with the schedule ZeroTrainer builds)."""
        has_scheduler = self.sections is not None and self.sections.scheduler is not None
        return has_scheduler and optimizer is not None and not built_from_config(optimizer)

    def _optimizer(self, dummy: DummyOptim, model: nn.Module | None) -> Optimizer:
        if dummy.kwargs:
            warnings.warn(
                f"DummyOptim's {sorted(dummy.kwargs)} are not read (nor by Accelerate's DeepSpeed integration): the "
                "config's optimizer section decides them.",
                stacklevel=4,
            )
        auto = {"lr": dummy.lr, "weight_decay": dummy.weight_decay}  # as Accelerate fills them
        filled_by = "DummyOptim(lr=, weight_decay=)"
        return build_optimizer(self.sections.optimizer, dummy.params, auto, filled_by, model=model)

    def _scheduler(self, dummy: DummyScheduler) -> LRScheduler:
        optimizer = self.built.get(id(dummy.optimizer), dummy.optimizer)
        if not isinstance(optimizer, Optimizer):
            raise ValueError("Prepare the DummyScheduler's DummyOptim first (or in the same prepare call).")
        existing = next((built for built in self.config_schedulers if built.optimizer is optimizer), None)
        if existing is not None:  # built when its optimizer was prepared alone: one schedule per optimizer
            return existing
        if dummy.lr_scheduler_callable is not None:  # handed to DeepSpeed, which calls it on its optimizer
            scheduler = dummy.lr_scheduler_callable(optimizer)
        else:
            scheduler = build_scheduler(self.sections.scheduler, optimizer, self._scheduler_autos(dummy), _FILLED_BY)
        self.config_schedulers.append(scheduler)
        return scheduler

    def _scheduler_autos(self, dummy: DummyScheduler) -> dict[str, Any]:
        """Accelerate's: the rates from the optimizer's lr, the counts from the DummyScheduler (its total divided
        among the processes, each of which steps once per step, unless the batches are split)."""
        source = dummy.optimizer
        max_lr = getattr(source, "lr", None) if getattr(source, "defaults", None) is None else source.defaults["lr"]
        auto = {"warmup_min_lr": 0, "warmup_max_lr": max_lr, "warmup_num_steps": max(1, dummy.warmup_num_steps)}
        if dummy.total_num_steps is not None:
            total = dummy.total_num_steps
            auto["total_num_steps"] = total if self.split_batches else math.ceil(total / self.num_processes)
        return auto


_FILLED_BY = "DummyScheduler(total_num_steps=, warmup_num_steps=) with its optimizer's lr"
