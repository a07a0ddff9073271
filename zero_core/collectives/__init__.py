"""The one package that calls into ``torch.distributed``.

Collectives are pure functions: tensors, a :class:`CommContext` (process
group, stream, byte counters) in; a :class:`Handle` whose ``wait()`` is the
second half out. Counting bytes and choosing a primitive per backend happen
here and nowhere else. World size 1 takes the same path with the
communication skipped.

Byte counts are the logical payload the ZeRO formulas speak of: the full
(gathered) size of an all-gather, the full (input) size of a reduce-scatter,
the tensor size of an all-reduce or broadcast. They are kept per kind and per
:class:`Span` (which ranks took part), so hybrid sharding reports what
crossed the slow links between shard groups apart from what stayed inside one.

Hybrid sharding (``ZeroConfig.shard_group_size``): model states are sharded
inside groups of consecutive ranks (a node, as torchrun numbers them) and
replicated across groups. Parameter all-gathers and gradient reduce-scatters
run inside the shard group, the gradient shards are then all-reduced across
groups (between the ranks holding the same shard), and agreements, buffer
broadcasts and checkpoints span every rank.
"""

from .context import DIVERGENCE_ADVICE, CollectiveFailed, CollectiveLabel, CommContext, Position, TrainingProgress
from .handle import Handle
from .meetings import RanksDivergedError, meeting
from .ops import all_gather, all_gather_objects, all_reduce, broadcast, exchange, reduce_scatter
from .quantized_gather import all_gather_quantized, gather_working_bytes
from .quantized_reduce import (
    all_reduce_quantized,
    all_reduce_working_bytes,
    reduce_scatter_quantized,
    reduce_working_bytes,
)
from .stats import CollectiveCount, CollectiveKind, CommStats, Span

__all__ = [
    "DIVERGENCE_ADVICE",
    "CollectiveCount",
    "CollectiveFailed",
    "CollectiveKind",
    "CollectiveLabel",
    "CommContext",
    "CommStats",
    "Handle",
    "Position",
    "TrainingProgress",
    "RanksDivergedError",
    "Span",
    "all_gather",
    "all_gather_objects",
    "all_gather_quantized",
    "all_reduce",
    "all_reduce_quantized",
    "all_reduce_working_bytes",
    "broadcast",
    "exchange",
    "gather_working_bytes",
    "meeting",
    "reduce_scatter",
    "reduce_scatter_quantized",
    "reduce_working_bytes",
]
