"""Unit choice, parameter ownership and the flat layout (single process)."""

from __future__ import annotations

import torch
from torch import nn

from tests.models import Block, TinyTransformer, batch, lm_loss, make_optimizer
from zero_core import WrapPolicy, ZeroConfig, ZeroEngine
from zero_core.unit import FlatLayout, plan_units


def test_every_element_is_owned_by_exactly_one_rank() -> None:
    shapes = [torch.Size([3, 5]), torch.Size([7]), torch.Size([2, 2, 2])]
    for world_size in (1, 2, 3, 4, 7):
        layout = FlatLayout.build([((f"p{i}",), s, True) for i, s in enumerate(shapes)], world_size)
        assert layout.total_numel == 30 and layout.padded_numel % world_size == 0
        assert layout.padded_numel - layout.total_numel < world_size
        covered = torch.zeros(layout.total_numel, dtype=torch.int64)
        for rank in range(world_size):
            for piece in layout.pieces(rank):
                start = piece.slot.flat_offset + piece.param_start
                covered[start : start + piece.numel] += 1
                assert piece.shard_start + piece.numel <= layout.shard_numel
        assert covered.eq(1).all()


def test_class_policy_units_and_tied_parameter_ownership() -> None:
    model = TinyTransformer(blocks=2)
    plans = plan_units(model, WrapPolicy(module_classes=(Block,)), bucket_numel=10**9)
    assert [p.name for p in plans] == ["", "blocks.0", "blocks.1"]
    root_names = [names for names in plans[0].param_fqns]
    assert ("embed.weight", "head.weight") in root_names  # tied: one slot, both names
    assert all(n[0].startswith("blocks.0.") for n in plans[1].param_fqns)
    total = sum(p.numel() for plan in plans for p in plan.params)
    assert total == sum(p.numel() for p in model.parameters())


def test_parameter_shared_by_two_units_belongs_to_their_common_ancestor() -> None:
    model = TinyTransformer(blocks=2)
    model.blocks[1].mix.weight = model.blocks[0].mix.weight
    plans = plan_units(model, WrapPolicy(module_classes=(Block,)), bucket_numel=10**9)
    assert ("blocks.0.mix.weight", "blocks.1.mix.weight") in plans[0].param_fqns


def test_size_policy_makes_units_of_at_least_the_threshold() -> None:
    model = TinyTransformer(blocks=3)
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    plans = plan_units(model, WrapPolicy(min_unit_numel=block_numel), bucket_numel=10**9)
    assert [p.name for p in plans] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert len(plan_units(model, WrapPolicy(), bucket_numel=10**9)) == 1  # all in the root


def test_single_process_without_process_group() -> None:
    """World size 1 takes the same path, with no process group needed."""
    torch.manual_seed(0)
    model = TinyTransformer()
    engine = ZeroEngine(model, make_optimizer("adamw", model), ZeroConfig(stage=3, wrap_policy=WrapPolicy((Block,))))
    assert engine.world_size == 1
    first = None
    for step in range(4):
        ids = batch(step % 2, 0)
        loss = lm_loss(model(ids), ids)
        engine.backward(loss)
        engine.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first
    assert isinstance(engine.model, nn.Module) and engine.num_parameters == sum(u.numel for u in engine.unit_reports())


def test_a_model_is_sharded_once_and_unshard_gives_it_back() -> None:
    import zero_core

    torch.manual_seed(0)
    model = TinyTransformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = ZeroEngine(model, make_optimizer("sgd", model), ZeroConfig(stage=3, wrap_policy=WrapPolicy((Block,))))
    assert zero_core.engine_of(model) is engine
    try:
        ZeroEngine(model, make_optimizer("sgd", model))
    except ValueError as error:
        assert "already sharded" in str(error) and "zero_core.engine_of(model)" in str(error)
    else:
        raise AssertionError("sharding twice must be refused")
    engine.unshard()
    assert zero_core.engine_of(model) is None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    ids = batch(0, 0)
    lm_loss(model(ids), ids).backward()  # an ordinary module again: no hooks, full parameters
    assert model.blocks[0].up.weight.grad is not None
    optimizer = engine.optimizer
    try:
        optimizer.step()
    except RuntimeError as error:
        assert "Make a new optimizer" in str(error)
    else:
        raise AssertionError("the sharded optimizer must refuse to step the unsharded model")
    assert optimizer.state_dict()["param_groups"]  # still readable
    # Never stepped, it may shard the model again, and then it steps.
    again = ZeroEngine(model, optimizer, ZeroConfig(stage=1))
    lm_loss(model(ids), ids).backward()
    again.step()
    assert again.steps_taken == 1
