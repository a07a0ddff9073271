"""DeepSpeed's ``optimizer`` and ``scheduler`` sections: checked when the config is read, built over the
model's parameters when the framework asks for its optimizer."""

from __future__ import annotations

from typing import Any

from .common import DeepSpeedSettings, _refusal


def read_optimizer_section(key: str, section: Any, result: DeepSpeedSettings, refused: list[str]) -> None:
    """``key`` is "optimizer" or "scheduler". Not built yet: refused with what to do."""
    refused.append(_refusal(key, section))
