"""A DeepSpeed config (``ds_config.json`` or its dict) read as ZeRO settings: what has a meaning here is
mapped, every other key is refused, all at once, before any process starts, each with the nearest setting.

DeepSpeed's keys fall in four kinds:
- settings of ours (``zero_optimization.stage``, offload, persistence, the prefetch size);
- the precision (``bf16``/``fp16``), which each framework takes from its own precision flag: returned for
  the adapter to apply or check;
- loop settings the framework owns (``gradient_clipping``, ``gradient_accumulation_steps``,
  ``train_micro_batch_size_per_gpu``): returned for the adapter to honour or refuse;
- DeepSpeed's own machinery with no counterpart (its optimizer and scheduler sections, tuning knobs of its
  buffers): accepted where the value asks for what we always do (``overlap_comm: true``), refused otherwise.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import OFFLOAD_MODES, user_settings

# DeepSpeed's "auto" (filled in by Hugging Face's integration): the value the framework would have.
AUTO = "auto"
_FP32_MB = 4 / 2**20  # DeepSpeed sizes buckets in elements; ours are in MB of fp32

# zero_optimization keys whose value, when it is this one, asks for what the engine always does.
_ALWAYS = {
    "overlap_comm": True,  # collectives on their own streams, overlapped with compute
    "contiguous_gradients": True,  # gradients live in flat per-unit buffers
    "reduce_scatter": True,  # gradients are reduce-scattered
    "allgather_partitions": True,  # parameters are all-gathered
    "stage3_gather_16bit_weights_on_model_save": True,  # a full save gathers the weights
    "round_robin_gradients": False,
    "elastic_checkpoint": False,
    "ignore_unused_parameters": True,  # a parameter without gradient is skipped, as DDP's find_unused
}
_TOP_ALWAYS = {"wall_clock_breakdown": False, "steps_per_print": None, "prescale_gradients": False}
_LOOP_KEYS = ("gradient_clipping", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu")


@dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config means here."""

    settings: dict[str, Any] = field(default_factory=dict)  # ZeroConfig fields
    precision: str | None = None  # "bf16", "fp16" or "fp32"; None: the config says nothing
    loop: dict[str, Any] = field(default_factory=dict)  # _LOOP_KEYS the config sets (not "auto")


