"""DeepSpeed's ``fp16`` and ``bf16`` sections: the precision they ask for, and fp16's loss-scaler knobs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .common import AUTO, DeepSpeedSettings


def _precision_section(key: str, section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    enabled = section.get("enabled", False) if isinstance(section, Mapping) else section
    if not isinstance(enabled, bool) and enabled != AUTO:
        refused.append(f'{key}.enabled={enabled!r} (true, false or "auto")')
        return
    dtype = "fp16" if key == "fp16" else "bf16"
    if enabled is True:  # disabled or "auto": the framework's precision flag decides
        if result.precision not in (None, dtype):
            refused.append(f"{key}.enabled with {result.precision} enabled too (one precision)")
        result.precision = dtype
    if dtype == "fp16" and isinstance(section, Mapping):  # whether enabled now or by the flag later
        # Our scaler: dynamic, starts at 2**16, halves on an overflow, doubles after 2000 clean steps.
        ours = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000, "hysteresis": 1}
        for option, value in section.items():
            # Inputs are cast to the compute dtype (auto_cast); with hysteresis 1 the others change nothing
            # unless the scale falls below 1.
            if option in ("enabled", "auto_cast", "consecutive_hysteresis") or (
                option == "min_loss_scale" and isinstance(value, (int, float)) and value <= 1
            ):
                continue
            if option not in ours or value != ours[option]:
                expected = f"{ours[option]}" if option in ours else "not set"
                refused.append(f"fp16.{option}={value!r} (our dynamic loss scaler has {option} {expected})")
