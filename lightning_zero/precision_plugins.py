"""Lightning's precision flags mapped onto the ZeRO core's policy, and the
precision plugin the strategy owns (no autocast: the engine computes in the
policy's dtype with fp32 master weights)."""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from zero_core import MixedPrecision, ZeroEngine

# Lightning flag -> (compute dtype, reduce dtype). "-mixed" keeps the fp32
# reduction ZeRO recommends; "-true" reduces in the compute dtype too.
PRECISION_POLICIES: dict[str, MixedPrecision] = {
    "32-true": MixedPrecision(),
    "bf16-mixed": MixedPrecision(compute_dtype=torch.bfloat16),
    "bf16-true": MixedPrecision(compute_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    "16-mixed": MixedPrecision(compute_dtype=torch.float16),
}
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}


def policy_for(precision: str | int) -> MixedPrecision:
    name = _ALIASES.get(precision, precision)
    if name not in PRECISION_POLICIES:
        raise ValueError(
            f"precision={precision!r} is not supported by the ZeRO strategies; use one of {sorted(PRECISION_POLICIES)}."
        )
    return PRECISION_POLICIES[name]


class ZeroPrecisionSettings:
    """What the Trainer's and Fabric's ZeRO precision plugins share: the flag,
    the core's policy for it, and the engine the strategy hands over."""

    def __init__(self, precision: str | int = "32-true") -> None:
        self.policy = policy_for(precision)  # fp16's loss scaling: the strategy's settings (loss_scale, ...)
        self.precision = _ALIASES.get(precision, precision)
        self.engine: ZeroEngine | None = None


class ZeroPrecision(ZeroPrecisionSettings, Precision):
    """Loss scaling (fp16, agreed across ranks), clipping over all shards, and
    the optimizer step after the closure, all through the strategy's engine."""

    def _engine(self) -> ZeroEngine:
        if self.engine is None:
            raise RuntimeError("ZeroPrecision is used before the ZeRO strategy set up its engine.")
        return self.engine

    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:
        return super().pre_backward(self._engine().scale_loss(tensor), module)

    def backward(  # type: ignore[override]
        self, tensor: torch.Tensor, model: "pl.LightningModule", optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        # Through the engine, so stage 3 gets its zero backward roots (the
        # collectives then never depend on which outputs the loss used). A
        # LightningModule that overrides backward() keeps its own.
        if args or is_overridden("backward", model, pl.LightningModule):
            self._engine().expect_scaled_backward()  # pre_backward scaled the loss
            model.backward(tensor, *args, **kwargs)
        else:
            self._engine().backward_scaled(tensor, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # The closure (forward + backward) must run before the step: the
        # engine prepares the sharded gradients in the optimizer's pre-step hook.
        closure_result = closure()
        self._after_closure(model, optimizer)
        if isinstance(model, pl.LightningModule) and model.automatic_optimization and closure_result is None:
            return None  # training_step returned None: Lightning skips this step
        return optimizer.step(**kwargs)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._engine().clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._engine().clip_grad_value_(float(clip_val))
