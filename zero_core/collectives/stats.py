"""Byte counts of the collectives: the logical payload the ZeRO formulas speak of, per kind and per
:class:`Span` (which ranks took part)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class CollectiveKind(str, Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    # Tensors sent to one peer (matrix optimizers: a tensor's pieces to its owner and its update back).
    SEND = "send"


class Span(str, Enum):
    """Which ranks a collective runs between."""

    WORLD = "every rank"
    SHARD_GROUP = "inside the shard group"  # the ranks that together hold one copy of the model state
    ACROSS_GROUPS = "across shard groups"  # the ranks holding the same shard, one per group
    TENSOR_PARALLEL = "across the tensor-parallel group"  # the ranks splitting each layer (a 2-D mesh)
    SECONDARY = "inside the secondary group"  # hpZ: the k ranks of a shard group holding a unit between passes
    ACROSS_SECONDARY = "across secondary groups"  # qgZ's second hop: one rank of each secondary group


@dataclass
class CollectiveCount:
    calls: int = 0
    numel: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Calls, elements and bytes per collective kind since the last reset."""

    counts: dict[CollectiveKind, CollectiveCount] = field(
        default_factory=lambda: {kind: CollectiveCount() for kind in CollectiveKind}
    )
    # The same calls again, by the ranks they ran between (hybrid sharding's link classes).
    spans: dict[Span, CollectiveCount] = field(default_factory=lambda: {span: CollectiveCount() for span in Span})

    def record(self, kind: CollectiveKind, tensor: torch.Tensor, span: Span = Span.SHARD_GROUP) -> None:
        for count in (self.counts[kind], self.spans[span]):
            count.calls += 1
            count.numel += tensor.numel()
            count.bytes += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        for kind in CollectiveKind:
            self.counts[kind] = CollectiveCount()
        for span in Span:
            self.spans[span] = CollectiveCount()

    def span_snapshot(self) -> dict[str, CollectiveCount]:
        """Calls, elements and bytes per :class:`Span` (keyed by its name, e.g. ``"ACROSS_GROUPS"``)."""
        return {span.name: CollectiveCount(**vars(c)) for span, c in self.spans.items()}

    def snapshot(self) -> dict[str, CollectiveCount]:
        return {kind.value: CollectiveCount(**vars(c)) for kind, c in self.counts.items()}

    @staticmethod
    def difference(
        later: dict[str, CollectiveCount], earlier: dict[str, CollectiveCount]
    ) -> dict[str, CollectiveCount]:
        return {
            kind: CollectiveCount(
                *(getattr(later[kind], f) - getattr(earlier[kind], f) for f in ("calls", "numel", "bytes"))
            )
            for kind in later
        }
