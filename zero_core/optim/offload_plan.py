"""Which units' optimizer work leaves the device (``offload_optimizer`` with ``offload_fraction``)."""

from __future__ import annotations


def units_to_offload(sizes: list[int], fraction: float) -> set[int]:
    """The indices of the units offloaded: the largest first, as many as keep the offloaded share of the
    elements at most ``fraction`` (at least the largest one). ``sizes`` are the units' parameter counts,
    the same on every rank, so every rank chooses the same units."""
    chosen: set[int] = set()
    offloaded = 0
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if not chosen or offloaded + sizes[index] <= fraction * sum(sizes):
            chosen.add(index)
            offloaded += sizes[index]
    return chosen
