"""ReduceSchedule: every trainable unit reduced once per backward, in one fixed order,
whatever order the units finish in, with a bounded number of reduce-scatters in flight."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from zero_core.passes import reduce_schedule
from zero_core.passes.reduce_schedule import ReduceSchedule


class FakePending(NamedTuple):
    unit: FakeUnit


class FakeUnit:
    """Records when its reduce-scatter is started and finished, in a log shared by all units."""

    def __init__(self, index: int, log: list[tuple[str, int]], trainable: bool = True, reduces: bool = True):
        self.index, self.log, self.trainable, self.reduces = index, log, trainable, reduces
        self.grads = self  # the schedule waits through the unit's gradients part: here the unit itself

    def start_reduce(self) -> FakePending | None:
        self.log.append(("start", self.index))
        return FakePending(self) if self.reduces else None

    def finish_reduce(self, pending: FakePending) -> None:
        assert pending.unit is self
        self.log.append(("finish", self.index))


def _units(count: int, **frozen: bool) -> tuple[list[FakeUnit], list[tuple[str, int]]]:
    log: list[tuple[str, int]] = []
    return [FakeUnit(i, log, trainable=not frozen.get(f"u{i}", False)) for i in range(count)], log


def _started(log: list[tuple[str, int]]) -> list[int]:
    return [index for event, index in log if event == "start"]


def test_the_sequence_is_the_trainable_units_in_reverse() -> None:
    units, _ = _units(4, u1=True)
    schedule = ReduceSchedule(units)
    assert [u.index for u in schedule.sequence] == [3, 2, 0]


def test_freezing_between_backwards_is_read_at_reset() -> None:
    units, _ = _units(3)
    schedule = ReduceSchedule(units)
    units[2].trainable = False
    assert [u.index for u in schedule.sequence] == [2, 1, 0]  # not before the next backward
    schedule.reset()
    assert [u.index for u in schedule.sequence] == [1, 0]


def test_a_unit_finishing_out_of_order_waits_for_its_turn() -> None:
    units, log = _units(3)
    schedule = ReduceSchedule(units)
    schedule.mark_finished(units[1])  # unit 2 is first in the sequence and has not finished
    schedule.advance(schedule.finished)
    assert log == [] and not schedule.was_issued(units[1])
    schedule.mark_finished(units[2])
    schedule.advance(schedule.finished)
    assert _started(log) == [2, 1]
    assert schedule.was_issued(units[1]) and schedule.was_issued(units[2]) and not schedule.was_issued(units[0])


def test_units_whose_backward_never_came_are_issued_at_the_end_in_order() -> None:
    units, log = _units(4)
    schedule = ReduceSchedule(units)
    schedule.mark_finished(units[3])
    schedule.advance(schedule.finished)
    schedule.advance(lambda unit: True)  # the end of backward
    schedule.wait_all()
    assert _started(log) == [3, 2, 1, 0]
    assert sorted(i for event, i in log if event == "finish") == [0, 1, 2, 3]
    schedule.advance(lambda unit: True)
    assert _started(log) == [3, 2, 1, 0]  # each unit once per backward


def test_reduces_in_flight_are_bounded_and_finish_oldest_first() -> None:
    units, log = _units(6)
    schedule = ReduceSchedule(units)
    in_flight = []
    for unit in reversed(units):
        schedule.mark_finished(unit)
        schedule.advance(schedule.finished)
        started = len(_started(log))
        in_flight.append(started - sum(1 for event, _ in log if event == "finish"))
    assert max(in_flight) == reduce_schedule.MAX_PENDING_REDUCES
    schedule.wait_all()
    finishes = [index for event, index in log if event == "finish"]
    assert finishes == _started(log) == [5, 4, 3, 2, 1, 0]
    # No reduce is waited for before it was started.
    for index in finishes:
        assert log.index(("start", index)) < log.index(("finish", index))


def test_the_bound_holds_with_a_smaller_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reduce_schedule, "MAX_PENDING_REDUCES", 1)
    units, log = _units(3)
    schedule = ReduceSchedule(units)
    schedule.advance(lambda unit: True)
    # Each start beyond the first finishes the one before it.
    assert log == [("start", 2), ("start", 1), ("finish", 2), ("start", 0), ("finish", 1)]
    schedule.wait_all()
    assert log[-1] == ("finish", 0)


def test_a_unit_with_nothing_to_reduce_is_issued_but_not_waited_for() -> None:
    units, log = _units(2)
    units[1].reduces = False
    schedule = ReduceSchedule(units)
    schedule.advance(lambda unit: True)
    schedule.wait_all()
    assert log == [("start", 1), ("start", 0), ("finish", 0)]


def test_the_fingerprint_sums_which_units_were_reduced_since_creation() -> None:
    units, _ = _units(3)
    schedule = ReduceSchedule(units)
    schedule.advance(lambda unit: True)
    schedule.wait_all()
    assert schedule.issued_fingerprint == 1 + 2 + 3
    units[0].trainable = False
    schedule.reset()
    assert not schedule.finished(units[2]) and not schedule.was_issued(units[2])  # a new backward
    schedule.advance(lambda unit: True)
    schedule.wait_all()
    assert schedule.issued_fingerprint == 6 + 2 + 3  # accumulates over backwards; unit 0 left out
