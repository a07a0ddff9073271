"""ZeRO++'s secondary shard (hpZ): a unit's parameters kept between its forward and its backward in 1/k
pieces over a group of k ranks (a node), so the backward's all-gather stays inside that group.

When the forward frees a unit's full parameters (stage 3, with a backward to come) this rank keeps its
piece of them, in the compute dtype: the values the forward computed with (dequantized ones under
``quantize_weights``), so the backward computes with the very same values and the numbers are those of
a run without it. The backward's gather of the unit fills the full buffer from the group's pieces and lets
the piece go. Any write of the parameters (a step, a load) forgets it, and so does the end of a backward
that did not gather the unit: a piece never outlives the values it was cut from.

Memory: P/k elements in the compute dtype per unit, between its forward and its backward. With k = 1
the piece is the whole unit: the gathered buffer itself stays allocated (no copy either way), the unit
SHARDED and guarded as at rest; a reshard that keeps nothing, or a forget, frees it.
"""

from __future__ import annotations

import torch

from ..collectives import CommContext, Handle, Span, all_gather
from ..host_memory import advise_huge_pages


class SecondaryShard:
    def __init__(self, comm: CommContext, label: str):
        self.comm, self.label = comm, label
        self.piece: torch.Tensor | None = None  # this rank's 1/k of the full parameters, while kept

    def keep(self, gathered: torch.Tensor) -> None:
        """The forward is done with ``gathered`` (full, valid): keep this rank's piece of it."""
        _, size = self.comm.span(Span.SECONDARY)
        if size == 1:
            self.piece = gathered  # the caller leaves its storage allocated (ParamStorage.reshard)
            return
        length = gathered.numel() // size
        start = self.comm.rank_in(Span.SECONDARY) * length
        # Faulted in as huge pages like the gathered buffer (a clone's fresh pages fault 4 KiB at a time).
        self.piece = advise_huge_pages(torch.empty_like(gathered[start : start + length]))
        self.piece.copy_(gathered[start : start + length])

    def gather_into(self, gathered: torch.Tensor) -> Handle | None:
        """The backward's gather from the kept pieces, the piece let go (the collective holds what it reads);
        None when there is no piece to gather from."""
        piece, self.piece = self.piece, None
        if piece is None:
            return None
        if piece is gathered:  # k = 1: the values never left the buffer
            return Handle()
        return all_gather(self.comm, gathered, piece, label=self.label, span=Span.SECONDARY)

    def holds(self, gathered: torch.Tensor) -> bool:
        """k = 1: the kept piece is ``gathered`` itself, whose storage must stay allocated while it is kept."""
        return self.piece is gathered

    def forget(self) -> None:
        self.piece = None
