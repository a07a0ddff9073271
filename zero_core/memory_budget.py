"""The memory a run's settings are chosen for (``ZeroConfig.memory_budget``; ``zero_core.fit``): bytes per rank
for the device, the host and the disk, each part a size, not limited, or for the device "auto" (this rank's
share of its device's memory, read at setup).

With a budget, the engine's setup chooses the stage, prefetch, offload and activation checkpointing itself
(``memory/fit.py``), so the settings it chooses are refused beside it rather than silently replaced, and so are
the settings its model of memory does not count yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .settings import parse_bytes

AUTO = "auto"  # the device part: this rank's share of its device's memory, read at setup
BUDGET_PARTS = ("device", "host", "disk")
# Exact spellings, largest first, for the text form (parse(format(b)) == b).
_EXACT_UNITS = (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6))
_EXACT_UNITS += (("KiB", 2**10), ("KB", 10**3))

# The settings memory_budget chooses, with the value that leaves the choice to it.
CHOSEN_BY_BUDGET = {
    "stage": 3,
    "prefetch": 1,
    "offload_optimizer": "none",
    "offload_params": "none",
    "offload_fraction": 1.0,
    "persistence_threshold": 0,
}
# Settings whose memory the budget's model does not count: refused beside it, with what they are at rest.
NOT_COUNTED_BY_BUDGET = {
    "tensor_parallel_size": 1,
    "quantize_weights": False,
    "quantize_gradients": False,
    "secondary_shard_group_size": None,
    "offload_activations": False,
    "partition_activations": False,
    "offload_step_in_backward": False,
}


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes per rank for each tier; None: not limited; the device part may be ``"auto"``."""

    device: int | str | None = None
    host: int | None = None
    disk: int | None = None

    def __post_init__(self) -> None:
        for name in BUDGET_PARTS:
            value = getattr(self, name)
            if name == "device" and value == AUTO:
                continue
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                auto = ', or "auto" (the device\'s own)' if name == "device" else ""
                raise ValueError(
                    f"MemoryBudget.{name}={value!r} is invalid: use bytes per rank (a positive integer), or None for "
                    f'no limit{auto}; MemoryBudget.of("20GiB") reads sizes.'
                )

    @classmethod
    def of(cls, value: MemoryBudget | str | int | Mapping[str, Any]) -> MemoryBudget:
        """``"20GiB"`` (the device), ``"device=20GiB,host=200GiB,disk=2TB"``, ``"auto"``, ``{"device": "20GiB"}``
        (None: not limited), or bytes."""
        if isinstance(value, MemoryBudget):
            return value
        if isinstance(value, Mapping):
            parts = dict(value)
        elif isinstance(value, str) and "=" in value:
            parts = {}
            for part in (piece.strip() for piece in value.split(",") if piece.strip()):
                name, equals, amount = (side.strip() for side in part.partition("="))
                if not equals or name in parts:
                    raise ValueError(
                        f"memory_budget={value!r}: {part!r} is not one tier=size of its own; write each tier once, "
                        'e.g. "device=20GiB,host=200GiB".'
                    )
                parts[name] = amount
        else:
            parts = {"device": value}
        unknown = sorted(set(map(str, parts)) - set(BUDGET_PARTS))
        if unknown:
            raise ValueError(
                f"memory_budget={value!r}: unknown part {unknown}; use device=, host= and disk=, e.g. "
                '"device=20GiB,host=200GiB".'
            )
        return cls(**{name: _part_bytes(name, amount, value) for name, amount in parts.items()})

    @property
    def device_is_auto(self) -> bool:
        return self.device == AUTO

    def __str__(self) -> str:
        """The text form, exact: ``device=20GiB,disk=2TB`` (``MemoryBudget.of`` reads it back)."""
        return ",".join(f"{name}={_exact(getattr(self, name))}" for name in BUDGET_PARTS if getattr(self, name))


