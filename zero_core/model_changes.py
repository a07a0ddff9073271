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

from typing import NamedTuple

from torch import nn

from .flat_unit import FlatUnit, UnitState


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
    def __init__(self, model: nn.Module, units: list[FlatUnit]):
        slot_of = {id(p): (unit, i) for unit in units for i, p in enumerate(unit.params)}
        self.registrations = []
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, param in module.named_parameters(recurse=False):
                unit, slot_index = slot_of[id(param)]
                fqn = f"{module_name}.{name}" if module_name else name
                self.registrations.append(Registration(module, name, fqn, param, unit, slot_index))

    def check(self) -> None:
        for entry in self.registrations:
            current = getattr(entry.module, entry.name, None)
            if current is not entry.param:
                raise ModelChangedError(
                    f"The parameter '{entry.fqn}' was replaced after ZeRO sharded the model, so the engine "
                    f"would keep training the old one. {_ADVICE}"
                )
            slot = entry.unit.layout.slots[entry.slot_index]
            if entry.param.requires_grad and not slot.requires_grad:
                raise ModelChangedError(
                    f"'{entry.fqn}' was frozen (requires_grad=False) when the engine was built and has been "
                    "unfrozen since: the engine made no gradient shard or optimizer state for it. Build the "
                    "engine with every parameter you will train unfrozen and freeze them after; toggling "
                    "requires_grad of those is supported."
                )
            if entry.param.dtype != entry.unit.precision.compute_dtype or entry.param.shape != slot.shape:
                raise ModelChangedError(
                    f"'{entry.fqn}' was cast or reshaped after sharding (now {entry.param.dtype}, "
                    f"{tuple(entry.param.shape)}). {_ADVICE}"
                )
            if entry.unit.state is UnitState.GATHERED and entry.param.data_ptr() != entry.unit.param_data_ptr(entry.slot_index):
                raise ModelChangedError(
                    f"The data of '{entry.fqn}' was replaced after sharding (param.data = ..., or a move to "
                    f"another device), so the engine would no longer see its updates. {_ADVICE}"
                )
