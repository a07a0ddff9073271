"""Loading an ordinary full optimizer state dict into the shards.

What a DDP run or ``zero-consolidate --format lightning`` leaves in a file:
``optimizer.state_dict()`` in torch's layout (state and groups by parameter
index) or in FSDP's (by parameter name, as our sharded checkpoints hold it).
Each rank keeps only its pieces of every per-element tensor (a memory-mapped
file is read where the pieces lie) and installs them once every rank has
read its part, so a failure anywhere changes nothing anywhere.

Parameter indices are matched to names group by group, in order, exactly as
``torch.optim.Optimizer.load_state_dict`` matches them to parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..unit import MasterPiece, parameter_name
from ..whole_tensor_plan import StateKind, count_problem, is_whole_state, kept_state_entry, whole_state_problem
from .agreed_steps import RankAgreement
from .checkpoint_error import CheckpointError, mismatch_error
from .checkpoint_records import LoadedOptimizer, ShardedModel
from .chunks import read_rectangles
from .loading import group_settings
from .state_dicts import slot_rectangles

_NUMBERS = (bool, int, float)


def _names_by_saved_key(saved_groups: list[Any], group_names: list[list[str]], where: str) -> dict[Any, str]:
    """Each saved group's parameter keys (indices, or names already) -> our parameter names."""
    if len(saved_groups) != len(group_names):
        raise CheckpointError(
            f"{where}: the optimizer state has {len(saved_groups)} param groups, this optimizer "
            f"{len(group_names)}; build the optimizer with the groups it was saved with."
        )
    names: dict[Any, str] = {}
    for index, (saved, ours) in enumerate(zip(saved_groups, group_names)):
        keys = saved["params"]
        if len(keys) != len(ours):
            raise CheckpointError(
                f"{where}: param group {index} holds {len(keys)} parameters in the optimizer state and "
                f"{len(ours)} in this optimizer; build the optimizer over the same parameters, in the same order."
            )
        if all(isinstance(key, str) for key in keys):  # FSDP's layout: names (checked against ours later)
            names.update((key, parameter_name(key)) for key in keys)
        elif all(isinstance(key, int) and not isinstance(key, bool) for key in keys):  # torch's: indices
            names.update(zip(keys, ours))
        else:
            raise CheckpointError(f"{where}: param group {index}'s 'params' are neither all indices nor all names.")
    return names


def _check_layout(saved: Any, where: str) -> None:
    valid = (
        isinstance(saved, Mapping)
        and isinstance(saved.get("state"), Mapping)
        and isinstance(saved.get("param_groups"), list)
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in saved["param_groups"])
        and all(isinstance(v, Mapping) for v in saved["state"].values())
    )
    if not valid:
        raise CheckpointError(
            f"{where} is not an optimizer state dict ({{'state': ..., 'param_groups': [...]}} as "
            "optimizer.state_dict() returns)."
        )


def _is_per_element(shape: tuple[int, ...], key: str, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == shape and (len(shape) > 0 or key != "step")


def _problem(optimizer: torch.optim.Optimizer | None, shape: tuple[int, ...], key: str, value: Any) -> str | None:
    """Why ``value`` cannot be a parameter's state: per-element tensors have its shape, others are scalars, or
    the factors a whole-tensor optimizer keeps (of the shape its rule gives)."""
    if isinstance(value, (torch.Tensor, *_NUMBERS)):
        size = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        if problem := whole_state_problem(optimizer, shape, key, size):
            return problem
    kept = kept_state_entry(optimizer, shape, key)
    if kept is not None and kept.kind is StateKind.COUNT:
        return count_problem(value)
    if isinstance(value, _NUMBERS) or _is_per_element(shape, key, value):
        return None
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a tensor or a number"
    if value.dim() == 0 or is_whole_state(optimizer, shape, key, tuple(value.shape)):
        return None
    return f"state {tuple(value.shape)}, parameter {shape}"


def _local_value(optimizer, master: MasterPiece, key: str, value: Any, device: torch.device) -> Any:
    """This rank's piece of a per-element tensor; scalars and the factors kept whole, whole."""
    slot = master.piece.slot
    shape = tuple(slot.whole_shape)
    if _is_per_element(shape, key, value) and not is_whole_state(optimizer, shape, key, tuple(value.shape)):
        start = master.piece.param_start
        return read_rectangles(value, slot_rectangles(slot, start, start + master.piece.numel)).to(device, copy=True)
    return value.clone() if isinstance(value, torch.Tensor) else value


def _read(view: ShardedModel, saved: Any, where: str) -> LoadedOptimizer:
    _check_layout(saved, where)
    groups = saved["param_groups"]
    names = _names_by_saved_key(groups, view.param_group_names, where)
    named_groups = [{**group, "params": [names[key] for key in group["params"]]} for group in groups]
    settings = group_settings(view, named_groups, where)  # our names, and hyperparameters of our kinds
    unknown = [str(key) for key in saved["state"] if key not in names]
    if unknown:
        raise mismatch_error(f"{where}: state for parameters no param group holds", [], sorted(unknown), [])
    state = {names[key]: value for key, value in saved["state"].items()}
    slots = {slot.fqns[0]: slot for unit in view.units for slot in unit.layout.slots}
    misshaped = [  # every entry, not only this rank's pieces: ranks must refuse the same state alike
        f"{name} {key} ({problem})"
        for name, values in state.items()
        for key, value in values.items()
        if (problem := _problem(view.optimizer, tuple(slots[name].whole_shape), key, value))
    ]
    if misshaped:
        raise mismatch_error(f"{where}'s optimizer state does not fit this model", [], [], misshaped)
    installs = [
        (master, key, _local_value(view.optimizer, master, key, value, unit.storage.resting_master.device))
        for unit in view.units
        for master in unit.master_pieces
        for key, value in state.get(master.piece.slot.fqns[0], {}).items()
    ]
    return LoadedOptimizer(settings, installs)


def read_full_optimizer_state(view: ShardedModel, saved: Any, where: str) -> LoadedOptimizer:
    """This rank's part of ``saved`` (a full optimizer state dict), agreed on every rank before anything
    is installed: a problem on any rank raises the same ``CheckpointError`` on all."""
    agreement = RankAgreement(view.comm, f"loading the optimizer state from {where}")
    loaded, _ = agreement.run("reading the optimizer state", lambda: _read(view, saved, where))
    return loaded
