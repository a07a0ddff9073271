"""OptimizerGroups: the optimizer's groups by name, and the switch between the model's
parameters (between steps) and this rank's master pieces (inside step / state_dict)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zero_core.optim.param_groups import GroupsHold, OptimizerGroups
from zero_core.unit import FlatLayout, MasterPiece

WORLD_SIZE = 2


def _unit(named: list[tuple[tuple[str, ...], nn.Parameter]], rank: int) -> SimpleNamespace:
    """What OptimizerGroups reads of a unit: its layout, parameters and this rank's master pieces."""
    layout = FlatLayout.build([(fqns, p.shape, p.requires_grad) for fqns, p in named], WORLD_SIZE)
    masters = [MasterPiece(piece, nn.Parameter(torch.zeros(piece.numel))) for piece in layout.pieces(rank)]
    return SimpleNamespace(layout=layout, params=[p for _, p in named], master_pieces=masters)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Two ranks. Unit 0 (body, 12 elements): rank 0 holds body.weight[:6], rank 1 the rest and body.bias.
        # Unit 1 (head and extra, 14): rank 0 holds head.weight and head.bias[:1], rank 1 the rest and extra.
        self.body = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)
        self.extra = nn.Parameter(torch.zeros(6))

    def units(self, rank: int) -> list[SimpleNamespace]:
        return [
            _unit([(("body.weight",), self.body.weight), (("body.bias",), self.body.bias)], rank),
            _unit(
                [(("head.weight",), self.head.weight), (("head.bias",), self.head.bias), (("extra",), self.extra)], rank
            ),
        ]


def _setup(rank: int = 0) -> tuple[Model, torch.optim.Optimizer, OptimizerGroups, list[SimpleNamespace]]:
    model = Model()
    optimizer = torch.optim.SGD(
        [{"params": [model.body.weight, model.body.bias]}, {"params": [model.head.weight, model.extra], "lr": 0.5}],
        lr=0.1,
        momentum=0.9,
    )
    units = model.units(rank)
    return model, optimizer, OptimizerGroups(optimizer, units), units


def _pieces(units: list[SimpleNamespace], *names: str) -> list[nn.Parameter]:
    return [m.param for u in units for m in u.master_pieces if m.piece.slot.fqns[0] in names]


def test_groups_are_read_by_name_and_hold_the_model_parameters() -> None:
    model, optimizer, groups, _ = _setup()
    assert groups.names == [["body.weight", "body.bias"], ["head.weight", "extra"]]
    assert groups.holding is GroupsHold.MODEL_PARAMETERS
    assert optimizer.param_groups[1]["params"] == [model.head.weight, model.extra]


def test_show_pieces_lists_this_ranks_pieces_and_show_model_parameters_puts_the_same_tensors_back() -> None:
    model, optimizer, groups, units = _setup(rank=0)
    groups.show_pieces()
    assert groups.holding is GroupsHold.MASTER_PIECES
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 1]  # no piece of body.bias or extra here
    assert optimizer.param_groups[0]["params"] == _pieces(units, "body.weight", "body.bias")
    assert optimizer.param_groups[1]["lr"] == 0.5  # hyperparameters untouched
    groups.show_pieces()  # idempotent
    groups.show_model_parameters()
    assert optimizer.param_groups[0]["params"][0] is model.body.weight
    assert optimizer.param_groups[1]["params"] == [model.head.weight, model.extra]
    groups.show_model_parameters()  # idempotent
    assert groups.holding is GroupsHold.MODEL_PARAMETERS


def test_another_rank_gets_its_own_pieces() -> None:
    _, optimizer, groups, units = _setup(rank=1)
    groups.show_pieces()
    assert optimizer.param_groups[1]["params"] == _pieces(units, "head.weight", "extra")
    assert [m.piece.slot.fqns[0] for m in units[1].master_pieces] == ["head.bias", "extra"]
    assert len(optimizer.param_groups[1]["params"]) == 1  # head.weight lies wholly in rank 0's shard


def test_read_after_a_step_that_raised_shows_the_model_parameters_again() -> None:
    model, optimizer, groups, _ = _setup()
    groups.show_pieces()
    assert groups.read() == [["body.weight", "body.bias"], ["head.weight", "extra"]]
    assert optimizer.param_groups[0]["params"] == [model.body.weight, model.body.bias]


