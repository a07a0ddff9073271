"""Zero gradients for unit outputs a loss does not use, so stage-3 backward
gathers never depend on data.

Stage 3 gathers a unit for backward when a gradient reaches its output. If
which unit outputs get gradients depended on data (a task head used on one
rank only), ranks would gather different units and pair all-gathers of
different units: a hang, or with equal sizes a silent mix. So
``engine.backward(loss)`` starts autograd from the loss *and* from every
unit output of the forwards the loss comes from, with zero gradients for
the latter: the backward graph, and so the order autograd runs it in, is
the same on every rank. A unit reached only by these zeros runs a backward
of zeros and counts as having produced no gradient on this rank.

Only forwards whose root outputs the loss reaches are joined (found by a
short walk of the loss's graph), so a second forward's graph is never
consumed by the first loss's backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

# How many autograd nodes the walk from the loss to the root outputs may visit.
MAX_NODES_WALKED = 10_000


@dataclass
class ForwardOutputs:
    """One outermost grad forward of the root: its outputs' nodes and its units' outputs."""

    root_nodes: set[Node] = field(default_factory=set)
    unit_edges: list[GradientEdge] = field(default_factory=list)
    unit_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = field(default_factory=list)

    def add_unit_output(self, tensor: torch.Tensor) -> None:
        self.unit_edges.append(get_gradient_edge(tensor))
        self.unit_meta.append((tensor.shape, tensor.dtype, tensor.device))


def forwards_reached(loss: torch.Tensor, records: list[ForwardOutputs]) -> list[ForwardOutputs]:
    """The records whose root outputs ``loss`` was computed from."""
    wanted = {node: record for record in records for node in record.root_nodes}
    if loss.grad_fn is None or not wanted:
        return []
    reached: dict[int, ForwardOutputs] = {}
    stack, seen = [loss.grad_fn], set()
    while stack and len(seen) < MAX_NODES_WALKED:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in wanted:
            reached[id(wanted[node])] = wanted[node]
            continue  # the forward's own graph lies beyond: no need to walk it
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return list(reached.values())


def zero_roots(records: list[ForwardOutputs]) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    edges = [edge for record in records for edge in record.unit_edges]
    zeros = [torch.zeros(shape, dtype=dtype, device=device) for record in records for shape, dtype, device in record.unit_meta]
    return edges, zeros
