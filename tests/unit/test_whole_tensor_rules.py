"""The rules of the optimizers stepped whole (whole_tensor_plan.py's ``STEPPED_WHOLE``) against the state the
optimizers really make, and the owners' rounds (whole_tensor_plan.py) and packing (optim/whole_tensor_step.py),
in one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zero_core.checkpoint.checkpoint_error import CheckpointError
from zero_core.checkpoint.state_dicts import LoadedNumber, with_loaded_numbers
from zero_core.optim.whole_tensor_step import _packed, _unpacked
from zero_core.whole_tensor_plan import (
    StateKind,
    balanced_owners,
    is_whole_state,
    owner_rounds,
    whole_state_problem,
    whole_tensor_rule,
)

SHAPES = [(6, 4), (4, 6), (5, 1), (1, 5), (7,), (2, 3, 4)]


def _built(name: str, shape: tuple[int, ...]) -> torch.optim.Optimizer:
    param = torch.nn.Parameter(torch.randn(shape))
    if name == "muon":
        return torch.optim.Muon([param])
    if name == "adafactor":
        return torch.optim.Adafactor([param])
    Adafactor = pytest.importorskip("transformers.optimization").Adafactor  # noqa: N806 - the class

    return Adafactor([param], lr=1e-2, scale_parameter=False, relative_step=False, beta1=0.9)


@pytest.mark.parametrize("name", ["muon", "adafactor", "hf-adafactor"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_each_rule_names_the_state_the_optimizer_makes_with_its_shapes(name: str, shape: tuple[int, ...]) -> None:
    """After one step of the optimizer itself, its state is what the rule says: the same keys, tensors of the
    rule's shapes, a Python int where it counts the steps with one; the kinds say how each is kept."""
    if name == "muon" and len(shape) != 2:
        pytest.skip("Muon takes matrices only")
    optimizer = _built(name, shape)
    param = optimizer.param_groups[0]["params"][0]
    param.grad = torch.randn(shape)
    optimizer.step()
    made = optimizer.state[param]
    rule = whole_tensor_rule(optimizer)
    assert rule is not None
    entries = rule.state_of(shape, optimizer.param_groups[0])
    assert {entry.key for entry in entries} == set(made)
    for entry in entries:
        value = made[entry.key]
        if entry.kind is StateKind.COUNT:
            assert isinstance(value, int) and value == 1
        else:
            assert tuple(value.shape) == entry.shape, entry
        if entry.kind is StateKind.PER_ELEMENT:
            assert entry.shape == shape
        if entry.kind is StateKind.STEP:
            assert value.device.type == "cpu" and float(value) == 1.0


def test_a_factor_with_the_parameters_shape_is_kept_whole_and_a_misshaped_one_is_named() -> None:
    """The row means of an m x 1 matrix have the matrix's shape: still kept whole, never sharded as per-element
    state; a loaded value of another shape than the rule's is refused with both shapes."""
    optimizer = torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(5, 1))])
    assert is_whole_state(optimizer, (5, 1), "row_var", (5, 1))
    assert not is_whole_state(optimizer, (5, 1), "exp_avg", (5, 1))  # not a key of the rule
    assert whole_state_problem(optimizer, (5, 1), "row_var", (5, 1)) is None
    problem = whole_state_problem(optimizer, (6, 4), "row_var", (6, 4))
    assert problem == "row_var (6, 4), Adafactor keeps (6, 1) for a parameter of (6, 4)"
    muon = torch.optim.Muon([torch.nn.Parameter(torch.zeros(6, 4))])
    assert whole_state_problem(muon, (6, 4), "momentum_buffer", ()) is not None  # a number is not a momentum
    assert whole_state_problem(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]), (3,), "exp_avg", ()) is None


