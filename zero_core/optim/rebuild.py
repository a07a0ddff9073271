"""The user's optimizer over the master-shard pieces: which optimizers fit, and their state.

The optimizer object stays the same (schedulers bound to it keep driving its
``param_groups``); it updates the fp32 pieces of its parameters that this
rank owns (``param_groups.py`` says when its groups list them). That is
exact for elementwise optimizers. Those that look at whole tensors are either
stepped whole at an owner rank (``STEPPED_WHOLE``, ``whole_tensor_step.py``)
or refused here.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

import torch

from ..muon_with_adamw import MuonWithAuxAdamW
from ..unit import FlatUnit, MasterPiece

# Optimizers whose update of an element depends only on that element's history.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)


class StateKind(Enum):
    """How a whole-tensor optimizer's state value lives between steps: what the exchange sends and keeps."""

    PER_ELEMENT = "per element"  # shaped like the parameter (a momentum): sharded like it, in each holder's pieces
    FACTOR = "factor"  # a smaller fp32 tensor on the weight's device (a row or column mean): every holder keeps it
    STEP = "step"  # a 0-d fp32 step count on the host, as torch keeps it: every holder keeps it
    COUNT = "count"  # a Python int step count, as transformers' Adafactor keeps it: every holder keeps it


class StateEntry(NamedTuple):
    key: str
    shape: tuple[int, ...]  # the whole tensor's (() for a count)
    kind: StateKind


def _muon_state(shape: tuple[int, ...], group: dict) -> tuple[StateEntry, ...]:
    return (StateEntry("momentum_buffer", shape, StateKind.PER_ELEMENT),)


def _adafactor_state(shape: tuple[int, ...], group: dict) -> tuple[StateEntry, ...]:
    """torch's Adafactor: the second moment factored into a row and a column mean for a tensor of 2 or more
    dimensions (reduced over its last, then its second-last dimension), per element for a vector."""
    step = StateEntry("step", (), StateKind.STEP)
    if len(shape) < 2:
        return (step, StateEntry("variance", shape, StateKind.PER_ELEMENT))
    rows = (*shape[:-1], 1)
    columns = (*shape[:-2], 1, shape[-1])
    return (step, StateEntry("row_var", rows, StateKind.FACTOR), StateEntry("col_var", columns, StateKind.FACTOR))


def _transformers_adafactor_state(shape: tuple[int, ...], group: dict) -> tuple[StateEntry, ...]:
    """transformers' Adafactor (the Hugging Face Trainer's ``optim="adafactor"``): its row and column means drop
    the reduced dimension, a first moment when the group has ``beta1``, the weight's RMS, a Python step count."""
    entries = [StateEntry("step", (), StateKind.COUNT), StateEntry("RMS", (), StateKind.FACTOR)]
    if group.get("beta1") is not None:
        entries.append(StateEntry("exp_avg", shape, StateKind.PER_ELEMENT))
    if len(shape) >= 2:
        entries += [
            StateEntry("exp_avg_sq_row", shape[:-1], StateKind.FACTOR),
            StateEntry("exp_avg_sq_col", (*shape[:-2], shape[-1]), StateKind.FACTOR),
        ]
    else:
        entries.append(StateEntry("exp_avg_sq", shape, StateKind.PER_ELEMENT))
    return tuple(entries)


def newton_schulz_cost(shape: tuple[int, ...]) -> int:
    """Newton-Schulz's work for an m x n matrix, m·n·min(m, n); another tensor, its size."""
    return shape[0] * shape[1] * min(shape) if len(shape) == 2 else math.prod(shape)


class WholeTensorRule(NamedTuple):
    """How an optimizer that needs whole tensors runs under ZeRO: the state it keeps for a parameter of a given
    shape in a given group (zeros before the first step, which is where the optimizer starts its own), the work
    of stepping a tensor (to balance the owners), and which of its groups are stepped whole (``group_flag``: the
    groups whose value for that key is true; None: every group)."""

    state_of: Callable[[tuple[int, ...], dict], tuple[StateEntry, ...]]
    cost_of: Callable[[tuple[int, ...]], int]
    group_flag: str | None = None
    matrices_only: bool = False  # a tensor of its whole groups that is not 2-D is refused, as torch's Muon does

    def steps_whole(self, group: dict) -> bool:
        return self.group_flag is None or group.get(self.group_flag) is True


# Optimizers that need whole tensors and run here whole, each tensor at one owner rank (whole_tensor_step.py).
STEPPED_WHOLE: dict[type[torch.optim.Optimizer], WholeTensorRule] = {
    torch.optim.Muon: WholeTensorRule(_muon_state, newton_schulz_cost, matrices_only=True),
    # Its AdamW groups step their pieces.
    MuonWithAuxAdamW: WholeTensorRule(_muon_state, newton_schulz_cost, group_flag="use_muon", matrices_only=True),
    # Every tensor whole, vectors too: its step size reads the norm of the whole weight and of the whole update.
    torch.optim.Adafactor: WholeTensorRule(_adafactor_state, math.prod),
}
_TRANSFORMERS_ADAFACTOR = WholeTensorRule(_transformers_adafactor_state, math.prod)


