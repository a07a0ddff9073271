"""fp16 dynamic loss scaling with an overflow decision every rank shares."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import MixedPrecision

logger = logging.getLogger("zero_core")


@dataclass
class LossScalerState:
    scale: float
    steps_since_backoff: int = 0
    skipped_steps: int = 0


class DynamicLossScaler:
    """Multiplies the loss by ``scale``; halves it on overflow, doubles it after
    ``growth_interval`` clean steps. ``update`` must get the agreed flag."""

    GROWTH_FACTOR = 2.0
    BACKOFF_FACTOR = 0.5

    def __init__(self, precision: MixedPrecision, announce: bool = False):
        self.growth_interval = precision.loss_scale_growth_interval
        self.state = LossScalerState(scale=precision.initial_loss_scale)
        self.announce = announce  # log each skipped step (rank 0), as DeepSpeed prints them

    @property
    def scale(self) -> float:
        return self.state.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.state.scale

    def update(self, found_inf: bool) -> None:
        state = self.state
        if found_inf:
            state.scale *= self.BACKOFF_FACTOR
            state.steps_since_backoff = 0
            state.skipped_steps += 1
            if self.announce:
                logger.info(
                    "ZeRO fp16: gradient overflow, optimizer step skipped (%d so far); loss scale %g -> %g",
                    state.skipped_steps, state.scale / self.BACKOFF_FACTOR, state.scale,
                )  # fmt: skip
            return
        state.steps_since_backoff += 1
        if state.steps_since_backoff >= self.growth_interval:
            state.scale *= self.GROWTH_FACTOR
            state.steps_since_backoff = 0

    def state_dict(self) -> dict[str, float | int]:
        return dict(vars(self.state))

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.state = LossScalerState(**state)
