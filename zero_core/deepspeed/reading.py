"""A DeepSpeed config (``ds_config.json`` or its dict) read as ZeRO settings, all at once, before any process
starts. Every key DeepSpeed reads has a row (``key_table.py`` gathers them; the docs print them): mapped to a
setting of ours, resolved from the framework's own value, accepted without effect (listed at setup), or refused
with what to do. A key with no row (a typo, a newer DeepSpeed's key) is refused with the nearest known key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .common import DeepSpeedSettings, _refusal
from .key_table import top_level_keys
from .optimizer_sections import read_optimizer_section
from .optimizers import MUON_TYPE
from .precision_sections import _precision_section
from .top_level import read_top_level
from .zero_section import _zero_section

Source = Mapping[str, Any] | str | os.PathLike


def read_deepspeed_config(source: Source) -> dict[str, Any]:
    """The config as a dict; a file that is missing, unreadable or not a JSON object is a ValueError naming
    the file and what is wrong with it."""
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"A DeepSpeed config is a dict or a JSON file's path, not {type(source).__name__}.")
    path = Path(source)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"{source}: the DeepSpeed config file {what}; pass the path of its JSON file.")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{source}: not valid JSON at line {error.lineno}, column {error.colno} ({error.msg}); "
            "a DeepSpeed config is one JSON object (no comments, no trailing commas)."
        ) from error
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{source}: the DeepSpeed config file cannot be read ({error}).") from error
    if not isinstance(config, dict):
        raise ValueError(f"{source}: a DeepSpeed config is a JSON object, found {type(config).__name__}.")
    return config


def muon_clipping_problem(optimizer_section: Any, clip: Any) -> str | None:
    """Why a DeepSpeed config's optimizer section cannot train clipped at ``clip`` (the norm the config, or the
    framework filling it, resolves to; None: it can). DeepSpeed's ZeRO puts Muon's orthogonalised update in place
    of the gradient before it clips, so its clipping clips the update; here (as in torch and every framework)
    clipping scales the gradient before Muon's step. Measured apart, they train differently: refused rather than
    run another way. Each adapter asks again once its framework has filled the clipping in."""
    is_muon = isinstance(optimizer_section, Mapping) and str(optimizer_section.get("type", "")).lower() == MUON_TYPE
    if not is_muon or not clip:
        return None
    return (
        f'gradient_clipping={clip!r} with "type": "Muon" (DeepSpeed clips Muon\'s orthogonalised update, which '
        "has replaced the gradient by then; here clipping scales the gradient before Muon's step, as torch and "
        "the frameworks clip it: set it to 0, and clip the gradients with the framework if you want them "
        "clipped: Trainer gradient_clip_val, TrainingArguments max_grad_norm, accelerator.clip_grad_norm_)"
    )


def _muon_clipping(result: DeepSpeedSettings) -> list[str]:
    problem = muon_clipping_problem(result.optimizer, result.loop.get("gradient_clipping"))
    return [problem] if problem else []


def from_deepspeed(source: Source, stage_given: bool = False) -> DeepSpeedSettings:
    """The settings a DeepSpeed config means, or one ValueError listing every key that cannot be honoured.
    ``stage_given``: the caller has the stage from elsewhere (a keyword or a flag), so a config without one
    is not refused for it."""
    config = read_deepspeed_config(source)
    where = "the DeepSpeed config" if isinstance(source, Mapping) else str(source)
    result, refused = DeepSpeedSettings(source=where), []
    for key, value in config.items():
        if key == "zero_optimization":
            _zero_section(value, result, refused)
        elif key in ("optimizer", "scheduler"):
            read_optimizer_section(key, value, result, refused)
        elif key in ("bf16", "fp16", "bfloat16"):
            _precision_section(key, value, result, refused)
        elif not read_top_level(key, value, result, refused):
            refused.append(_refusal(key, value, top_level_keys()))
    refused += _muon_clipping(result)
    zero_section = config.get("zero_optimization")
    if not stage_given and (not isinstance(zero_section, Mapping) or "stage" not in zero_section):
        # DeepSpeed's default is stage 0 (no ZeRO at all): running any stage of ours would differ silently.
        refused.append(
            "zero_optimization.stage is not set (DeepSpeed then trains without ZeRO, stage 0; set it to 1, 2 or "
            "3, or train with plain DDP)"
        )
    if refused:
        raise ValueError(
            f"{where}: {len(refused)} key(s) cannot be honoured here, so nothing was started: "
            + "; ".join(refused)
            + "."
        )
    return result
