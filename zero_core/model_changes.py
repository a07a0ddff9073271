"""Changes to the model after sharding that would otherwise train wrongly in silence.

The engine laid every parameter into a flat buffer when it was built. A
parameter object replaced afterwards (``setattr``, ``load_state_dict(assign=True)``),
a parameter whose data was swapped or cast (``model.double()`` in stages 1/2,
``param.data = ...``), or a parameter frozen when the engine was built and
unfrozen later would no longer be what the engine reduces, shards and
steps. Each outermost forward checks the registrations in one pass (a
dictionary lookup and a few attribute reads per parameter) and refuses the
forward with a message that says what to do, before any step uses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from .flat_unit import FlatUnit, UnitState

if TYPE_CHECKING:
    from .runtime import StepRuntime


class ModelChangedError(RuntimeError):
    """The model's parameters changed after the ZeRO engine sharded it."""


class Registration(NamedTuple):
    module: nn.Module
    name: str  # attribute name on ``module``
    fqn: str
    param: nn.Parameter
    unit: FlatUnit
    slot_index: int


_ADVICE = (
    "Make structural changes, casts and device moves before building the engine (choose dtypes with "
    "MixedPrecision), or rebuild it: engine.unshard(), change the model, then a new ZeroEngine."
)


class RegisteredParameters:
    def __init__(self, model: nn.Module, units: list[FlatUnit], runtime: "StepRuntime"):
        self.runtime = runtime
        slot_of = {id(p): (unit, i) for unit in units for i, p in enumerate(unit.params)}
        self.registrations = []
        self.children: list[tuple[nn.Module, str, str, nn.Module]] = []  # (parent, name, path, child)
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, child in module.named_children():
                self.children.append((module, name, f"{module_name}.{name}" if module_name else name, child))
            for name, param in module.named_parameters(recurse=False):
                unit, slot_index = slot_of[id(param)]
                fqn = f"{module_name}.{name}" if module_name else name
                self.registrations.append(Registration(module, name, fqn, param, unit, slot_index))

    def check(self) -> None:
        if self.runtime.summoned:
            return  # inside gathered_parameters(): parameters are full fp32 views on purpose
        for parent, name, path, child in self.children:
            if getattr(parent, name, None) is not child:
                raise ModelChangedError(
                    f"The submodule '{path}' was replaced after ZeRO sharded the model: the engine does not "
                    f"shard, reduce or step the new one's parameters. {_ADVICE}"
                )
        # Plain attribute reads: the guard's __torch_function__ need not answer each one.
        with torch._C.DisableTorchFunctionSubclass():
            for entry in self.registrations:
                self._check_one(entry)

    @staticmethod
    def _check_one(entry: Registration) -> None:
        param, unit = entry.param, entry.unit
        if getattr(entry.module, entry.name, None) is not param:
            raise ModelChangedError(
                f"The parameter '{entry.fqn}' was replaced after ZeRO sharded the model, so the engine "
                f"would keep training the old one. {_ADVICE}"
            )
        slot = unit.layout.slots[entry.slot_index]
        if param.requires_grad and not slot.requires_grad:
            raise ModelChangedError(
                f"'{entry.fqn}' was frozen (requires_grad=False) when the engine was built and has been "
                "unfrozen since: the engine made no gradient shard or optimizer state for it. Build the "
                "engine with every parameter you will train unfrozen and freeze them after; toggling "
                "requires_grad of those is supported."
            )
        if param.dtype != unit.precision.compute_dtype or param.shape != slot.shape:
            raise ModelChangedError(
                f"'{entry.fqn}' was cast or reshaped after sharding (now {param.dtype}, "
                f"{tuple(param.shape)}). {_ADVICE}"
            )
        if unit.state is UnitState.GATHERED and slot.numel and param.data_ptr() != unit.param_data_ptr(entry.slot_index):
            raise ModelChangedError(
                f"The data of '{entry.fqn}' was replaced after sharding (param.data = ..., or a move to "
                f"another device), so the engine would no longer see its updates. {_ADVICE}"
            )
