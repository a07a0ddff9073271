"""Choosing units: which module subtrees are flattened and sharded together.

A unit is a module subtree minus the subtrees of units nested in it. Every
parameter belongs to exactly one unit: the lowest unit that contains every
module registering it, so a parameter shared between two blocks (tied
embeddings) lives in their common ancestor, which is gathered whenever either
block runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from ..config import WrapPolicy


@dataclass
class UnitPlan:
    index: int
    name: str  # module path; "" for the root unit
    module: nn.Module
    parent: int | None
    params: list[nn.Parameter] = field(default_factory=list)
    param_fqns: list[tuple[str, ...]] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)  # modules whose nearest unit is this one


def _size_policy_roots(model: nn.Module, min_numel: int) -> set[nn.Module]:
    """Post-order: a module whose unclaimed parameters reach ``min_numel`` is a unit."""
    roots: set[nn.Module] = set()

    def unclaimed(module: nn.Module) -> dict[int, int]:
        params = {id(p): p.numel() for p in module.parameters(recurse=False)}
        for child in module.children():
            params.update(unclaimed(child))
        if module is not model and sum(params.values()) >= min_numel:
            roots.add(module)
            return {}
        return params

    unclaimed(model)
    return roots


def check_wrap_classes_present(model: nn.Module, policy: WrapPolicy) -> None:
    """A wrap class that no module below the model has would leave its blocks inside the root unit
    without a word (stage 3 would then gather the whole model at once): refused, as Accelerate
    refuses a ``wrap_classes`` name its model lacks."""
    below = [module for module in model.modules() if module is not model]
    missing = [c for c in policy.module_classes if not any(isinstance(module, c) for module in below)]
    if missing:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in missing)
        present = sorted({type(module).__name__ for module in below})
        raise ValueError(
            f"wrap_policy: no module of the model is a {names}, so its blocks would not become units "
            f"(stage 3 would gather the whole model at once). The model's module classes: {present[:20]}. "
            "Name the class of the model's repeated block (its transformer layer, for example)."
        )


def _unit_roots(model: nn.Module, policy: WrapPolicy, bucket_numel: int) -> set[nn.Module]:
    if policy.module_classes:
        return {m for m in model.modules() if m is not model and isinstance(m, policy.module_classes)}
    return _size_policy_roots(model, policy.min_unit_numel or bucket_numel)


def _lowest_common_unit(units: list[int], plans: list[UnitPlan]) -> int:
    def chain(index: int) -> list[int]:
        out = []
        while index is not None:
            out.append(index)
            index = plans[index].parent
        return out

    common = set(chain(units[0]))
    for unit in units[1:]:
        common &= set(chain(unit))
    return next(i for i in chain(units[0]) if i in common)


def parameter_name(fqn: str) -> str:
    """A parameter's name as the engine gives it: a checkpoint_wrapper block's as model.state_dict() does (torch's
    wrapper drops its prefix there). The optimizer state, the checkpoints and the messages use these names, so a
    run with activation checkpointing resumes one without it, and back; the checkpoint loaders read a name saved
    by an engine that kept the prefix (before 2026-12-05) through this too."""
    return fqn.replace(_CHECKPOINT_PREFIX, "")


def plan_units(model: nn.Module, policy: WrapPolicy, bucket_numel: int) -> list[UnitPlan]:
    """Units in pre-order (root first), each with its parameters in registration order."""
    roots = _unit_roots(model, policy, bucket_numel)
    plans = [UnitPlan(0, "", model, None)]
    unit_of_module: dict[int, int] = {id(model): 0}
    users: dict[int, list[int]] = {}  # parameter id -> units of the modules registering it

    def visit(module: nn.Module, path: str, unit: int) -> None:
        if all(m is not module for m in plans[unit].modules):
            plans[unit].modules.append(module)
        for _, param in module.named_parameters(recurse=False, remove_duplicate=False):
            users.setdefault(id(param), []).append(unit)
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            child_unit = unit
            if child in roots:
                if id(child) not in unit_of_module:
                    unit_of_module[id(child)] = len(plans)
                    plans.append(UnitPlan(len(plans), child_path, child, unit))
                child_unit = unit_of_module[id(child)]
            visit(child, child_path, child_unit)

    visit(model, "", 0)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(parameter_name(fqn))
        params[id(param)] = param
    for pid, param in params.items():
        owner = _lowest_common_unit(sorted(set(users[pid])), plans)
        plans[owner].params.append(param)
        plans[owner].param_fqns.append(tuple(names[pid]))
    return plans
