"""FlatLayout: registration order, padding to the world size, and each rank's pieces,
including parameters that straddle two ranks and ranks that own only padding."""

from __future__ import annotations

import torch

from zero_core.unit import FlatLayout, ShardPiece


def _layout(shapes: list[tuple[int, ...]], world_size: int, frozen: tuple[int, ...] = ()) -> FlatLayout:
    params = [((f"p{i}",), torch.Size(s), i not in frozen) for i, s in enumerate(shapes)]
    return FlatLayout.build(params, world_size)


def _pieces(layout: FlatLayout, rank: int) -> list[tuple[int, int, int, int]]:
    """(parameter index, start in the parameter, start in the shard, numel) per piece."""
    return [(p.slot.index, p.param_start, p.shard_start, p.numel) for p in layout.pieces(rank)]


def test_parameters_are_laid_out_in_order_and_padded_to_the_world_size() -> None:
    layout = _layout([(2, 3), (4,), (1, 1, 3)], world_size=4)
    assert [(s.flat_offset, s.numel, s.shape) for s in layout.slots] == [
        (0, 6, torch.Size([2, 3])),
        (6, 4, torch.Size([4])),
        (10, 3, torch.Size([1, 1, 3])),
    ]
    assert (layout.total_numel, layout.padded_numel, layout.shard_numel) == (13, 16, 4)
    assert [layout.shard_range(r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_no_padding_when_the_total_divides() -> None:
    layout = _layout([(3, 4)], world_size=3)
    assert (layout.padded_numel, layout.shard_numel) == (12, 4)
    assert _layout([(3, 4)], world_size=1).pieces(0) == [ShardPiece(layout.slots[0], 0, 0, 12)]


def test_a_straddling_parameter_is_split_between_ranks() -> None:
    layout = _layout([(2, 3), (4,), (1, 1, 3)], world_size=4)  # shards of 4 over 13 elements
    assert _pieces(layout, 0) == [(0, 0, 0, 4)]
    assert _pieces(layout, 1) == [(0, 4, 0, 2), (1, 0, 2, 2)]
    assert _pieces(layout, 2) == [(1, 2, 0, 2), (2, 0, 2, 2)]
    assert _pieces(layout, 3) == [(2, 2, 0, 1)]  # then three elements of padding


def test_a_rank_may_own_only_padding() -> None:
    layout = _layout([(2,)], world_size=4)
    assert (layout.padded_numel, layout.shard_numel) == (4, 1)
    assert [len(layout.pieces(r)) for r in range(4)] == [1, 1, 0, 0]


def test_a_rank_may_own_no_part_of_a_given_parameter() -> None:
    layout = _layout([(8,), (1,), (8,)], world_size=2)  # 17 -> 18: rank 0 [0, 9), rank 1 [9, 18)
    assert [p[0] for p in _pieces(layout, 0)] == [0, 1]
    assert [p[0] for p in _pieces(layout, 1)] == [2]


def test_empty_parameters_take_no_space_and_no_piece() -> None:
    layout = _layout([(3,), (0, 5), (3,)], world_size=2)
    assert [s.flat_offset for s in layout.slots] == [0, 3, 3]
    assert all(p[0] != 1 for rank in range(2) for p in _pieces(layout, rank))


def test_slots_keep_every_name_and_whether_they_train() -> None:
    layout = FlatLayout.build(
        [(("embed.weight", "head.weight"), torch.Size([5, 2]), True), (("frozen.bias",), torch.Size([2]), False)], 2
    )
    assert layout.slots[0].fqns == ("embed.weight", "head.weight")
    assert [s.requires_grad for s in layout.slots] == [True, False]
    assert [s.index for s in layout.slots] == [0, 1]


def test_pieces_rebuild_every_parameter_from_the_shards() -> None:
    """What gathering does: every rank's shard, laid side by side, holds each parameter's values."""
    shapes = [(3, 5), (7,), (2, 2, 2), (1,)]
    values = [torch.randn(s) for s in shapes]
    for world_size in (1, 2, 3, 5, 8):
        layout = _layout(shapes, world_size)
        shards = torch.full((world_size, layout.shard_numel), float("nan"))
        for rank in range(world_size):
            for piece in layout.pieces(rank):
                flat = values[piece.slot.index].reshape(-1)[piece.param_start : piece.param_start + piece.numel]
                shards[rank, piece.shard_start : piece.shard_start + piece.numel] = flat
        gathered = shards.reshape(-1)
        for slot, value in zip(layout.slots, values):
            assert torch.equal(gathered[slot.flat_offset : slot.flat_offset + slot.numel].view(slot.shape), value)
        assert gathered[layout.total_numel :].isnan().all()  # padding: no piece writes it