def test_a_group_added_between_steps_is_read_by_name() -> None:
    model, optimizer, groups, _ = _setup()
    optimizer.add_param_group({"params": [model.head.bias], "lr": 0.01})
    assert not groups.changed_since_compared
    assert groups.read()[2] == ["head.bias"]
    assert groups.changed_since_compared
    groups.mark_compared()
    assert not groups.changed_since_compared


def test_a_tensor_the_engine_did_not_shard_is_refused_and_the_names_are_kept() -> None:
    _, optimizer, groups, _ = _setup()
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match=r"hold 1 tensor\(s\) the ZeRO engine did not shard") as error:
        groups.read()
    assert "add layers before building the engine" in str(error.value)
    assert groups.names == [["body.weight", "body.bias"], ["head.weight", "extra"]]


def test_a_parameter_in_two_groups_is_named() -> None:
    model, optimizer, groups, _ = _setup()
    optimizer.param_groups[1]["params"].append(model.body.bias)  # add_param_group would refuse it itself
    with pytest.raises(ValueError, match=r"listed again \(body.bias\); each parameter may be in one group only"):
        groups.read()


def test_fingerprints_follow_the_groups_and_their_settings() -> None:
    model, optimizer, groups, _ = _setup()
    names, settings = groups.fingerprint, groups.settings_fingerprint
    assert OptimizerGroups(optimizer, model.units(1)).fingerprint == names  # every rank alike
    optimizer.param_groups[0]["momentum"] = 0.9000000001
    assert groups.settings_fingerprint != settings
    optimizer.param_groups[0]["momentum"] = 0.9
    optimizer.param_groups[1]["weight_decay"] = 0.0  # was 0: described alike
    assert groups.settings_fingerprint == settings
    optimizer.param_groups[1]["params"].reverse()
    groups.read()
    assert groups.fingerprint != names


def test_a_group_replaced_while_pieces_are_shown_is_recognised_by_its_pieces() -> None:
    model, optimizer, groups, units = _setup()
    groups.show_pieces()
    # load_state_dict makes new group dicts holding the same pieces.
    optimizer.param_groups[0] = {**optimizer.param_groups[0], "params": list(optimizer.param_groups[0]["params"])}
    foreign = [nn.Parameter(torch.zeros(1))]
    optimizer.param_groups[1] = {**optimizer.param_groups[1], "params": foreign}  # the user's own edit
    groups.show_model_parameters()
    assert optimizer.param_groups[0]["params"] == [model.body.weight, model.body.bias]
    assert optimizer.param_groups[1]["params"] is foreign  # left as it is


def test_state_dict_is_keyed_by_the_pieces_and_leaves_the_model_parameters_shown() -> None:
    model, optimizer, groups, units = _setup()
    hooks = groups.install_hooks()
    groups.show_pieces()
    for piece in optimizer.param_groups[0]["params"] + optimizer.param_groups[1]["params"]:
        piece.grad = torch.ones_like(piece)
    optimizer.step()  # momentum buffers, one per piece
    groups.show_model_parameters()
    state = optimizer.state_dict()
    assert [g["params"] for g in state["param_groups"]] == [[0], [1]]  # this rank's pieces only
    assert set(state["state"]) == {0, 1}
    assert optimizer.param_groups[0]["params"] == [model.body.weight, model.body.bias]
    assert groups.holding is GroupsHold.MODEL_PARAMETERS

    optimizer.load_state_dict(state)
    assert optimizer.param_groups[1]["params"] == [model.head.weight, model.extra]
    piece = _pieces(units, "head.weight")[0]
    assert torch.equal(optimizer.state[piece]["momentum_buffer"], torch.ones_like(piece))
    for hook in hooks:
        hook.remove()


def test_a_state_dict_of_another_rank_is_refused_before_switching() -> None:
    _, optimizer, groups, _ = _setup(rank=0)
    groups.install_hooks()
    other_optimizer, other_groups = _setup(rank=1)[1:3]
    other_groups.install_hooks()
    other = other_optimizer.state_dict()  # group 0 holds two pieces there, one here
    with pytest.raises(ValueError, match="does not fit this rank's shards") as error:
        optimizer.load_state_dict(other)
    assert "checkpoint with the engine's save_checkpoint/load_checkpoint" in str(error.value)
    assert groups.holding is GroupsHold.MODEL_PARAMETERS
    with pytest.raises(ValueError, match="does not fit this rank's shards"):
        optimizer.load_state_dict({"state": {}})
