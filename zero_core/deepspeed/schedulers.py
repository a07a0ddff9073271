"""DeepSpeed's learning-rate schedules (``deepspeed/runtime/lr_schedules.py``, 0.19) as torch ``LRScheduler``
subclasses: the same learning rate at every step, from the same arithmetic, and torch's ``state_dict`` /
``load_state_dict``, so checkpoints keep them and a resumed run goes on where it stopped.

DeepSpeed's schedule is a function of ``last_batch_iteration``: built, it sets the rate of iteration -1 (the
rate of the first optimizer step), and its engine steps it once after each optimizer step. A torch scheduler
takes its first step when built, to ``last_epoch`` 0, and is stepped after each optimizer step too; so DeepSpeed's
iteration is ``last_epoch - 1`` here, and each class below is DeepSpeed's formula at that iteration.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

LOG, LINEAR = "log", "linear"
_SECOND_BETA = 0.99  # DeepSpeed's OneCycle pairs each momentum with it


def per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """DeepSpeed's ``_format_param``: one value for every group, or a list with one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _warmup_fraction(iteration: int, steps: int, warmup_type: str, inverse_log: float) -> float:
    if warmup_type == LOG:
        return inverse_log * math.log(iteration + 1)
    return iteration / steps


class DeepSpeedSchedule(LRScheduler):
    """A DeepSpeed schedule: ``lrs_at(iteration)`` is DeepSpeed's ``get_lr()`` at ``last_batch_iteration``."""

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[float]:  # step(epoch): the rate is a function of the step alone
        return self.get_lr()


class WarmupLR(DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over ``warmup_num_steps``
    (at least 2), by ``log`` or ``linear``; then ``warmup_max_lr``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: Any = 0.0,
        warmup_max_lr: Any = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = LOG,
    ) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = per_group(optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = per_group(optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps`` (``warmup_max_lr`` defaults to 0.001 here,
    as in DeepSpeed)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: Any = 0.0,
        warmup_max_lr: Any = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = LOG,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up)
        return max(
            0.0,
            float(self.total_num_steps - iteration) / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(DeepSpeedSchedule):
    """The optimizer's lr times a ratio: from ``warmup_min_ratio`` to 1 over ``warmup_num_steps``, then a cosine
    down to ``cos_min_ratio`` at ``total_num_steps``. The first step's rate is 0, as in DeepSpeed."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = LOG,
    ) -> None:
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self._ratio(iteration)
        return [org_lr * ratio for org_lr in self.org_lrs]

    def _ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            ratio = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)


class LRRangeTest(DeepSpeedSchedule):
    """``lr_range_test_min_lr`` times ``1 + step_rate * (iteration + 1) / step_size`` (floored to whole
    intervals with ``lr_range_test_staircase``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: Any = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
    ) -> None:
        self.min_lr = per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lr)
        interval = float(iteration + 1) / self.step_size
        increase = 1 + self.step_rate * (math.floor(interval) if self.staircase else interval)
        return [min_lr * increase for min_lr in self.min_lr]


class OneCycle(DeepSpeedSchedule):
    """DeepSpeed's ``OneCycle`` schedule (``deepspeed/runtime/lr_schedules.py``, 0.19) as a torch scheduler: the
    learning rate climbs from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size`` steps and back over
    ``cycle_second_step_size`` (in stairs with the stair counts), then decays with ``decay_lr_rate`` every
    ``decay_step_size`` steps. With ``cycle_momentum`` and an optimizer that has betas, the first beta cycles the other
    way between ``cycle_max_mom`` and ``cycle_min_mom``, and the second is set to 0.99, as DeepSpeed sets it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: Any,
        cycle_max_lr: Any,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: float = 2000,
        cycle_second_step_size: float | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: float = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: Any = 0.8,
        cycle_max_mom: Any = 0.9,
        decay_mom_rate: float = 0.0,
    ) -> None:
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (
            float(cycle_second_step_size) if cycle_second_step_size is not None else self.first_step_size
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay_steps = math.isclose(decay_step_size, 0)
        self.min_lrs = per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay_steps or math.isclose(decay_lr_rate, 0)
        # DeepSpeed cycles the momentum only of an optimizer with betas (it warns and leaves SGD's alone).
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay_steps or math.isclose(decay_mom_rate, 0)
        self.min_moms = [(mom, _SECOND_BETA) for mom in per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(mom, _SECOND_BETA) for mom in per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        super().__init__(optimizer)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            # Built, DeepSpeed sets the lower momentum (its formula would give the upper one at iteration -1).
            moms = self.min_moms if self.last_epoch == 0 else self._moms_at(self.last_epoch - 1)
            for group, betas in zip(self.optimizer.param_groups, moms):
                group["betas"] = betas

    def _scale_factor(self, iteration: int) -> float:
        batch_iteration = iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale_factor = self._scale_factor(iteration)
            return [low + (high - low) * scale_factor for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay_interval = (iteration - self.total_size + 1) / self.decay_step_size
        return [low / (1 + self.decay_lr_rate * decay_interval) for low in self.min_lrs]

    def _moms_at(self, iteration: int) -> list[tuple[float, float]]:
        if iteration < self.total_size:
            scale_factor = self._scale_factor(iteration)
            return [
                (high[0] - (high[0] - low[0]) * scale_factor, low[1]) for low, high in zip(self.min_moms, self.max_moms)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        decay_interval = (iteration - self.total_size + 1) / self.decay_step_size
        return [(beta0 * (1 + self.decay_mom_rate * decay_interval), beta1) for beta0, beta1 in self.max_moms]
