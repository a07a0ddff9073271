"""Rebuilding the user's optimizer in place over the master-shard pieces.

The optimizer object stays the same (schedulers bound to it keep driving its
``param_groups``); each group's ``params`` becomes the fp32 pieces of its
parameters that this rank owns, empty pieces left out. That is exact for
elementwise optimizers and wrong for ones that look at whole tensors, which
are refused here.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
from torch import nn

from .flat_unit import FlatUnit, MasterPiece

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

# Optimizers that need whole tensors (line searches, factored or per-matrix state).
WHOLE_TENSOR_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("LBFGS", "SparseAdam", "Adafactor", "Muon")
    if hasattr(torch.optim, name)
)


def canonical_names(units: list[FlatUnit]) -> dict[int, str]:
    """id(parameter) -> its first name in the model: how groups and checkpoints name it."""
    return {id(p): slot.fqns[0] for unit in units for slot, p in zip(unit.layout.slots, unit.params)}


def check_optimizer_supported(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS):
        raise ValueError(
            f"{type(optimizer).__name__} needs whole parameter tensors, but ZeRO gives each rank "
            "a flat slice of them. Use an elementwise optimizer such as torch.optim.AdamW or SGD."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
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
                state["sum"] = torch.full_like(param, group["initial_accumulator_value"])


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, units: list[FlatUnit]
) -> list[list[str]]:
    """Point ``optimizer.param_groups`` at this rank's master pieces, in place.

    Returns each group's parameters by name (every rank alike), which is how
    checkpoints refer to them.
    """
    group_of: dict[int, int] = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) in group_of:
                raise ValueError("A parameter appears in two optimizer param groups; list it once.")
            group_of[id(param)] = group_index
    model_params = {id(p) for p in model.parameters()}
    foreign = [k for k in group_of if k not in model_params]
    if foreign:
        raise ValueError(
            f"The optimizer holds {len(foreign)} tensor(s) that are not parameters of the model. "
            "Build the optimizer over model.parameters() (or groups of them)."
        )
    new_params: dict[int, list[nn.Parameter]] = defaultdict(list)
    for unit in units:
        for master in unit.master_pieces:
            param = unit.params[master.piece.slot.index]
            if id(param) not in group_of:
                continue  # trainable but not optimized: its gradient is reduced and ignored
            new_params[group_of[id(param)]].append(master.param)
    name_of = canonical_names(units)
    group_names = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    for group_index, group in enumerate(optimizer.param_groups):
        group["params"] = new_params[group_index]
    optimizer.state = defaultdict(dict)
    _state_at_construction(optimizer)
    return group_names


def adopt_added_param_groups(
    optimizer: torch.optim.Optimizer, units: list[FlatUnit], known_names: list[list[str]]
) -> list[list[str]]:
    """Groups added with ``optimizer.add_param_group(model params)`` since the engine was built
    (progressive unfreezing) train this rank's pieces of them.

    Returns the new groups' parameter names. Called before each optimizer
    step and before checkpoints read the groups; a tensor the engine did not
    shard is refused, since its updates would differ between ranks.
    """
    added = optimizer.param_groups[len(known_names):]
    if not added:
        return []
    masters = {id(m.param) for u in units for m in u.master_pieces}
    pieces_of: dict[int, list[nn.Parameter]] = defaultdict(list)
    name_of = canonical_names(units)
    for unit in units:
        for master in unit.master_pieces:
            pieces_of[id(unit.params[master.piece.slot.index])].append(master.param)
    # By name, which every rank knows alike (pieces exist on some ranks only).
    already = {name for group_names in known_names for name in group_names}
    for group in added:  # every group is checked before any is converted: a refusal leaves all as they were
        duplicated = [name_of[id(p)] for p in group["params"] if name_of.get(id(p)) in already]
        if duplicated:
            raise ValueError(
                f"optimizer.add_param_group() was given parameters already in a param group ({', '.join(duplicated)}); "
                "each parameter may be in one group only."
            )
        unknown = [p for p in group["params"] if id(p) not in name_of and id(p) not in masters]
        if unknown:
            raise ValueError(
                f"optimizer.add_param_group() was given {len(unknown)} tensor(s) the ZeRO engine did not shard "
                "(a layer added after the engine was built?). Add layers before building the engine."
            )
    names = []
    for group in added:
        names.append([name_of[id(p)] for p in group["params"] if id(p) in name_of])
        group["params"] = [piece for p in group["params"] for piece in (pieces_of[id(p)] if id(p) in name_of else [p])]
    return names


def install_optimizer_state(
    optimizer: torch.optim.Optimizer, group_settings: list[dict], state: list[tuple[MasterPiece, str, torch.Tensor]]
) -> None:
    """Replace the optimizer's hyperparameters and state with loaded ones (validated by the loader)."""
    for group, settings in zip(optimizer.param_groups, group_settings):
        group.update(settings)
    optimizer.state.clear()
    for master, key, tensor in state:
        optimizer.state[master.param][key] = tensor
