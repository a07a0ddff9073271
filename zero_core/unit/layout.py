"""The flat layout of one unit: where each parameter lives in the flat buffer
and which part of it falls into each rank's shard.

Flat buffer (``padded_numel`` elements) = parameters in registration order,
each shared parameter once, then zero padding so the total divides by the
world size. Rank r owns the contiguous slice
``[r * shard_numel, (r + 1) * shard_numel)``; a parameter may straddle two
ranks' slices, and a rank may own no part of a given parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class PlaceInWhole(NamedTuple):
    """Tensor parallelism: where this rank's local piece of a DTensor parameter lies in the whole one."""

    whole_shape: torch.Size
    offsets: tuple[int, ...]  # of the piece's first element, per dimension of the whole
    # Each tensor-parallel rank holds a different piece (a Shard placement), so norms over the model
    # add every rank's; False for Replicate (every rank holds the whole, counted once).
    spread_over_ranks: bool


class ParamSlot(NamedTuple):
    """One (possibly shared) parameter's place in its unit's flat buffer."""

    index: int
    fqns: tuple[str, ...]  # every name the model registers it under; fqns[0] is canonical
    shape: torch.Size  # a DTensor parameter's local shape: units flatten what this rank holds of it
    flat_offset: int
    numel: int
    requires_grad: bool
    place: PlaceInWhole | None = None  # a DTensor parameter's; None: the slot holds the whole parameter

    @property
    def whole_shape(self) -> torch.Size:
        """The whole parameter's shape, as checkpoints name it."""
        return self.place.whole_shape if self.place is not None else self.shape

    @property
    def offsets_in_whole(self) -> tuple[int, ...]:
        return self.place.offsets if self.place is not None else (0,) * len(self.shape)

    @property
    def spread_over_ranks(self) -> bool:
        return self.place is not None and self.place.spread_over_ranks


class ShardPiece(NamedTuple):
    """The part of one parameter that lies in one rank's shard (1-D, contiguous)."""

    slot: ParamSlot
    param_start: int  # offset into the flattened parameter
    shard_start: int  # offset into the rank's shard
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    world_size: int
    total_numel: int
    padded_numel: int

    @classmethod
    def build(
        cls,
        params: list[tuple[tuple[str, ...], torch.Size, bool]],
        world_size: int,
        places: list[PlaceInWhole | None] | None = None,
    ) -> "FlatLayout":
        """``params``: (names, shape, requires_grad) per unique parameter, in order; ``places``: where each
        is a piece of a whole parameter (tensor parallelism), None for the others."""
        slots, offset = [], 0
        places = places or [None] * len(params)
        for index, (fqns, shape, requires_grad) in enumerate(params):
            numel = shape.numel()
            slots.append(ParamSlot(index, fqns, shape, offset, numel, requires_grad, places[index]))
            offset += numel
        padded = -(-offset // world_size) * world_size
        return cls(tuple(slots), world_size, offset, padded)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[ShardPiece]:
        """The non-empty intersections of each parameter with ``rank``'s shard."""
        shard_lo, shard_hi = self.shard_range(rank)
        pieces = []
        for slot in self.slots:
            lo = max(slot.flat_offset, shard_lo)
            hi = min(slot.flat_offset + slot.numel, shard_hi)
            if lo < hi:
                pieces.append(ShardPiece(slot, lo - slot.flat_offset, lo - shard_lo, hi - lo))
        return pieces


def slot_view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """One parameter's full-shape view of a unit's flat buffer (padded numel)."""
    return flat[slot.flat_offset : slot.flat_offset + slot.numel].view(slot.shape)


def shard_view(shard: torch.Tensor, piece: ShardPiece) -> torch.Tensor:
    """One parameter piece's 1-D view of a rank's shard."""
    return shard[piece.shard_start : piece.shard_start + piece.numel]
