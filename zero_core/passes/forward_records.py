"""What each forward leaves for the backward that follows it.

A :class:`ForwardRecord` per outermost forward with grad enabled: which
units ran, how many of their calls a backward must go through before the
unit is finished, and (stage 3) the unit outputs, for zero gradients. A
record lives while its forward's graph can still be back-propagated: the
hooks on the forward's outputs hold a token, so when the user drops those
outputs (a grad-enabled forward never back-propagated) the record goes with
them, and nothing keeps that forward's activations alive. The optimizer step
drops every record (a forward not back-propagated by then was skipped); a
forward that raised never becomes a record.

Zero backward roots (stage 3). Stage 3 gathers a unit for backward when a
gradient reaches its output. If which unit outputs get gradients depended on
data (a task head used on one rank only), ranks would gather different units
and pair all-gathers of different units: a hang, or with equal sizes a silent
mix. So ``engine.backward(loss)`` finds which unit outputs the loss reaches
on this rank, the ranks agree (two small all-reduces: how many, then which)
which outputs any rank reaches, and autograd starts from the loss *and*, with zero gradients, from
the outputs other ranks reach and this one does not: the backward graph, and
so the order autograd runs it in, is the same on every rank. Outputs no rank
reaches (a second tower with its own loss, an unused auxiliary head) are left
alone, as plain PyTorch would.
"""

from __future__ import annotations

import weakref
import zlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ..agreement import true_on_any_rank
from ..unit import FlatUnit


@dataclass(eq=False)
class ForwardRecord:
    ran: set[int] = field(default_factory=set)  # units that ran inside this forward
    wrapped_calls: Counter = field(default_factory=Counter)  # calls whose inputs were wrapped
    # Calls under no_grad: a reentrant checkpoint recomputes (and wraps) each in backward.
    unwrapped_calls: Counter = field(default_factory=Counter)
    # Units with a grad call whose inputs need no grad: no wrapped input marks the end of its backward.
    finish_at_end: set[int] = field(default_factory=set)
    unit_edges: list[GradientEdge] = field(default_factory=list)  # stage 3
    unit_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = field(default_factory=list)

    def add_unit_output(self, tensor: torch.Tensor) -> None:
        self.unit_edges.append(get_gradient_edge(tensor))
        self.unit_meta.append((tensor.shape, tensor.dtype, tensor.device))

    def calls_to_finish(self) -> Counter:
        return self.wrapped_calls + self.unwrapped_calls


class Liveness:
    """The token a forward's output hooks hold; its death retires the record."""


class ForwardRecords:
    def __init__(self) -> None:
        self._live: dict[int, ForwardRecord] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._dead: list[int] = []  # appended by weakref callbacks (any time), purged at safe points
        self._next = 0

    def add(self, record: ForwardRecord) -> Liveness:
        """Keep ``record`` while the returned token is alive."""
        token, key = Liveness(), self._next
        self._next += 1
        self._live[key] = record
        self._refs[key] = weakref.ref(token, lambda _, key=key: self._dead.append(key))
        return token

    def pending(self) -> list[ForwardRecord]:
        """Live records, oldest first."""
        while self._dead:
            key = self._dead.pop()
            self._live.pop(key, None)
            self._refs.pop(key, None)
        return list(self._live.values())

    def clear(self) -> None:
        self._live.clear()
        self._refs.clear()
        self._dead.clear()


def reached_outputs(loss: torch.Tensor, records: list[ForwardRecord]) -> list[bool]:
    """For each unit output of ``records`` (in order): does ``loss`` reach it on this rank?"""
    index: dict[tuple[int, int], list[int]] = {}
    flat = [edge for record in records for edge in record.unit_edges]
    for position, edge in enumerate(flat):
        index.setdefault((id(edge.node), edge.output_nr), []).append(position)
    reached = [False] * len(flat)
    if loss.grad_fn is None or not flat:
        return reached
    # The held edges keep their node objects alive, so identity finds them again.
    stack, seen = [loss.grad_fn], {id(loss.grad_fn)}
    keep = [loss.grad_fn]  # keeps walked node objects alive, so their ids stay unique during the walk
    while stack:
        node = stack.pop()
        for next_node, output_nr in node.next_functions:
            if next_node is None:
                continue
            for position in index.get((id(next_node), output_nr), ()):
                reached[position] = True
            if id(next_node) not in seen:
                seen.add(id(next_node))
                keep.append(next_node)
                stack.append(next_node)
    return reached


def records_reached(loss: torch.Tensor, records: list[ForwardRecord]) -> tuple[list[ForwardRecord], list[bool]]:
    """The records ``loss`` comes from (one of their unit outputs is reached), with
    the reached flags of their unit outputs. Older records a rank still holds
    (a list of logged losses) are left out: how many there are differs by rank."""
    reached = reached_outputs(loss, records)
    chosen, flags, position = [], [], 0
    for record in records:
        count = len(record.unit_edges)
        if any(reached[position : position + count]):
            chosen.append(record)
            flags += reached[position : position + count]
        position += count
    return chosen, flags


def zero_roots(records: list[ForwardRecord], needs_zeros: list[bool]) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    edges = [edge for record in records for edge in record.unit_edges]
    meta = [m for record in records for m in record.unit_meta]
    chosen = [i for i, flag in enumerate(needs_zeros) if flag]
    return [edges[i] for i in chosen], [torch.zeros(meta[i][0], dtype=meta[i][1], device=meta[i][2]) for i in chosen]


def agreed_zero_roots(
    loss: torch.Tensor, records: list[ForwardRecord], units: list[FlatUnit]
) -> tuple[list[ForwardRecord], list[GradientEdge], list[torch.Tensor]]:
    """The records ``loss`` comes from, and the unit outputs (with zero gradients) that other ranks'
    losses reach and this rank's does not: one small agreement across ranks (every rank calls it)."""
    records, reached = records_reached(loss, records)
    # Riding along, before any reduce-scatter: ranks that froze different units would pair
    # different units' reduce-scatters (a hang, or garbage for units of equal size).
    trainable = zlib.crc32(repr([unit.index for unit in units if unit.trainable]).encode())
    anywhere = true_on_any_rank(
        units[0].comm,
        reached,
        "which unit outputs the loss uses",
        must_agree={
            "which units have trainable parameters (every rank must freeze the same ones; a checksum)": trainable
        },
    )
    edges, zeros = zero_roots(records, [a and not r for a, r in zip(anywhere, reached)])
    return records, edges, zeros
