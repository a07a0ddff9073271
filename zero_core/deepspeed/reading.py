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

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .common import _LOOP_KEYS, _TOP_ALWAYS, AUTO, DeepSpeedSettings, _loop_value, _refusal
from .optimizer_sections import read_optimizer_section
from .precision import _precision_section
from .zero_section import _zero_section


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
        elif key in ("optimizer", "scheduler"):
            read_optimizer_section(key, value, result, refused)
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
