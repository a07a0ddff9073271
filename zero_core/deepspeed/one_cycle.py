"""DeepSpeed's ``OneCycle`` schedule (``deepspeed/runtime/lr_schedules.py``, 0.19) as a torch scheduler: the
learning rate climbs from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size`` steps and back over
``cycle_second_step_size`` (in stairs with the stair counts), then decays with ``decay_lr_rate`` every
``decay_step_size`` steps. With ``cycle_momentum`` and an optimizer that has betas, the first beta cycles the
other way between ``cycle_max_mom`` and ``cycle_min_mom``, and the second is set to 0.99, as DeepSpeed sets it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .schedulers import DeepSpeedSchedule, per_group

_SECOND_BETA = 0.99  # DeepSpeed's OneCycle pairs each momentum with it


class OneCycle(DeepSpeedSchedule):
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