def whole_tensor_rule(optimizer: torch.optim.Optimizer) -> WholeTensorRule | None:
    """How ``optimizer`` runs under ZeRO if it needs whole tensors (None: it steps this rank's pieces itself)."""
    rule = next((rule for kind, rule in STEPPED_WHOLE.items() if isinstance(optimizer, kind)), None)
    # transformers' own Adafactor, looked up only where transformers is loaded (it is not a dependency).
    optimization = sys.modules.get("transformers.optimization")
    if rule is None and optimization is not None and isinstance(optimizer, optimization.Adafactor):
        return _TRANSFORMERS_ADAFACTOR
    return rule


def kept_state_entry(optimizer: torch.optim.Optimizer | None, shape: tuple[int, ...], key: str) -> StateEntry | None:
    """The rule's entry for ``key`` of a parameter of ``shape`` (its shape and kind do not depend on the group;
    only whether a group keeps it does, so every group is asked)."""
    rule = whole_tensor_rule(optimizer) if optimizer is not None else None
    if rule is None:
        return None
    entries = (entry for group in optimizer.param_groups for entry in rule.state_of(shape, group))
    return next((entry for entry in entries if entry.key == key), None)


def whole_state_problem(
    optimizer: torch.optim.Optimizer | None, shape: tuple[int, ...], key: str, size: tuple[int, ...]
) -> str | None:
    """Why a loaded state value of ``size`` (a number's: ``()``) cannot be ``key`` of a parameter of ``shape``
    for this optimizer: a key its rule keeps must have the rule's shape (the exchange copies it into whole
    tensors of that shape). None: the rule does not keep the key (the checks for elementwise state apply), or
    the shape is its own."""
    entry = kept_state_entry(optimizer, shape, key)
    if entry is None or tuple(size) == entry.shape:
        return None
    return f"{key} {tuple(size)}, {type(optimizer).__name__} keeps {entry.shape} for a parameter of {shape}"


def is_whole_state(
    optimizer: torch.optim.Optimizer | None, shape: tuple[int, ...], key: str, size: tuple[int, ...]
) -> bool:
    """A tensor the rule keeps whole on every holder (Adafactor's row and column means), with its shape: never
    sharded, even where its shape is the parameter's (the row means of an m x 1 matrix)."""
    entry = kept_state_entry(optimizer, shape, key)
    return entry is not None and entry.kind is not StateKind.PER_ELEMENT and entry.shape == tuple(size)


# A step count is a Python int below float64's exact range (it travels in the packed float64 tensor).
_LARGEST_COUNT = 2**53


def count_problem(value: object) -> str | None:
    """Why a loaded value cannot be a ``StateKind.COUNT`` (None: it can)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _LARGEST_COUNT:
        return f"{value!r}, not a step count (an int from 0 to 2**53)"
    return None


# Optimizers refused, with the reason: no flat shard can serve them.
REFUSED_OPTIMIZERS: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.LBFGS: "its step takes a closure that re-runs the loss, and it searches along all parameters at once",
    torch.optim.SparseAdam: "it takes sparse gradients, and ZeRO reduces dense flat ones",
}


def canonical_names(units: list[FlatUnit]) -> dict[int, str]:
    """id(parameter) -> its first name in the model: how groups and checkpoints name it."""
    return {id(p): slot.fqns[0] for unit in units for slot, p in zip(unit.layout.slots, unit.params)}


def check_optimizer_supported(optimizer: torch.optim.Optimizer) -> None:
    reason = next((why for kind, why in REFUSED_OPTIMIZERS.items() if isinstance(optimizer, kind)), None)
    if reason is not None:
        raise ValueError(
            f"{type(optimizer).__name__} does not run under ZeRO: {reason}. Use an elementwise optimizer such "
            "as torch.optim.AdamW or SGD, or torch.optim.Muon or Adafactor (stepped whole at an owner rank)."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) and whole_tensor_rule(optimizer) is None:
        warnings.warn(
            f"{type(optimizer).__name__} is not a known elementwise optimizer. ZeRO hands it "
            "1-D slices of parameters: results are exact only if its update is elementwise.",
            stacklevel=3,
        )
    if any(_has_stepped(state) for state in optimizer.state.values()):
        raise ValueError(
            "The optimizer already has state (it has stepped). Build the ZeRO engine right after "
            "creating the optimizer, and load optimizer checkpoints through the engine."
        )


def _has_stepped(state: dict) -> bool:
    """Adagrad fills its state at construction (step 0); that is not a step taken."""
    step = state.get("step")
    return bool(state) and (step is None or float(step) != 0.0)


def _state_at_construction(optimizer: torch.optim.Optimizer) -> None:
    """What an optimizer's constructor puts into its state, for the new master pieces."""
    if isinstance(optimizer, torch.optim.Adagrad):
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state[param]
                state["step"] = torch.tensor(0.0)
                # The constructor's value, not the group's: torch ignores a per-group initial_accumulator_value.
                state["sum"] = torch.full_like(param, optimizer.defaults["initial_accumulator_value"])


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Fresh state for the master pieces the groups hold now (``OptimizerGroups.show_pieces``)."""
    optimizer.state = defaultdict(dict)
    _state_at_construction(optimizer)


def install_optimizer_state(
    optimizer: torch.optim.Optimizer, group_settings: list[dict], state: list[tuple[MasterPiece, str, torch.Tensor]]
) -> None:
    """Replace the optimizer's hyperparameters and state with loaded ones (validated by the loader)."""
    for group, settings in zip(optimizer.param_groups, group_settings):
        group.update(settings)
    optimizer.state.clear()
    for master, key, tensor in state:
        optimizer.state[master.param][key] = tensor
