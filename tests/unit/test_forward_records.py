"""ForwardRecords and the zero backward roots: which records a loss comes from, which unit
outputs it reaches, and the zero gradients for the outputs other ranks reach."""

from __future__ import annotations

import gc
from collections import Counter

import torch
from torch.autograd.graph import get_gradient_edge

from zero_core.passes.forward_records import ForwardRecord, ForwardRecords, reached_outputs, records_reached, zero_roots


def _record(*outputs: torch.Tensor) -> ForwardRecord:
    record = ForwardRecord()
    for output in outputs:
        record.add_unit_output(output)
    return record


# ------------------------------------------------------------------ lifetime
def test_a_record_lives_as_long_as_its_token() -> None:
    records = ForwardRecords()
    first, second = ForwardRecord(ran={0}), ForwardRecord(ran={1})
    first_token, second_token = records.add(first), records.add(second)
    assert records.pending() == [first, second]  # oldest first
    del first_token
    gc.collect()
    assert records.pending() == [second]
    assert second_token is not None


def test_clear_drops_every_record_and_late_token_deaths_are_harmless() -> None:
    records = ForwardRecords()
    token = records.add(ForwardRecord())
    records.clear()
    assert records.pending() == []
    del token
    gc.collect()
    assert records.pending() == []
    later = ForwardRecord()
    kept = records.add(later)
    assert records.pending() == [later] and kept is not None


def test_records_outlive_tokens_of_other_records() -> None:
    records = ForwardRecords()
    tokens = [records.add(ForwardRecord(ran={i})) for i in range(4)]
    del tokens[1:3]
    gc.collect()
    assert [record.ran for record in records.pending()] == [{0}, {3}]


def test_calls_to_finish_count_wrapped_and_unwrapped_calls() -> None:
    record = ForwardRecord(wrapped_calls=Counter({0: 2, 1: 1}), unwrapped_calls=Counter({1: 2, 3: 1}))
    assert record.calls_to_finish() == Counter({0: 2, 1: 3, 3: 1})


# ------------------------------------------------------------------ reached outputs
def test_the_loss_reaches_only_the_outputs_it_was_computed_from() -> None:
    x = torch.randn(3, requires_grad=True)
    used, unused = x * 2, x * 3
    loss = used.sum()
    assert reached_outputs(loss, [_record(used, unused)]) == [True, False]


def test_outputs_of_one_node_are_told_apart_by_output_number() -> None:
    x = torch.randn(4, requires_grad=True)
    left, right = (x * 2).split(2)
    assert get_gradient_edge(left).node is get_gradient_edge(right).node
    assert reached_outputs(right.sum(), [_record(left, right)]) == [False, True]


def test_an_output_reached_through_a_later_unit_counts() -> None:
    x = torch.randn(3, requires_grad=True)
    first = x.exp()
    second = first * 4  # the next unit's output, computed from the first
    loss = second.mean()
    assert reached_outputs(loss, [_record(first, second)]) == [True, True]


def test_a_loss_without_a_graph_reaches_nothing() -> None:
    x = torch.randn(3, requires_grad=True)
    output = x * 2
    assert reached_outputs(output.detach().sum(), [_record(output)]) == [False]
    assert reached_outputs(output.sum(), []) == []


def test_records_reached_leaves_out_older_forwards_the_loss_does_not_come_from() -> None:
    x = torch.randn(3, requires_grad=True)
    logged = _record(x * 2)  # an earlier forward whose loss was only logged
    current_used, current_unused = x * 5, x * 7
    current = _record(current_used, current_unused)
    later = _record(x * 11)
    chosen, flags = records_reached(current_used.sum(), [logged, current, later])
    assert chosen == [current]
    assert flags == [True, False]  # the flags of the chosen records' outputs only


def test_records_reached_keeps_every_record_the_loss_comes_from_in_order() -> None:
    """Two forwards summed into one loss (micro-batches) are both backed through."""
    x = torch.randn(3, requires_grad=True)
    first, second, third = [x * 2, x * 3], [x * 5], [x * 7]
    records = [_record(*first), _record(*second), _record(*third)]
    chosen, flags = records_reached(third[0].sum() + first[1].sum(), records)
    assert chosen == [records[0], records[2]]
    assert flags == [False, True, True]
    assert records_reached(x.sum(), records) == ([], [])  # from the input itself: no record


# ------------------------------------------------------------------ zero roots
def test_zero_roots_are_the_flagged_outputs_with_zeros_of_their_shape_and_dtype() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    outputs = [x * 2, (x * 3).double(), x.sum(dim=0)]
    records = [_record(outputs[0]), _record(outputs[1], outputs[2])]
    edges, zeros = zero_roots(records, [False, True, True])
    assert [edge.node for edge in edges] == [get_gradient_edge(o).node for o in outputs[1:]]
    assert [(z.shape, z.dtype) for z in zeros] == [
        (torch.Size([2, 3]), torch.float64),
        (torch.Size([3]), torch.float32),
    ]
    assert all(not z.any() for z in zeros)
    assert zero_roots(records, [False, False, False]) == ([], [])


def test_a_backward_from_the_loss_and_the_zero_roots_gives_the_loss_gradient() -> None:
    """What ``engine.backward`` relies on: zero roots join the graph and add nothing."""
    x = torch.randn(4, requires_grad=True)
    used, other = x * 2, x.sin()
    records = [_record(used, other)]
    loss = used.sum()
    edges, zeros = zero_roots(records, [not flag for flag in reached_outputs(loss, records)])
    assert len(edges) == 1
    torch.autograd.backward([loss, *edges], [torch.ones(()), *zeros])
    assert torch.equal(x.grad, torch.full((4,), 2.0))
