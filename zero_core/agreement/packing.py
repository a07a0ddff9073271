"""The one packing every agreement of integers rides on: each value and its negation, all-reduced
with MAX, give its highest and lowest over ranks in a single collective."""

from __future__ import annotations


def with_negations(values: list[float]) -> list[float]:
    """``values`` then their negations: after a MAX all-reduce, each value's highest then lowest (negated)."""
    return [*values, *(-v for v in values)]


def differing_values(checks: dict[str, int], reduced: list[float]) -> list[str]:
    """``reduced`` ends with ``checks``' values then their negations, all-reduced with MAX
    (each value's highest and lowest over ranks): the values that differ between ranks,
    each as "name: lowest on some ranks, highest on others"; empty when all agree."""
    count = len(checks)
    highest = reduced[len(reduced) - 2 * count : len(reduced) - count]
    lowest = [-v for v in reduced[len(reduced) - count :]]
    return [
        f"{name}: {int(lo)} on some ranks, {int(hi)} on others"
        for name, lo, hi in zip(checks, lowest, highest)
        if lo != hi
    ]
