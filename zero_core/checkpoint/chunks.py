"""Describing a flat 1-D slice of an N-D tensor to ``torch.distributed.checkpoint``.

A rank's shard holds a contiguous flat range of each parameter. In the
parameter's N-D index space that range is a union of a few rectangles (a
partial row, full rows, a partial row, recursively for more dimensions), and
rectangles are what DCP stores and reshards. :class:`ShardedChunks` is a
tensor of the parameter's logical shape that owns no storage of its own and
implements DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) by handing out views of
the shard, so saving reads and loading writes the shard in place. Values that rest on disk (the NVMe
optimizer tier) are :class:`LazyValues`: read only when DCP asks for them, a few units at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class Rectangle(NamedTuple):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int  # where the rectangle's elements start in the flattened tensor


def flat_range_to_rectangles(shape: tuple[int, ...], start: int, end: int) -> list[Rectangle]:
    """Rectangles covering flat elements ``[start, end)`` of a tensor of ``shape``, in order.

    Each rectangle's elements are contiguous in the flat order.
    """
    if start >= end:
        return []
    if len(shape) <= 1:
        return [Rectangle((start,) if shape else (), (end - start,) if shape else (), start)]
    row = math.prod(shape[1:])
    rectangles: list[Rectangle] = []
    if start % row:  # leading partial row
        index = start // row
        row_end = min(end, (index + 1) * row)
        for inner in flat_range_to_rectangles(shape[1:], start - index * row, row_end - index * row):
            rectangles.append(Rectangle((index, *inner.offsets), (1, *inner.sizes), index * row + inner.flat_start))
        start = row_end
    full_rows = (end - start) // row
    if full_rows:
        rectangles.append(Rectangle((start // row, *(0,) * (len(shape) - 1)), (full_rows, *shape[1:]), start))
        start += full_rows * row
    if start < end:  # trailing partial row
        index = start // row
        for inner in flat_range_to_rectangles(shape[1:], 0, end - index * row):
            rectangles.append(Rectangle((index, *inner.offsets), (1, *inner.sizes), index * row + inner.flat_start))
    return rectangles


def _shifted(rectangle: Rectangle, offsets: tuple[int, ...]) -> Rectangle:
    return Rectangle(tuple(o + s for o, s in zip(rectangle.offsets, offsets)), rectangle.sizes, rectangle.flat_start)


def piece_rectangles(
    piece_shape: tuple[int, ...], start: int, end: int, piece_offsets: tuple[int, ...] | None = None
) -> list[Rectangle]:
    """Flat elements ``[start, end)`` of a ``piece_shape`` piece, as rectangles of the whole tensor the piece
    starts at ``piece_offsets`` of (tensor parallelism: a rank's local piece; None: the piece is the whole)."""
    rectangles = flat_range_to_rectangles(piece_shape, start, end)
    return [_shifted(r, piece_offsets) for r in rectangles] if piece_offsets else rectangles


def read_rectangles(whole: torch.Tensor, rectangles: list[Rectangle]) -> torch.Tensor:
    """The elements of ``rectangles`` of ``whole``, flat, in order."""
    parts = [whole[tuple(slice(o, o + s) for o, s in zip(r.offsets, r.sizes))].reshape(-1) for r in rectangles]
    return torch.cat(parts) if parts else whole.new_empty(0)


@dataclass(frozen=True)
class LazyValues:
    """A shard's values that may rest on disk: ``read()`` returns them (``numel`` of ``dtype`` on ``device``)
    when DCP asks for them, from memory or read from their file then."""

    read: Callable[[], torch.Tensor]
    count: int
    dtype: torch.dtype
    device: torch.device
    # Read from a file no later step writes (an asynchronous save's hard link): staged as it is, read by the
    # writer (``ShardedChunks.staged``).
    frozen: bool = False

    def numel(self) -> int:
        return self.count


def _values_in_memory(values: torch.Tensor) -> torch.Tensor:
    """``values``, refused (not read: that would crash the process) when their memory was freed since the view
    was made: the NVMe tier wrote them out, or a load replaced them."""
    needed = (values.storage_offset() + values.numel()) * values.element_size()
    if values.numel() and values.untyped_storage().nbytes() < needed:
        raise RuntimeError(
            "ZeRO: this sharded state dict's tensors were freed since it was taken (the NVMe optimizer tier wrote "
            "them out at a step, or a load replaced them). Take the state dict again right before saving it."
        )
    return values


class ShardedChunks(torch.Tensor):
    """A logical ``shape`` tensor of which this rank holds the elements
    ``[flat_start, flat_start + local.numel())`` (flat order), stored in ``local``.

    Tensor parallelism: the flat order is that of a ``piece_shape`` piece of the whole tensor
    starting at ``piece_offsets`` (this rank's local piece of a DTensor parameter); the rectangles
    are named where they lie in the whole."""

    _local: torch.Tensor | LazyValues
    _rectangles: list[Rectangle]
    _flat_start: int

    @staticmethod
    def __new__(
        cls,
        shape: torch.Size,
        local: torch.Tensor | LazyValues,
        flat_start: int,
        piece_shape: torch.Size | None = None,
        piece_offsets: tuple[int, ...] | None = None,
    ) -> "ShardedChunks":
        view = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        view._local = local
        view._flat_start = flat_start
        piece = tuple(shape if piece_shape is None else piece_shape)
        view._rectangles = piece_rectangles(piece, flat_start, flat_start + local.numel(), piece_offsets)
        return view

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(
            f"{func} is not supported on a ZeRO checkpoint view; it only serves torch.distributed.checkpoint."
        )

    @property
    def local_numel(self) -> int:
        """The elements of this rank's pieces (what ``staged`` copies), without reading them."""
        return self._local.numel()

    @property
    def frozen(self) -> bool:
        """Its values come from a file no later step writes: ``staged`` copies nothing."""
        return isinstance(self._local, LazyValues) and self._local.frozen

    def staged(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> ShardedChunks:
        """The same pieces over ``copy`` of their values, read now (an asynchronous save's: nothing of it
        aliases the shard the next step changes, nor waits in a file the next step writes). A frozen view is
        staged as it is: its file is a snapshot."""
        if self.frozen:
            return self
        local = self._local.read() if isinstance(self._local, LazyValues) else self._local
        staged = ShardedChunks(self.shape, copy(_values_in_memory(local)), self._flat_start)
        staged._rectangles = self._rectangles  # where the pieces lie in the whole, as before
        return staged

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedChunks(shape={tuple(self.shape)}, local={self._local.numel()} elements from {self._flat_start})"

    def _chunk(self, rectangle: Rectangle) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(rectangle.offsets), sizes=torch.Size(rectangle.sizes))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(rectangle.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=self._chunk(rectangle), properties=properties, size=self.size()),
            )
            for rectangle in self._rectangles
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(rectangle) for rectangle in self._rectangles]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for rectangle in self._rectangles:
            if index.offset is None or tuple(index.offset) == rectangle.offsets:
                begin = rectangle.flat_start - self._flat_start
                numel = math.prod(rectangle.sizes)
                local = self._local.read() if isinstance(self._local, LazyValues) else self._local
                return _values_in_memory(local)[begin : begin + numel].view(rectangle.sizes)
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {index.offset}")
