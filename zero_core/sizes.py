"""Byte counts written for people: the unit chosen by magnitude."""

from __future__ import annotations


def human_bytes(nbytes: float) -> str:
    """``1000 B``, ``3.72 MiB``, ``1.50 GiB``: the unit chosen by magnitude, so a figure never shows as zero (a
    directory of 1 MiB is not "0.00 GiB"), with at least three significant digits above 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} TiB"
