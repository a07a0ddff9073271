"""The order units run in, which stage-3 prefetching follows.

Each forward and each backward is recorded anew; prefetching predicts from
the previous one. The prediction is a guess, never a promise: a unit that
runs out of the predicted order (layerdrop, a branch, generation, an eval
forward before training) moves a cursor through the previous order, and
whatever was prefetched and did not run is resharded by the runtime (the
live-unit bound holds whatever the order does). At the end of each pass the
recording replaces the previous one when it differs, and ``changes`` counts
how often that happened.
"""

from __future__ import annotations


class PassOrder:
    """One kind of pass (forward or backward): the last recorded order and the one being recorded."""

    def __init__(self) -> None:
        self.previous: list[int] = []
        self.current: list[int] = []
        self.changes = 0
        self._cursor = 0  # position in ``previous`` just after the last unit matched

    def record(self, unit_index: int, count: int) -> list[int]:
        """Record that ``unit_index`` runs now; return up to ``count`` units predicted to run next."""
        if unit_index in self.current:
            return []  # a unit running again (a reused block): it is already live
        self.current.append(unit_index)
        try:
            position = self.previous.index(unit_index, self._cursor)
        except ValueError:
            return []  # not where the last pass had it: no prediction until one matches again
        self._cursor = position + 1
        # Nothing past the cursor has run yet: every unit recorded was found before it (or not at all).
        return self.previous[self._cursor : self._cursor + count]

    def discard(self) -> None:
        """The pass raised: forget what it recorded."""
        self.current = []
        self._cursor = 0

    def end(self) -> None:
        if self.current and self.current != self.previous:
            if self.previous:
                self.changes += 1
            self.previous = self.current
        self.current = []
        self._cursor = 0


class ExecutionOrder:
    def __init__(self) -> None:
        self.forward = PassOrder()
        self.backward = PassOrder()

    @property
    def changes(self) -> int:
        """How many times a forward or backward ran its units in another order than the one before."""
        return self.forward.changes + self.backward.changes
