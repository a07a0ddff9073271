"""When each unit's gradients are reduce-scattered during a backward.

The order of collectives must never depend on data: a rank whose gradients
never reached a unit (its output unused on this rank, an expert that got no
tokens) must still issue that unit's reduce-scatter at the same place in the
sequence as every other rank. So every synchronising backward reduces every
trainable unit exactly once, in one fixed order (reverse unit order, which
is the order backward finishes units in most models), and a unit is issued
only when it is next in that order and ready (its backward finished, or it
did not run). A unit that finishes out of order waits for its turn; a unit
whose backward never comes on this rank is issued at the end of backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from ..unit import FlatUnit, PendingReduce

# Reduce-scatters in flight; each holds a full unit of gradients, so this
# bounds stage-2/3 gradient memory to a few units.
MAX_PENDING_REDUCES = 2


class ReduceListener(Protocol):
    """Told of each unit's reduce as it is issued and as it lands, in reduce order (offload_step_in_backward's
    worker steps the unit then: ``step_in_backward.py``)."""

    def unit_issued(self, unit: FlatUnit) -> None: ...

    def unit_reduced(self, unit: FlatUnit) -> None: ...


class ReduceSchedule:
    def __init__(self, units: list[FlatUnit], told: ReduceListener | None = None):
        self.units = units
        self.told = told
        self._pending: deque[tuple[FlatUnit, PendingReduce]] = deque()
        # Which units were reduced since creation, as a sum of (unit index + 1): compared
        # across ranks at each step, so ranks that froze different units are caught.
        self.issued_fingerprint = 0
        self.reset()

    def reset(self) -> None:
        """A new backward: nothing issued or finished yet (call with nothing in flight).

        Units whose parameters are all frozen now are left out (their
        gradients are never read); every rank freezes alike.
        """
        self.sequence = [unit for unit in reversed(self.units) if unit.trainable]
        self._next = 0
        self._finished: set[int] = set()
        self._issued: set[int] = set()

    def mark_finished(self, unit: FlatUnit) -> None:
        self._finished.add(unit.index)

    def finished(self, unit: FlatUnit) -> bool:
        return unit.index in self._finished

    def was_issued(self, unit: FlatUnit) -> bool:
        return unit.index in self._issued

    def advance(self, ready: Callable[[FlatUnit], bool]) -> None:
        """Issue the next units in the sequence for as long as they are ready."""
        while self._next < len(self.sequence) and ready(self.sequence[self._next]):
            unit = self.sequence[self._next]
            self._next += 1
            self._issued.add(unit.index)
            self.issued_fingerprint += unit.index + 1
            if self.told is not None:
                self.told.unit_issued(unit)
            pending = unit.start_reduce()
            if pending is not None:
                self._pending.append((unit, pending))
            while len(self._pending) > MAX_PENDING_REDUCES:
                self._finish_oldest()
        # Told of each reduce as soon as it landed (not when the cap forces a wait): the early step of
        # that unit starts while backward goes on.
        while self.told is not None and self._pending and self._pending[0][1].handle.is_completed():
            self._finish_oldest()

    def across_groups(self) -> None:
        """Hybrid sharding: each unit's gradients reduced only inside its shard group so far,
        all-reduced across groups (all issued, then all waited for); nothing otherwise."""
        pending = [(unit, unit.grads.start_reduce_across_groups()) for unit in self.units]
        for unit, handle in pending:
            if handle is not None:
                unit.grads.finish_reduce_across_groups(handle)

    def wait_all(self, *, abandoned: bool = False) -> None:
        """Every reduce in flight landed (``abandoned``: of a backward that raised: nobody is told)."""
        while self._pending:
            self._finish_oldest(tell=not abandoned)

    def _finish_oldest(self, tell: bool = True) -> None:
        unit, pending = self._pending.popleft()
        unit.grads.finish_reduce(pending)
        if tell and self.told is not None:
            self.told.unit_reduced(unit)
