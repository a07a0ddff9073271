"""fp16 loss scaling with an overflow decision every rank shares, by DeepSpeed's rules.

The rules are DeepSpeed's ``DynamicLossScaler`` and static ``LossScaler`` (deepspeed/runtime/fp16/loss_scaler.py,
as its ZeRO optimizers run them), so a DeepSpeed config's ``fp16`` section trains here as there; the settings
(``ZeroConfig.loss_scale`` and the ones beside it) default to torch GradScaler's values. After every step:

- an overflow skips the step (a static scale too: DeepSpeed's ZeRO optimizers check the gradients themselves
  and skip it, the scale unchanged). With a dynamic scale, the overflow halves it (not below
  ``min_loss_scale``) once the hysteresis is spent: with ``loss_scale_hysteresis`` H, the first H - 1 overflows
  only use it up. An overflow with the scale already at ``min_loss_scale`` stops the run, as DeepSpeed's does.
- a clean step doubles a dynamic scale when the clean steps before it since the last overflow (or the start)
  are a positive multiple of ``loss_scale_window`` (so the first doubling comes on the step after W clean
  ones), and refills the hysteresis then (with ``consecutive_hysteresis``: after every clean step).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..engine_plans import LossScaling

logger = logging.getLogger("zero_core")


@dataclass
class LossScalerState:
    """What a resumed run needs to go on scaling as the saved one would have (saved in ``meta.pt``)."""

    scale: float
    clean_steps: int = 0  # since the last overflow (or the start)
    skipped_steps: int = 0
    overflows_absorbed: int = 0  # by the hysteresis since it was last refilled


# A checkpoint's scaler state is read by these exact names, nothing else (nothing read from a checkpoint runs
# code). Checkpoints saved before the hysteresis existed have the older names: their counter of clean steps
# since the last halving or doubling counts on, modulo the window, as the clean steps since the last overflow.
_SAVED_NAMES = frozenset(f.name for f in dataclasses.fields(LossScalerState))
_OLDER_NAMES = frozenset({"scale", "steps_since_backoff", "skipped_steps"})


def state_from_checkpoint(saved: Any) -> LossScalerState:
    """The scaler state a checkpoint holds; ValueError when it is not one."""
    if isinstance(saved, dict) and set(saved) == _OLDER_NAMES:
        clean, skipped = saved["steps_since_backoff"], saved["skipped_steps"]
        saved = {"scale": saved["scale"], "clean_steps": clean, "skipped_steps": skipped, "overflows_absorbed": 0}
    valid = (
        isinstance(saved, dict)
        and set(saved) == _SAVED_NAMES
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in saved.values())
        and all(isinstance(saved[name], int) and saved[name] >= 0 for name in _SAVED_NAMES - {"scale"})
        and saved["scale"] > 0
    )
    if not valid:
        raise ValueError(f"the loss-scaler state is malformed ({saved!r})")
    return LossScalerState(**saved)


class LossScaler:
    """Multiplies the loss by ``scale`` and moves the scale by the rules above; ``update`` must get the flag
    every rank agreed on."""

    GROWTH_FACTOR = 2.0
    BACKOFF_FACTOR = 0.5

    def __init__(self, scaling: LossScaling, announce: bool = False):
        self.dynamic, self.window, self.hysteresis = scaling.dynamic, scaling.window, scaling.hysteresis
        self.consecutive_hysteresis, self.min_scale = scaling.consecutive_hysteresis, scaling.min_scale
        self.state = LossScalerState(scale=scaling.initial_scale)
        self.announce = announce  # log each skipped step (rank 0), as DeepSpeed prints them

    @property
    def scale(self) -> float:
        return self.state.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.state.scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._overflow()
        elif self.dynamic:
            self._clean_step()

    def _overflow(self) -> None:
        state, before = self.state, self.state.scale
        if self.dynamic and state.overflows_absorbed >= self.hysteresis - 1:
            if state.scale == self.min_scale:
                raise FloatingPointError(
                    f"ZeRO fp16: the gradients overflow with the loss scale already at min_loss_scale "
                    f"({self.min_scale:g}), so no step can be taken (DeepSpeed stops here too). Lower the learning "
                    "rate, train in bf16, or set a lower min_loss_scale (0: no floor)."
                )
            state.scale = max(state.scale * self.BACKOFF_FACTOR, self.min_scale)
        elif self.dynamic:
            state.overflows_absorbed += 1
        state.clean_steps = 0
        state.skipped_steps += 1
        if self.announce:
            logger.info(
                "ZeRO fp16: gradient overflow, optimizer step skipped (%d so far); %s",
                state.skipped_steps,
                self._scale_news(before),
            )

    def _scale_news(self, before: float) -> str:
        if self.state.scale != before:
            return f"loss scale {before:g} -> {self.state.scale:g}"
        if not self.dynamic:
            return f"loss scale {before:g} (static)"
        left = self.hysteresis - self.state.overflows_absorbed  # overflows until the one that halves it
        when = "the next overflow halves it" if left == 1 else f"{left - 1} more overflows before one halves it"
        return f"loss scale {before:g} kept (hysteresis: {when})"

    def _clean_step(self) -> None:
        state = self.state
        if self.consecutive_hysteresis:
            state.overflows_absorbed = 0
        if state.clean_steps > 0 and state.clean_steps % self.window == 0:
            state.scale *= self.GROWTH_FACTOR
            state.overflows_absorbed = 0
        state.clean_steps += 1

    def state_dict(self) -> dict[str, float | int]:
        return dict(vars(self.state))

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.state = state_from_checkpoint(state)