MemoryBudgetLike = MemoryBudget | str | int | None  # what the strategies' keyword takes


def as_memory_budget(value: MemoryBudgetLike | Mapping[str, Any]) -> MemoryBudget | None:
    """None stays None (no budget: the settings as given); anything else is read by ``MemoryBudget.of``."""
    return None if value is None else MemoryBudget.of(value)


def parse_memory_budget_text(text: str | Mapping[str, Any] | MemoryBudget | int | None) -> str | None:
    """Accelerate's text form (a flag, a variable, a YAML value, a ``ZeroPlugin`` field) in its exact
    spelling, checked: ``"20GiB"`` -> ``"device=20GiB"``; ``"none"`` or nothing -> None."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "none")):
        return None
    return str(MemoryBudget.of(text))


def format_memory_budget_text(text: str | None) -> str:
    return "none" if text is None else text


def memory_budget_of_text(text: str | None, model: Any) -> MemoryBudget | None:
    """The text form as ``ZeroConfig`` holds it (the model is not needed)."""
    return as_memory_budget(text)


def budget_of_setting(value: Any) -> MemoryBudget:
    """``ZeroConfig(memory_budget="20GiB")``: the text read, a refusal naming the setting."""
    try:
        return MemoryBudget.of(value)
    except ValueError as error:
        text = str(error)
        raise ValueError(
            f"ZeroConfig.{text}" if text.startswith("memory_budget=") else f"ZeroConfig.memory_budget: {text}"
        ) from None


def check_memory_budget(config: Any) -> None:
    """With a budget the settings it chooses are left to it, and those it does not count are off
    (``config``: a ``ZeroConfig``)."""
    if config.memory_budget is None:
        return
    if not isinstance(config.memory_budget, MemoryBudget):
        raise ValueError(
            "ZeroConfig.memory_budget must be a zero_core.MemoryBudget or None (MemoryBudget.of reads text)."
        )
    if config.memory_budget.device is None:
        raise ValueError(
            f"ZeroConfig.memory_budget={str(config.memory_budget)!r} has no device part; give the device's bytes "
            'per rank (e.g. "device=20GiB,host=200GiB"), or "auto".'
        )
    chosen = [name for name, free in CHOSEN_BY_BUDGET.items() if getattr(config, name) != free]
    if chosen:
        raise ValueError(
            f"ZeroConfig.memory_budget chooses {', '.join(CHOSEN_BY_BUDGET)} itself; {', '.join(chosen)} "
            "set beside it would be overruled. Leave them unset, or drop memory_budget to choose them yourself "
            "(zero_core.fit(...) shows what it would choose)."
        )
    uncounted = [name for name, off in NOT_COUNTED_BY_BUDGET.items() if getattr(config, name) != off]
    if uncounted:
        raise ValueError(
            f"ZeroConfig.memory_budget's model of memory does not count {', '.join(uncounted)} yet: drop "
            f"{'it' if len(uncounted) == 1 else 'them'} or memory_budget."
        )


def _part_bytes(part: str, amount: Any, whole: Any) -> int | str | None:
    if amount is None:
        return None
    if part == "device" and isinstance(amount, str) and amount.strip().lower() == AUTO:
        return AUTO
    if isinstance(amount, float) and amount.is_integer():
        amount = int(amount)
    try:
        nbytes = parse_bytes(amount) if isinstance(amount, str) else amount
    except ValueError as error:
        raise ValueError(f"memory_budget={whole!r}: the {part} part {error}") from None
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(
            f"memory_budget={whole!r}: the {part} part {amount!r} is invalid: use bytes per rank, a positive "
            'integer or a size such as "20GiB" or "40GB".'
        )
    return nbytes


def _exact(value: int | str) -> str:
    if isinstance(value, str):
        return value
    for name, unit in _EXACT_UNITS:
        if value % unit == 0:
            return f"{value // unit}{name}"
    return str(value)
