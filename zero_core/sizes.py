"""Byte counts written for people: the unit chosen by magnitude."""

from __future__ import annotations

import math
import re


def human_bytes(nbytes: float) -> str:
    """``1000 B``, ``3.72 MiB``, ``1.50 GiB``: the unit chosen by magnitude, so a figure never shows as zero (a
    directory of 1 MiB is not "0.00 GiB"), with at least three significant digits above 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} TiB"


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
BYTE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_quantity(text: str, units: dict[str, int], example: str) -> int:
    """A positive number with an optional unit of ``units`` (case aside), rounded; ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if match is None or match.group(2) not in units:
        raise ValueError(f"{text!r} is not a size: use a number with an optional unit, e.g. {example}")
    number = float(match.group(1)) * units[match.group(2)]
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not a finite size: use e.g. {example}")
    value = round(number)
    if value < 1:
        raise ValueError(f"{text!r} is not positive: use e.g. {example}")
    return value


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``8.5e10`` (bytes): B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (of 1024)."""
    return parse_quantity(text, BYTE_UNITS, "80GiB, 40GB or 8e10")
