"""A rank's flat slice of an N-D parameter as the rectangles torch.distributed.checkpoint stores."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from zero_core.checkpoint.chunks import LazyValues, Rectangle, ShardedChunks, flat_range_to_rectangles


def _covered(shape: tuple[int, ...], rectangles: list[Rectangle]) -> torch.Tensor:
    """The flat indices the rectangles cover, in rectangle order."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    pieces = []
    for rectangle in rectangles:
        region = index[tuple(slice(o, o + s) for o, s in zip(rectangle.offsets, rectangle.sizes))]
        flat = region.reshape(-1)
        assert flat[0].item() == rectangle.flat_start
        assert torch.equal(flat, torch.arange(flat[0], flat[0] + flat.numel()))  # contiguous in flat order
        pieces.append(flat)
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)


def test_a_range_of_a_matrix_is_a_partial_row_full_rows_and_a_partial_row() -> None:
    assert flat_range_to_rectangles((4, 5), 3, 17) == [
        Rectangle((0, 3), (1, 2), 3),
        Rectangle((1, 0), (2, 5), 5),
        Rectangle((3, 0), (1, 2), 15),
    ]


def test_aligned_ranges_are_one_rectangle() -> None:
    assert flat_range_to_rectangles((4, 5), 5, 15) == [Rectangle((1, 0), (2, 5), 5)]
    assert flat_range_to_rectangles((4, 5), 0, 20) == [Rectangle((0, 0), (4, 5), 0)]
    assert flat_range_to_rectangles((4, 5), 6, 9) == [Rectangle((1, 1), (1, 3), 6)]  # inside one row


def test_vectors_scalars_and_empty_ranges() -> None:
    assert flat_range_to_rectangles((10,), 2, 7) == [Rectangle((2,), (5,), 2)]
    assert flat_range_to_rectangles((), 0, 1) == [Rectangle((), (), 0)]
    assert flat_range_to_rectangles((4, 5), 7, 7) == []
    assert flat_range_to_rectangles((4, 5), 9, 3) == []


def test_a_range_of_a_three_dimensional_tensor_recurses_into_its_rows() -> None:
    rectangles = flat_range_to_rectangles((2, 3, 4), 5, 19)
    assert rectangles == [
        Rectangle((0, 1, 1), (1, 1, 3), 5),
        Rectangle((0, 2, 0), (1, 1, 4), 8),
        Rectangle((1, 0, 0), (1, 1, 4), 12),
        Rectangle((1, 1, 0), (1, 1, 3), 16),
    ]


def test_random_ranges_are_covered_exactly_in_order() -> None:
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        end = rng.randint(start, numel)
        rectangles = flat_range_to_rectangles(shape, start, end)
        assert torch.equal(_covered(shape, rectangles), torch.arange(start, end)), (shape, start, end)
        assert len(rectangles) <= 2 * (len(shape) - 1) + 1  # a few per dimension, not per row


def _chunks() -> tuple[ShardedChunks, torch.Tensor]:
    local = torch.arange(3.0, 17.0)  # this rank holds flat elements [3, 17) of a 4x5 parameter
    return ShardedChunks(torch.Size([4, 5]), local, 3), local


def test_sharded_chunks_hand_out_views_of_the_shard_for_each_rectangle() -> None:
    view, local = _chunks()
    assert view.shape == torch.Size([4, 5]) and view.dtype == local.dtype
    assert [tuple(c.offsets) for c in view.__create_chunk_list__()] == [(0, 3), (1, 0), (3, 0)]
    assert [tuple(c.sizes) for c in view.__create_chunk_list__()] == [(1, 2), (2, 5), (1, 2)]
    rows = view.__get_tensor_shard__(MetadataIndex("w", torch.Size([1, 0])))
    assert torch.equal(rows, torch.arange(5.0, 15.0).view(2, 5))
    rows.fill_(-1)  # loading writes the shard in place
    assert torch.equal(local[2:12], torch.full((10,), -1.0))


def test_write_items_describe_each_rectangle_as_a_shard_of_the_whole() -> None:
    view, _ = _chunks()
    items = view.__create_write_items__("layer.weight", view)
    assert [item.type for item in items] == [WriteItemType.SHARD] * 3
    assert [tuple(item.index.offset) for item in items] == [(0, 3), (1, 0), (3, 0)]
    assert all(item.index.fqn == "layer.weight" for item in items)
    assert all(item.tensor_data.size == torch.Size([4, 5]) for item in items)


def test_sharded_chunks_refuse_anything_but_checkpointing() -> None:
    view, _ = _chunks()
    with pytest.raises(ValueError, match=r"w: this rank holds no chunk at offset torch.Size\(\[2, 0\]\)"):
        view.__get_tensor_shard__(MetadataIndex("w", torch.Size([2, 0])))
    assert view.detach() is view
    with pytest.raises(NotImplementedError, match="not supported on a ZeRO checkpoint view"):
        view + 1
    assert repr(view) == "ShardedChunks(shape=(4, 5), local=14 elements from 3)"


def test_lazy_values_are_read_when_asked_and_freed_values_are_refused_not_read() -> None:
    reads = []

    def read() -> torch.Tensor:
        reads.append(1)
        return torch.arange(3.0, 17.0)

    view = ShardedChunks(torch.Size([4, 5]), LazyValues(read, 14, torch.float32, torch.device("cpu")), 3)
    assert view.shape == torch.Size([4, 5]) and not reads  # nothing read to describe it
    rows = view.__get_tensor_shard__(MetadataIndex("w", torch.Size([1, 0])))
    assert torch.equal(rows, torch.arange(5.0, 15.0).view(2, 5)) and len(reads) == 1
    freed, local = _chunks()
    local.untyped_storage().resize_(0)  # what the NVMe tier does to state it wrote out
    with pytest.raises(RuntimeError, match="freed since it was taken"):
        freed.__get_tensor_shard__(MetadataIndex("w", torch.Size([1, 0])))
