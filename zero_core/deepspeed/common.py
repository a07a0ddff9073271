"""What the readers of a DeepSpeed config's sections share: the result, the values that ask for what we
always do, and how a refused key is worded."""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .batch_size import GlobalBatch, resolve_global_batch

# DeepSpeed's "auto" (filled in by Hugging Face's integration): the value the framework would have.
AUTO = "auto"
_FP32_MB = 4 / 2**20  # DeepSpeed sizes buckets in elements; ours are in MB of fp32


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
    # A refused key is accepted when its value asks for what we do anyway (``"enabled": false``); a key
    # accepted without effect is still refused when its value is not one DeepSpeed takes (a wrong type).
    # That test, and the words the table prints for it.
    accepted_if: Callable[[Any], bool] | None = None
    accepted_text: str = ""


def disabled(value: Any) -> bool:
    """A section that is off: null, false, or an object whose ``enabled`` is false (DeepSpeed's default)."""
    if isinstance(value, Mapping):
        return value.get("enabled", False) is False
    return value is None or value is False


def equals(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected and type(value) is type(expected)


def apply_row(row: KeyRow, name: str, value: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    """The treatment of a key whose row says all there is to it (no setting to map)."""
    if row.treatment is Treatment.WITHOUT_EFFECT and row.accepted_if is not None and not row.accepted_if(value):
        refused.append(f"{name}={value!r} ({row.accepted_text})")
    elif row.treatment is Treatment.WITHOUT_EFFECT:
        result.without_effect[name] = row.meaning
    elif row.treatment is Treatment.REFUSED and not (row.accepted_if is not None and row.accepted_if(value)):
        refused.append(f"{name}={value!r} ({row.meaning})")
    elif row.treatment in (Treatment.MAPPED, Treatment.RESOLVED):
        raise AssertionError(f"{name}: a {row.treatment.value} key is read by its section's own code")


@dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config means here."""

    settings: dict[str, Any] = field(default_factory=dict)  # ZeroConfig fields
    precision: str | None = None  # "bf16", "fp16" or "fp32"; None: the config says nothing
    loop: dict[str, Any] = field(default_factory=dict)  # the loop keys the config sets (not "auto")
    # The "optimizer" and "scheduler" sections, checked, for the adapter to build (``"auto"`` values kept for it
    # to resolve from the framework's arguments); None: the config has none, the script builds its own.
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    # Keys accepted without effect (dotted name -> why nothing here changes with them): one setup line lists them.
    without_effect: dict[str, str] = field(default_factory=dict)
    # Where the config came from, for every later refusal: the file's path, or this for a dict.
    source: str = "the DeepSpeed config"

    def global_batch(
        self,
        ranks: int,
        accumulation: int | None = None,
        accumulation_name: str = "gradient_accumulation_steps",
        micro_batch: int | None = None,
    ) -> GlobalBatch | None:
        """``train_batch_size`` resolved over ``ranks`` data-parallel ranks (``batch_size.py``): the config's
        micro-batch and accumulation, else ``micro_batch`` (the DataLoader's, where the framework reads it, as
        Accelerate fills an "auto") and ``accumulation`` (the framework's, where it was given; its name in the
        messages: ``accumulation_name``). None when the config sets no ``train_batch_size``."""
        given = self.loop.get("gradient_accumulation_steps")
        if given is not None:
            accumulation, accumulation_name = given, "gradient_accumulation_steps"
        return resolve_global_batch(
            self.source,
            self.loop.get("train_batch_size"),
            self.loop.get("train_micro_batch_size_per_gpu", micro_batch),
            accumulation,
            ranks,
            accumulation_name,
        )

    def without_effect_line(self) -> str | None:
        """The setup line that lists the keys accepted without effect, grouped by why; None if there are none."""
        if not self.without_effect:
            return None
        by_reason: dict[str, list[str]] = {}
        for key, reason in self.without_effect.items():
            by_reason.setdefault(reason, []).append(key)
        groups = "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in by_reason.items())
        return f"DeepSpeed config: {len(self.without_effect)} key(s) accepted without effect here: {groups}."


def is_number(value: Any) -> bool:
    """A real number >= 0 (not a bool, which Python counts as one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _number(name: str, value: Any, apply: Any, refused: list[str]) -> None:
    """``apply(value)`` for a real number, or the key refused with its name (not a bare conversion error)."""
    if not is_number(value):
        refused.append(f'{name}={value!r} (a number >= 0, or "auto")')
    else:
        apply(value)


def rows_of(prefix: str, table: tuple, aliases: Mapping[str, str] | None = None) -> dict[str, KeyRow]:
    """A section's rows by key from its table of ``(key, treatment, meaning[, (accepted_if, accepted_text)])``;
    ``aliases`` (key -> DeepSpeed's other name for it) adds a row for the other name too."""
    rows = {}
    for key, treatment, meaning, *check in table:
        row = KeyRow(f"{prefix}{key}", treatment, meaning, *(check[0] if check else (None, "")))
        rows[key] = row
        other = (aliases or {}).get(key)
        if other is not None:  # DeepSpeed reads either name
            rows[other] = dataclasses.replace(row, key=f"{prefix}{other}", meaning=f"as {key}")
    return rows


def _prefetch_cap(elements: float, result: DeepSpeedSettings) -> None:
    result.settings["prefetch"] = "auto"  # as many units ahead as fit the cap (measured)
    result.settings["prefetch_cap_mb"] = float(elements) * _FP32_MB


# fp16's loss-scaling keys, which a bf16 section does not take (bf16 trains without a loss scale, in DeepSpeed too).
_LOSS_SCALING_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis")
_KEY_TABLE = "docs/deepspeed-keys.md lists every key DeepSpeed 0.19 reads and what each does here"


def _refusal(name: str, value: Any, known: Iterable[str]) -> str:
    """A key with no row (a typo, a newer DeepSpeed's key): the nearest of ``known`` (the keys DeepSpeed reads in the
    same section) if one is near, and in every case what to do."""
    section, _, leaf = name.rpartition(".")
    if section in ("bf16", "bfloat16") and (leaf in _LOSS_SCALING_KEYS or leaf == "min_loss_scale"):
        return f"{name}={value!r} (bf16 trains without a loss scale, under DeepSpeed too: delete the key)"
    nearest = difflib.get_close_matches(leaf, list(known), n=1, cutoff=0.75)
    if nearest:
        return f"{name}={value!r} (not a DeepSpeed key; did you mean {nearest[0]!r}?)"
    return f"{name}={value!r} (not a key DeepSpeed 0.19 reads: delete it, or correct it; {_KEY_TABLE})"
