"""Which units' optimizer work leaves the device (``offload_optimizer`` with ``offload_fraction``)."""

from __future__ import annotations


def units_to_offload(trainable: list[int], fraction: float) -> set[int]:
    """The indices of the units offloaded: the largest first, as many as keep the offloaded share of the
    optimizer's elements at most ``fraction`` (at least the largest one). ``trainable`` are the units'
    trainable parameter counts (the elements the optimizer holds state for; a frozen unit has none and is
    never chosen), the same on every rank, so every rank chooses the same units."""
    chosen: set[int] = set()
    offloaded = 0
    for index in sorted(range(len(trainable)), key=lambda i: (-trainable[i], i)):
        if trainable[index] == 0:
            break
        if not chosen or offloaded + trainable[index] <= fraction * sum(trainable):
            chosen.add(index)
            offloaded += trainable[index]
    return chosen
