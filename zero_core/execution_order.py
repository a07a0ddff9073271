"""The order units run in, recorded in the first forward and first backward,
which is what stage-3 prefetching follows."""

from __future__ import annotations


class ExecutionOrder:
    def __init__(self) -> None:
        self.forward: list[int] = []
        self.backward: list[int] = []
        self._forward_recorded = False
        self._backward_recorded = False

    def record_forward(self, unit_index: int) -> None:
        if not self._forward_recorded and unit_index not in self.forward:
            self.forward.append(unit_index)

    def record_backward(self, unit_index: int) -> None:
        if not self._backward_recorded and unit_index not in self.backward:
            self.backward.append(unit_index)

    def end_forward(self) -> None:
        self._forward_recorded = True

    def end_backward(self) -> None:
        if self.backward:
            self._backward_recorded = True

    def next_forward(self, unit_index: int, count: int) -> list[int]:
        return self._after(self.forward, unit_index, count) if self._forward_recorded else []

    def next_backward(self, unit_index: int, count: int) -> list[int]:
        return self._after(self.backward, unit_index, count) if self._backward_recorded else []

    @staticmethod
    def _after(order: list[int], unit_index: int, count: int) -> list[int]:
        if unit_index not in order:
            return []
        position = order.index(unit_index)
        return order[position + 1 : position + 1 + count]