def read_deepspeed_config(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"A DeepSpeed config is a dict or a JSON file's path, not {type(source).__name__}.")
    try:
        config = json.loads(Path(source).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{source}: not a readable DeepSpeed JSON config ({error}).") from error
    if not isinstance(config, dict):
        raise ValueError(f"{source}: a DeepSpeed config is a JSON object, found {type(config).__name__}.")
    return config


def from_deepspeed(source: Mapping[str, Any] | str | os.PathLike, stage_given: bool = False) -> DeepSpeedSettings:
    """The settings a DeepSpeed config means, or ValueError listing every key that cannot be honoured.
    ``stage_given``: the caller has the stage from elsewhere (a keyword or a flag), so a config without one
    is not refused for it."""
    config = read_deepspeed_config(source)
    result, refused = DeepSpeedSettings(), []
    for key, value in config.items():
        if key == "zero_optimization":
            _zero_section(value, result, refused)
        elif key in ("bf16", "fp16", "bfloat16"):
            _precision_section(key, value, result, refused)
        elif key in _LOOP_KEYS:
            if value != AUTO:
                _loop_value(key, value, result, refused)
        elif key == "train_batch_size":
            pass  # micro-batch x accumulation x world size: implied by the others and the launch
        elif key in _TOP_ALWAYS and (_TOP_ALWAYS[key] is None or value == _TOP_ALWAYS[key]):
            pass
        else:
            refused.append(_refusal(key, value))
    zero_section = config.get("zero_optimization")
    if not stage_given and (not isinstance(zero_section, Mapping) or "stage" not in zero_section):
        # DeepSpeed's default is stage 0 (no ZeRO at all): running any stage of ours would differ silently.
        refused.append(
            "zero_optimization.stage is not set (DeepSpeed then trains without ZeRO, stage 0; set it to 1, 2 or "
            "3, or train with plain DDP)"
        )
    if refused:
        raise ValueError(
            f"{source if not isinstance(source, Mapping) else 'the DeepSpeed config'}: these keys have no "
            "equivalent here and would be ignored, so they are refused: " + "; ".join(refused) + "."
        )
    return result


def _zero_section(section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if not isinstance(section, Mapping):
        refused.append(f"zero_optimization={section!r} (a JSON object of ZeRO options)")
        return
    for key, value in section.items():
        name = f"zero_optimization.{key}"
        if key == "stage":
            if isinstance(value, bool) or value not in (1, 2, 3):
                refused.append(f"{name}={value!r} (stages 1, 2 and 3; for stage 0 use plain DDP)")
            else:
                result.settings["stage"] = value
        elif key == "offload_optimizer":
            _offload(name, value, result, refused)
        elif key == "offload_param":
            _offload_param(name, value, result, refused)
        elif key == "stage3_param_persistence_threshold":
            if value != AUTO:
                _number(name, value, lambda n: result.settings.__setitem__("persistence_threshold", int(n)), refused)
        elif key == "stage3_prefetch_bucket_size":
            if value != AUTO:
                _number(name, value, lambda n: _prefetch_cap(n, result), refused)
        elif key in ("reduce_bucket_size", "allgather_bucket_size"):
            # DeepSpeed's communication buffers; ours are the units (wrap classes or bucket_size_mb), which
            # these must not resize (a 5e8-element unit would be gathered whole at stage 3). Training is the
            # same whatever they are.
            if value != AUTO:
                _number(name, value, lambda n: None, refused)
        elif key in _ALWAYS and value == _ALWAYS[key]:
            pass
        else:
            refused.append(_refusal(name, value))


def _offload(name: str, section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if not isinstance(section, Mapping):
        refused.append(f"{name}={section!r} (a JSON object with device, nvme_path, ratio)")
        return
    for key, value in section.items():
        if key == "device":
            if value not in OFFLOAD_MODES:
                refused.append(f"{name}.device={value!r} (none, cpu or nvme)")
            else:
                result.settings["offload_optimizer"] = value
        elif key == "nvme_path":
            _nvme_path(f"{name}.nvme_path", value, result, refused)
        elif key == "ratio":  # Twin-Flow: the share of the optimizer offloaded
            if value != AUTO:
                _number(f"{name}.ratio", value, lambda n: result.settings.__setitem__("offload_fraction", n), refused)
        elif key in ("pin_memory", "fast_init") or (key == "buffer_count" and isinstance(value, int)):
            pass  # host buffers are pinned on GPUs; the NVMe tier's reads ahead are offload_units_in_memory
        else:
            refused.append(_refusal(f"{name}.{key}", value))


def _nvme_path(name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    """Both offload sections may name a path: ours is one offload_dir, so they must agree."""
    earlier = result.settings.get("offload_dir")
    if earlier is not None and earlier != str(value):
        refused.append(f"{name}={value!r} (the other offload section's nvme_path is {earlier!r}: one directory)")
    else:
        result.settings["offload_dir"] = str(value)


def _offload_param(name: str, section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    if section is None:
        return  # DeepSpeed reads null as no parameter offload
    if not isinstance(section, Mapping):
        refused.append(f"{name}={section!r} (a JSON object with device)")
        return
    for key, value in section.items():
        if key == "device":
            if value not in OFFLOAD_MODES:
                refused.append(f"{name}.device={value!r} (none, cpu or nvme)")
            elif value != "none":
                result.settings["offload_params"] = value
        elif key == "nvme_path":
            _nvme_path(f"{name}.nvme_path", value, result, refused)
        elif key in ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu"):
            pass  # pinned on GPUs; DeepSpeed's NVMe staging buffers: ours are offload_units_in_memory
        else:
            refused.append(_refusal(f"{name}.{key}", value))


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


# What to do instead, for the DeepSpeed keys users bring most.
_HINTS = {
    "optimizer": "build the optimizer in the script (configure_optimizers, or pass it to prepare)",
    "scheduler": "build the scheduler in the script, over that optimizer",
    "zero_optimization.sub_group_size": "the offloaded step already runs unit by unit",
    "zero_optimization.overlap_comm": "collectives always overlap here; remove the key or set it true",
    "zero_optimization.stage3_max_live_parameters": "stage 3 keeps the running unit and `prefetch` units gathered",
    "zero_optimization.stage3_max_reuse_distance": "units are released after their forward and backward",
    "activation_checkpointing": "use torch.utils.checkpoint in the model (apply_activation_checkpointing); "
    "partition_activations and cpu_checkpointing are partition_activations and offload_activations here",
    "zero_allow_untested_optimizer": "any torch optimizer whose state is per element works",
}


def _number(name: str, value: Any, apply: Any, refused: list[str]) -> None:
    """``apply(value)`` for a real number, or the key refused with its name (not a bare conversion error)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        refused.append(f'{name}={value!r} (a number >= 0, or "auto")')
    else:
        apply(value)


def _prefetch_cap(elements: float, result: DeepSpeedSettings) -> None:
    result.settings["prefetch"] = "auto"  # as many units ahead as fit the cap (measured)
    result.settings["prefetch_cap_mb"] = float(elements) * _FP32_MB


def _loop_value(key: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    """The loop keys, checked here so every adapter gets a clean value: a count >= 1 or a clip >= 0."""
    if key == "gradient_clipping":
        _number(key, value, lambda n: result.loop.__setitem__(key, float(n)), refused)
    elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
        refused.append(f'{key}={value!r} (an integer >= 1, or "auto")')
    else:
        result.loop[key] = value


def _refusal(name: str, value: Any) -> str:
    if name in _HINTS:
        return f"{name}={value!r} ({_HINTS[name]})"
    leaf = name.rsplit(".", 1)[-1]
    nearest = difflib.get_close_matches(leaf, [s.name for s in user_settings()], n=1, cutoff=0.4)
    hint = f"the nearest setting here is {nearest[0]!r}" if nearest else "no setting here does this"
    return f"{name}={value!r} ({hint})"
