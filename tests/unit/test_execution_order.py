"""PassOrder: the order units ran in last time, and the prefetch predictions drawn from it.

A prediction is a guess: a unit out of the recorded order gets none, a unit
running again is already live, and the recording replaces the previous one
only at the end of a pass that completed.
"""

from __future__ import annotations

import random

from zero_core.passes.execution_order import ExecutionOrder, PassOrder


def _run(order: PassOrder, units: list[int], count: int = 2) -> list[list[int]]:
    """One pass: the predictions made as each unit runs."""
    predictions = [order.record(unit, count) for unit in units]
    order.end()
    return predictions


def test_the_first_pass_predicts_nothing_and_the_second_follows_it() -> None:
    order = PassOrder()
    assert _run(order, [0, 1, 2, 3]) == [[], [], [], []]
    assert order.previous == [0, 1, 2, 3] and order.changes == 0  # a first recording is not a change
    assert _run(order, [0, 1, 2, 3]) == [[1, 2], [2, 3], [3], []]
    assert order.changes == 0


def test_predictions_take_up_to_count_units() -> None:
    order = PassOrder()
    _run(order, [4, 3, 2, 1, 0])
    assert order.record(4, 3) == [3, 2, 1]
    assert order.record(3, 1) == [2]
    assert order.record(2, 0) == []


def test_a_unit_running_again_is_not_recorded_twice_and_predicts_nothing() -> None:
    order = PassOrder()
    _run(order, [0, 1, 2])
    assert order.record(0, 2) == [1, 2]
    assert order.record(1, 2) == [2]
    assert order.record(0, 2) == []  # a reused block: it is live already
    assert order.current == [0, 1]


def test_skipped_units_move_the_cursor_past_them() -> None:
    """Layerdrop: a unit later in the recorded order resumes the predictions from there."""
    order = PassOrder()
    _run(order, [0, 1, 2, 3, 4])
    assert order.record(0, 2) == [1, 2]
    assert order.record(3, 2) == [4]
    assert order.record(1, 2) == []  # behind the cursor: no prediction until one matches again
    assert order.record(4, 2) == []
    order.end()
    assert order.previous == [0, 3, 1, 4] and order.changes == 1


def test_an_unknown_unit_predicts_nothing_and_the_next_known_one_resumes() -> None:
    order = PassOrder()
    _run(order, [0, 1, 2, 3])
    assert order.record(7, 2) == []  # a branch the last pass did not take
    assert order.record(0, 2) == [1, 2]


def test_units_behind_the_cursor_get_no_prediction() -> None:
    order = PassOrder()
    _run(order, [0, 1, 2, 3])
    assert order.record(2, 3) == [3]
    assert order.record(0, 3) == []  # recorded before unit 2: the cursor does not go back
    assert order.record(3, 3) == []  # matched, and nothing is left after it
    order.end()
    assert order.previous == [2, 0, 3]
    assert order.record(0, 3) == [3]  # unit 2 came before it in the new recording


def test_a_different_order_replaces_the_recording_and_counts_as_a_change() -> None:
    order = PassOrder()
    _run(order, [0, 1, 2])
    _run(order, [0, 2, 1])
    assert order.previous == [0, 2, 1] and order.changes == 1
    _run(order, [0, 2, 1])
    assert order.changes == 1
    _run(order, [0, 1, 2])
    assert order.previous == [0, 1, 2] and order.changes == 2


def test_a_pass_that_raised_is_forgotten() -> None:
    order = PassOrder()
    _run(order, [0, 1, 2])
    order.record(2, 2)
    order.record(1, 2)
    order.discard()
    assert order.current == [] and order.previous == [0, 1, 2] and order.changes == 0
    assert order.record(0, 2) == [1, 2]  # the cursor starts over


def test_a_pass_that_ran_no_unit_keeps_the_recording() -> None:
    order = PassOrder()
    _run(order, [0, 1])
    _run(order, [])
    assert order.previous == [0, 1] and order.changes == 0


def test_forward_and_backward_are_recorded_apart_and_their_changes_add_up() -> None:
    order = ExecutionOrder()
    for units in ([0, 1, 2], [0, 2, 1]):
        _run(order.forward, units)
        _run(order.backward, list(reversed(units)))
    assert order.forward.previous == [0, 2, 1] and order.backward.previous == [1, 2, 0]
    assert order.forward.changes == 1 and order.backward.changes == 1 and order.changes == 2
    _run(order.backward, [0, 1, 2])
    assert order.changes == 3


def test_no_prediction_names_a_unit_that_already_ran_in_this_pass() -> None:
    """Whatever the orders (skips, repeats, unknown units), a prediction only names units still to run."""
    generator = random.Random(0)
    order = PassOrder()
    for _ in range(300):
        units = [generator.randrange(8) for _ in range(generator.randrange(1, 12))]
        ran: set[int] = set()
        for unit in units:
            predicted = order.record(unit, generator.randrange(4))
            ran.add(unit)
            assert not ran & set(predicted), (order.previous, units, predicted)
        order.end()
