"""The precision policy (``MixedPrecision``: the dtypes, which each framework's precision flag sets), the
checks of the fp16 loss-scaling settings ``ZeroConfig`` declares (the user's, like every other setting), and
what ``skip_nonfinite_steps`` does.

The loss-scaling settings are DeepSpeed's ``fp16`` keys with DeepSpeed's meaning (its
``deepspeed/runtime/fp16/loss_scaler.py``); their defaults are torch's ``GradScaler``'s values, which
Lightning's and Accelerate's fp16 users get under DDP: dynamic, from 2**16, halved on every overflow, doubled
after 2000 clean steps, no floor. ``optim/loss_scaling.py`` runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .settings import is_count

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Beside fp16's overflows (always skipped): DeepSpeed's ZeRO skips these steps in fp32 and bf16 too (bf16: unless
# bf16.check_grad_overflow is false, at stages 1 and 2 only); torch and DDP take them. The decision rides on the
# step's one agreement (agreement/step_agreement.py), which runs every step anyway: no collective of its own.
SKIPS_DOC = (
    "skip an optimizer step whose gradients hold inf or NaN on any rank, on every rank alike, as DeepSpeed's ZeRO "
    "does (fp16 skips them always)"
)


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtypes parameters are computed and gradients reduced in.

    Master weights and optimizer state are always fp32. ``compute_dtype`` is
    the dtype of the gathered parameters the forward and backward see;
    ``reduce_dtype`` is the dtype gradients are reduce-scattered and sharded
    in (fp32 by default, which is what keeps bf16 training stable). fp16
    compute turns on loss scaling (``ZeroConfig.loss_scale`` and the settings
    beside it) whose overflow decision every rank agrees on.
    """

    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    # None: buffers keep their dtype (rotary inv_freq stays fp32), except those of
    # modules whose parameters are cast (BatchNorm statistics follow its weight).
    # A dtype: every floating buffer is cast to it.
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("compute_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in _COMPUTE_DTYPES:
                raise ValueError(
                    f"MixedPrecision.{name}={value} is not supported; "
                    "use torch.float32, torch.bfloat16 or torch.float16."
                )
        if self.buffer_dtype is not None and self.buffer_dtype not in _COMPUTE_DTYPES:
            raise ValueError(
                f"MixedPrecision.buffer_dtype={self.buffer_dtype} is not supported; use None (keep the "
                "model's buffer dtypes), torch.float32, torch.bfloat16 or torch.float16."
            )

    @property
    def uses_loss_scaling(self) -> bool:
        return self.compute_dtype == torch.float16


def _number(value: Any) -> bool:
    """A finite real number (not a bool, which Python counts as one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_loss_scaling(config: Any) -> None:
    """The loss-scaling settings of a ``ZeroConfig``, each refused with what to use (checked whatever the
    precision: a wrong value is found at setup, not when fp16 is first used)."""
    wrong = []
    if not (_number(config.loss_scale) and config.loss_scale >= 0):
        wrong.append(f"loss_scale={config.loss_scale!r}: use 0 (dynamic loss scaling) or a fixed scale > 0")
    if not (_number(config.initial_loss_scale) and config.initial_loss_scale > 0):
        wrong.append(f"initial_loss_scale={config.initial_loss_scale!r}: use a number > 0 (the default is 2**16)")
    if not is_count(config.loss_scale_window, 1):
        wrong.append(f"loss_scale_window={config.loss_scale_window!r}: use an integer >= 1 (the default is 2000)")
    if not is_count(config.loss_scale_hysteresis, 1):
        wrong.append(
            f"loss_scale_hysteresis={config.loss_scale_hysteresis!r}: use an integer >= 1 (1: every overflow "
            "halves the scale; 2: the first of a run of overflows only skips its step)"
        )
    if not isinstance(config.consecutive_hysteresis, bool):
        wrong.append(f"consecutive_hysteresis={config.consecutive_hysteresis!r}: use True or False")
    if not (_number(config.min_loss_scale) and config.min_loss_scale >= 0):
        wrong.append(f"min_loss_scale={config.min_loss_scale!r}: use a number >= 0 (0: no floor)")
    if wrong:
        raise ValueError("ZeroConfig." + "; ZeroConfig.".join(wrong) + ".")
