"""What the readers of a DeepSpeed config's sections share: the result, the values that ask for what we
always do, and how a refused key is worded."""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field
from typing import Any

from ..config import user_settings

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


class Treatment(enum.Enum):
    """What happens to one DeepSpeed key here. Read by the walker (``reading.py``) and printed in the
    generated key table, so the table is the code."""

    MAPPED = "mapped"  # becomes a setting of ours and trains as DeepSpeed does
    RESOLVED = "resolved"  # the framework's own value (its argument, or "auto" filled in from it)
    WITHOUT_EFFECT = "accepted without effect"  # a knob our design does another way: listed on a setup line
    REFUSED = "refused"  # training would differ: the error says what to do


@dataclass(frozen=True)
class KeyRow:
    """One DeepSpeed key (dotted: ``zero_optimization.offload_param.device``) and its treatment here. Each
    section's module declares the rows of its keys (``ROWS``); a key of a config with no row is refused."""

    key: str
    treatment: Treatment
    meaning: str  # mapped: the setting; resolved: the framework's value; without effect: why; refused: what to do


@dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config means here."""

    settings: dict[str, Any] = field(default_factory=dict)  # ZeroConfig fields
    precision: str | None = None  # "bf16", "fp16" or "fp32"; None: the config says nothing
    loop: dict[str, Any] = field(default_factory=dict)  # _LOOP_KEYS the config sets (not "auto")
    # The "optimizer" and "scheduler" sections, checked, for the adapter to build (``"auto"`` values kept for it
    # to resolve from the framework's arguments); None: the config has none, the script builds its own.
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    # Keys accepted without effect (dotted name -> why nothing here changes with them): one setup line lists them.
    without_effect: dict[str, str] = field(default_factory=dict)


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
