"""The user's optimizer over the master-shard pieces: which optimizers fit, and their state.

The optimizer object stays the same (schedulers bound to it keep driving its
``param_groups``); it updates the fp32 pieces of its parameters that this
rank owns (``param_groups.py`` says when its groups list them). That is
exact for elementwise optimizers. Those that look at whole tensors are either
stepped whole at an owner rank (``whole_tensor_plan.STEPPED_WHOLE``,
``whole_tensor_step.py``) or refused here.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from ..unit import FlatUnit, MasterPiece
from ..whole_tensor_plan import whole_tensor_rule

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
