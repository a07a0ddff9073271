"""The params of each schedule DeepSpeed's ``scheduler`` section names, with the values DeepSpeed 0.19 trains
with: what ``read_optimizer_section`` checks, and what the key table prints."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from torch.optim.lr_scheduler import LRScheduler

from .schedulers import LINEAR, LOG, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _per_group(value: Any) -> bool:
    return _number(value) or (isinstance(value, list) and bool(value) and all(_number(v) for v in value))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Param(NamedTuple):
    accepts: Callable[[Any], bool]
    expected: str  # the values accepts() takes, in the refusal's words


# "auto" is filled for these by Hugging Face's Trainer and Accelerate (never by Lightning).
AUTO_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
_PER_GROUP = "a number, or a list with one per param group"
_STEPS = Param(lambda v: _int(v) and v >= 1, "an integer >= 1 (DeepSpeed takes no other)")
_TYPE = Param(lambda v: v in (LOG, LINEAR), '"log" or "linear" (DeepSpeed warms up by "log" for any other)')
_TOTAL = Param(lambda v: _number(v) and v >= 0, "a number of steps >= 0")
_START = Param(lambda v: v == -1, "-1: resume from a checkpoint instead, which holds the schedule's step")
_WARMUP = {
    "warmup_min_lr": Param(_per_group, _PER_GROUP),
    "warmup_max_lr": Param(_per_group, _PER_GROUP),
    "warmup_num_steps": _STEPS,
    "warmup_type": _TYPE,
    "last_batch_iteration": _START,
}
_NUMBER = Param(_number, "a number")
_STAIRS = Param(lambda v: _int(v) and v >= 0, "an integer >= 0 (0: no stairs)")

SCHEDULES: dict[str, tuple[type[LRScheduler], dict[str, Param], tuple[str, ...]]] = {
    # type -> (class, its params, the params DeepSpeed requires)
    "WarmupLR": (WarmupLR, _WARMUP, ()),
    "WarmupDecayLR": (WarmupDecayLR, {**_WARMUP, "total_num_steps": _TOTAL}, ("total_num_steps",)),
    "WarmupCosineLR": (
        WarmupCosineLR,
        {
            "total_num_steps": _TOTAL,
            "warmup_min_ratio": Param(_number, "a number"),
            "warmup_num_steps": _STEPS,
            "cos_min_ratio": Param(_number, "a number"),
            "warmup_type": _TYPE,
            "last_batch_iteration": _START,
        },
        ("total_num_steps",),
    ),
    "OneCycle": (
        OneCycle,
        {
            "cycle_min_lr": Param(_per_group, _PER_GROUP),
            "cycle_max_lr": Param(_per_group, _PER_GROUP),
            "decay_lr_rate": _NUMBER,
            "cycle_first_step_size": Param(lambda v: _number(v) and v > 0, "a number > 0"),
            "cycle_second_step_size": Param(lambda v: v is None or (_number(v) and v >= 0), "a number >= 0"),
            "cycle_first_stair_count": _STAIRS,
            "cycle_second_stair_count": Param(lambda v: v is None or (_int(v) and v >= 0), _STAIRS.expected),
            "decay_step_size": Param(lambda v: _number(v) and v >= 0, "a number >= 0 (0: no decay)"),
            "cycle_momentum": Param(lambda v: isinstance(v, bool), "true or false"),
            "cycle_min_mom": Param(_per_group, _PER_GROUP),
            "cycle_max_mom": Param(_per_group, _PER_GROUP),
            "decay_mom_rate": _NUMBER,
            "last_batch_iteration": _START,
        },
        ("cycle_min_lr", "cycle_max_lr"),
    ),
    "LRRangeTest": (
        LRRangeTest,
        {
            "lr_range_test_min_lr": Param(_per_group, _PER_GROUP),
            "lr_range_test_step_size": _STEPS,
            "lr_range_test_step_rate": _NUMBER,
            "lr_range_test_staircase": Param(lambda v: isinstance(v, bool), "true or false"),
            "last_batch_iteration": _START,
        },
        (),
    ),
}


def schedule_param_names() -> list[str]:
    return sorted({name for _, params, _ in SCHEDULES.values() for name in params})
