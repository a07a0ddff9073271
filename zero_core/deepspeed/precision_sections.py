"""DeepSpeed's ``fp16`` and ``bf16`` sections: the precision they ask for, and fp16's loss scaling as our
settings (``loss_scale`` and the ones beside it, which run DeepSpeed's rules: ``optim/loss_scaling.py``).

An fp16 section that is on (``"enabled": true``, or ``"auto"``, which the framework's flag decides) sets all six
loss-scaling settings: its keys, and DeepSpeed's defaults for the keys it leaves out (hysteresis 2, window
1000, floor 1), so the run scales as DeepSpeed's would. An fp16 section that is off sets nothing (DeepSpeed
reads nothing else from it either).

A bf16 section that is on sets ``skip_nonfinite_steps`` from ``check_grad_overflow`` (DeepSpeed's default: true),
as DeepSpeed's ZeRO stages 1 and 2 read it; stage 3 skips such a step whatever the key says, and so do fp32 and
fp16 at every stage, which the stage's reader sets (``zero_section.py``), in whichever order the sections come.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .common import AUTO, DeepSpeedSettings, KeyRow, Treatment, _refusal, apply_row, disabled, equals

MAPPED, WITHOUT_EFFECT, REFUSED = Treatment.MAPPED, Treatment.WITHOUT_EFFECT, Treatment.REFUSED


def _is_int(value: Any) -> bool:
    """An integer, or a float with no fraction (DeepSpeed's pydantic takes 1e3 for 1000)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _ScalerKey(NamedTuple):
    """An fp16 key that becomes one of our loss-scaling settings."""

    setting: str
    default: Any  # DeepSpeed's (DeepSpeedFP16Config), for a section that leaves the key out
    accepts: Callable[[Any], bool]  # the values DeepSpeed trains with
    expected: str  # those values, in the refusal's words
    convert: Callable[[Any], Any]
    here: str = ""  # what the setting does, where its name does not say it


# DeepSpeed's dynamic scale starts at 2**initial_scale_power (a float has exponents up to 1023).
_SCALER_KEYS = {
    "loss_scale": _ScalerKey(
        "loss_scale",
        0,
        lambda v: _is_number(v) and v >= 0,
        "a number >= 0; 0: dynamic",
        float,
        " (0: dynamic; a fixed scale still skips a step that overflows, as DeepSpeed's ZeRO does)",
    ),
    "initial_scale_power": _ScalerKey(
        "initial_loss_scale",
        16,
        lambda v: _is_int(v) and abs(v) <= 1000,
        "an integer: the first scale is 2**it",
        lambda power: 2.0 ** int(power),
        " = 2**initial_scale_power",
    ),
    "loss_scale_window": _ScalerKey("loss_scale_window", 1000, lambda v: _is_int(v) and v >= 1, "an integer >= 1", int),
    "hysteresis": _ScalerKey(
        "loss_scale_hysteresis",
        2,
        lambda v: _is_int(v) and v >= 1,
        "an integer >= 1; with 0 or less DeepSpeed never lowers the scale",
        int,
    ),
    "consecutive_hysteresis": _ScalerKey(
        "consecutive_hysteresis", False, lambda v: isinstance(v, bool), "true or false", bool
    ),
    "min_loss_scale": _ScalerKey(
        "min_loss_scale",
        1,
        lambda v: _is_number(v) and v > 0,
        "a number > 0, as DeepSpeed takes it",
        float,
        " (an overflow with the scale at it stops the run, as DeepSpeed's does)",
    ),
}

_BOOL = (lambda value: isinstance(value, bool), "true or false")
_FALSE = (equals(False), "accepted as false")
_ENABLED = "the precision: true must agree with the framework's flag ({}); \"auto\" takes the flag's"
_FP16_ROWS = {
    "enabled": KeyRow("fp16.enabled", MAPPED, _ENABLED.format("16-mixed")),
    **{
        key: KeyRow(
            f"fp16.{key}", MAPPED, f"{scaler.setting}{scaler.here}; DeepSpeed's default when left out: {scaler.default}"
        )
        for key, scaler in _SCALER_KEYS.items()
    },
    "auto_cast": KeyRow(
        "fp16.auto_cast",
        WITHOUT_EFFECT,
        "floating inputs are always cast to the compute dtype (a script that runs without it passes fp16 already)",
        *_BOOL,
    ),
    "fp16_master_weights_and_grads": KeyRow(
        "fp16.fp16_master_weights_and_grads", REFUSED, "master weights and their gradients are fp32 here", *_FALSE
    ),
}
_BF16_ROWS = {
    "enabled": KeyRow("bf16.enabled", MAPPED, _ENABLED.format("bf16-mixed or bf16-true")),
    "immediate_grad_update": KeyRow(
        "bf16.immediate_grad_update",
        WITHOUT_EFFECT,
        "gradients always accumulate in fp32 buffers as each backward ends",
        *_BOOL,
    ),
    "check_grad_overflow": KeyRow(
        "bf16.check_grad_overflow",
        MAPPED,
        "skip_nonfinite_steps (stages 1 and 2; DeepSpeed's default when left out: true; stage 3 skips a step whose "
        "gradients hold inf or NaN whatever it says, as DeepSpeed's does)",
    ),
    "bf16_master_weights_and_grads": KeyRow(
        "bf16.bf16_master_weights_and_grads", REFUSED, "master weights and their gradients are fp32 here", *_FALSE
    ),
    "bf16_optimizer_states": KeyRow(
        "bf16.bf16_optimizer_states", REFUSED, "the optimizer state is fp32 here, as its master weights", *_FALSE
    ),
}
# DeepSpeed reads "bfloat16" where a config has no "bf16" (its older name).
_BFLOAT16_ROWS = {
    key: dataclasses.replace(row, key=f"bfloat16.{key}", meaning=f"as bf16.{key}") for key, row in _BF16_ROWS.items()
}
_SECTION_ROWS = {"fp16": _FP16_ROWS, "bf16": _BF16_ROWS, "bfloat16": _BFLOAT16_ROWS}
ROWS = (*_FP16_ROWS.values(), *_BF16_ROWS.values(), *_BFLOAT16_ROWS.values())


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
    if not isinstance(section, Mapping):
        return
    rows = _SECTION_ROWS[key]
    for option, value in section.items():
        name = f"{key}.{option}"
        if option not in rows:
            refused.append(_refusal(name, value, rows))
        elif key == "fp16" and option in _SCALER_KEYS:
            _scaler_key(name, _SCALER_KEYS[option], value, refused)
        elif option == "check_grad_overflow":
            if not isinstance(value, bool):
                refused.append(f"{name}={value!r} (true or false)")
        elif option != "enabled":
            apply_row(rows[option], name, value, result, refused)
    if key != "fp16" and not disabled(section):
        _overflow_check(section.get("check_grad_overflow", True), result)
    if key == "fp16" and not disabled(section):  # on now, or by the flag later: DeepSpeed's scaler either way
        for option, scaler in _SCALER_KEYS.items():
            value = section.get(option, scaler.default)
            if scaler.accepts(value):
                result.settings[scaler.setting] = scaler.convert(value)


def _scaler_key(name: str, scaler: _ScalerKey, value: Any, refused: list[str]) -> None:
    if not scaler.accepts(value):
        auto = '; "auto" is for fp16.enabled only' if value == AUTO else ""
        refused.append(f"{name}={value!r} ({scaler.expected}{auto})")


def _overflow_check(check: Any, result: DeepSpeedSettings) -> None:
    """bf16.check_grad_overflow, read by DeepSpeed's ZeRO stages 1 and 2 only: at stage 3 (set by the stage's
    reader, before or after this section) a step whose gradients are not finite is skipped whatever it says."""
    if isinstance(check, bool) and result.settings.get("stage") != 3:
        result.settings["skip_nonfinite_steps"] = check