def test_the_whole_state_packs_and_unpacks_exactly_as_the_optimizer_keeps_it() -> None:
    """fp32 factors and step counts both exact through the float64 packing; each comes back as its kind says."""
    optimizer = _built("hf-adafactor", (6, 4))
    rule = whole_tensor_rule(optimizer)
    assert rule is not None
    entries = [e for e in rule.state_of((6, 4), optimizer.param_groups[0]) if e.kind is not StateKind.PER_ELEMENT]
    state = {
        "step": 2**24 + 1,
        "RMS": torch.tensor(0.1),
        "exp_avg_sq_row": torch.rand(6),
        "exp_avg_sq_col": torch.rand(4),
    }
    back = _unpacked(entries, _packed(entries, state, torch.device("cpu")), torch.device("cpu"))
    assert back["step"] == 2**24 + 1 and isinstance(back["step"], int)
    for key in ("RMS", "exp_avg_sq_row", "exp_avg_sq_col"):
        assert back[key].dtype == torch.float32 and torch.equal(back[key], state[key])
    zeros = _unpacked(entries, _packed(entries, {}, torch.device("cpu")), torch.device("cpu"))
    assert zeros["step"] == 0 and all(not zeros[key].any() for key in ("RMS", "exp_avg_sq_row"))
    torch_entries = whole_tensor_rule(torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(3))])).state_of((3,), {})
    kept = [e for e in torch_entries if e.kind is StateKind.STEP]
    step = _unpacked(kept, _packed(kept, {"step": torch.tensor(7.0)}, torch.device("cpu")), torch.device("cpu"))["step"]
    assert step.shape == () and step.dtype == torch.float32 and float(step) == 7.0


def test_owners_are_balanced_and_rounds_hold_each_tensor_once_within_the_largest() -> None:
    costs = [64, 8, 8, 8, 1, 1, 1, 1, 27, 5]
    owned = balanced_owners(costs, 3)
    assert sorted(i for indices in owned for i in indices) == list(range(len(costs)))
    loads = [sum(costs[i] for i in indices) for indices in owned]
    assert max(loads) - min(loads) <= max(costs)
    sizes = [16, 4, 4, 4, 1, 1, 1, 1, 9, 5]
    rounds = owner_rounds(owned, sizes)
    seen = [i for this_round in rounds for indices in this_round.values() for i in indices]
    assert sorted(seen) == list(range(len(sizes)))
    for this_round in rounds:
        for owner, indices in this_round.items():
            assert set(indices) <= set(owned[owner])
            assert len(indices) == 1 or sum(sizes[i] for i in indices) <= max(sizes)
    # Many small tensors share a round: fewer rounds than tensors per owner.
    assert len(rounds) < max(len(indices) for indices in owned)


def test_a_1d_factor_with_the_pieces_length_is_kept_whole() -> None:
    """transformers' row means of a (6, 4) matrix are 1-D of 6 elements: kept whole, whatever a piece's length."""
    optimizer = _built("hf-adafactor", (6, 4))
    assert is_whole_state(optimizer, (6, 4), "exp_avg_sq_row", (6,))
    assert is_whole_state(optimizer, (6, 4), "exp_avg_sq_col", (4,))
    assert not is_whole_state(optimizer, (6, 4), "exp_avg", (6, 4))  # its first moment is per element
    assert whole_state_problem(optimizer, (6, 4), "exp_avg_sq_row", (6, 4)) is not None


def _number_install(shape: tuple[int, ...], key: str) -> tuple:
    master = SimpleNamespace(piece=SimpleNamespace(slot=SimpleNamespace(shape=torch.Size(shape), fqns=("w",))))
    return (master, key, LoadedNumber("w", key))


@pytest.mark.parametrize("value", [float("nan"), -1, 2**60, 1.5, True, "7"])
def test_a_loaded_step_count_that_is_not_one_is_refused(value: object) -> None:
    optimizer = _built("hf-adafactor", (6, 4))
    with pytest.raises(CheckpointError, match=r"w\.step is .*not a step count"):
        with_loaded_numbers(optimizer, {"state": {"w": {"step": value}}}, [_number_install((6, 4), "step")])


def test_a_loaded_step_count_is_installed_and_other_pickled_state_left_out() -> None:
    """A count where the rule keeps one; a pickled number anywhere else (a momentum, an elementwise optimizer's
    key) is not installed, as before numbers were read at all."""
    optimizer = _built("hf-adafactor", (6, 4))
    installs = [_number_install((6, 4), "step"), _number_install((6, 4), "exp_avg")]
    loaded = with_loaded_numbers(optimizer, {"state": {"w": {"step": 5, "exp_avg": 0.0}}}, installs)
    assert [(key, value) for _, key, value in loaded] == [("step", 5)]
    muon = _built("muon", (6, 4))
    assert (
        with_loaded_numbers(
            muon, {"state": {"w": {"momentum_buffer": 0.0}}}, [_number_install((6, 4), "momentum_buffer")]
        )
        == []
    )
