"""Changes to the model after sharding that would otherwise train wrongly in silence.

The engine laid every parameter into a flat buffer when it was built. A
parameter or submodule replaced afterwards (``setattr``), or a parameter
whose data was swapped or cast (``model.double()`` in stages 1/2,
``param.data = ...``) would no longer be what the engine reduces, shards
and steps. (Freezing and unfreezing are fine: see ``FlatUnit.trainable``.)
Each outermost forward checks the registrations in one pass (a dictionary
lookup and a few attribute reads per parameter) and refuses the forward with
a message that says what to do, before any step uses it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..pass_listeners import PassListener
from ..unit import FlatUnit, StorageState
from ..unit.dtensor_params import is_dtensor, local_values
from .pass_control import PassControl


class ModelChangedError(RuntimeError):
    """The model's parameters changed after the ZeRO engine sharded it.

    What it means: the engine laid every parameter into its flat buffers when it was built. A
    submodule or parameter replaced afterwards (``model.head = nn.Linear(...)``, ``setattr``), a
    parameter cast, reshaped or moved (``model.double()``, ``model.to(other_device)``,
    ``param.data = ...``), or a tensor-parallel parameter converted would no longer be what the engine
    reduces, shards and steps, and would train wrongly in silence. The next outermost forward
    checks the model and refuses, naming the parameter or submodule, before any step uses it.
    Freezing and unfreezing (``requires_grad_``) are fine.

    What to do: make structural changes, casts and device moves before building the engine (choose
    the compute dtype with ``MixedPrecision`` or the framework's precision flag, not ``model.half()``),
    or rebuild: ``engine.unshard()``, change the model, then build a new ``ZeroEngine``.
    """


class Registration(NamedTuple):
    registry: dict  # the module's own parameter dict (``module._parameters``), read directly for speed
    name: str  # attribute name on the module
    fqn: str
    param: nn.Parameter
    unit: FlatUnit
    slot_index: int
    shape: torch.Size  # the parameter's own (a DTensor's global shape)
    dtensor: bool  # tensor parallelism: its data is its local piece's
    # A DTensor's C++ tensor, which holds its gradient hooks: model.to() and friends swap it for a new one
    # (torch.utils.swap_tensors, as torch converts tensor subclasses), and the engine's hooks would be gone.
    tensor_id: int


_ADVICE = (
    "Make structural changes, casts and device moves before building the engine (choose dtypes with "
    "MixedPrecision), or rebuild it: engine.unshard(), change the model, then a new ZeroEngine."
)


def _moved(entry: Registration, expected_address: int) -> bool:
    """The parameter's data (a DTensor's local piece) no longer starts where the unit's buffer put it."""
    data = local_values(entry.param) if entry.dtensor else entry.param
    return data.data_ptr() != expected_address and bool(data.numel())


class RegisteredParameters(PassListener):
    """Checked at every outermost forward, so the loop is kept tight: the modules'
    own ``_parameters``/``_modules`` dicts (stable objects) instead of ``getattr``,
    and attribute reads with the guard's ``__torch_function__`` switched off
    (about 1 µs per parameter)."""

    def __init__(self, model: nn.Module, units: list[FlatUnit], runtime: PassControl):
        self.runtime = runtime
        slot_of = {id(p): (unit, i) for unit in units for i, p in enumerate(unit.params)}
        self.registrations = []
        self.children: list[tuple[dict, str, str, nn.Module]] = []  # (parent's _modules, name, path, child)
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, child in module.named_children():
                self.children.append((module._modules, name, f"{module_name}.{name}" if module_name else name, child))
            for name, param in module.named_parameters(recurse=False):
                unit, slot_index = slot_of[id(param)]
                fqn = f"{module_name}.{name}" if module_name else name
                shape, dtensor = param.shape, is_dtensor(param)
                entry = Registration(
                    module._parameters, name, fqn, param, unit, slot_index, shape, dtensor, param._cdata
                )
                self.registrations.append(entry)
        self.by_unit = [
            (unit, [(e, unit.slot_byte_offsets[e.slot_index]) for e in self.registrations if e.unit is unit])
            for unit in units
        ]

    def before_outermost_forward(self) -> None:
        """Every forward starts by checking the model's parameters against the units."""
        if self.runtime.suspended:
            return  # inside gathered_parameters(): parameters are full fp32 views on purpose
        for modules, name, path, child in self.children:
            if modules.get(name) is not child:
                raise ModelChangedError(
                    f"The submodule '{path}' was replaced after ZeRO sharded the model: the engine does not "
                    f"shard, reduce or step the new one's parameters. {_ADVICE}"
                )
        with torch._C.DisableTorchFunctionSubclass():
            for unit, entries in self.by_unit:
                dtype = unit.precision.compute_dtype
                # Where each parameter's data must start; at rest (stage 3) the guard keeps data from
                # changing. The buffer exists while gathering too (a prefetch, a stages-1/2 refresh).
                base = (
                    unit.storage.gathered_params.data_ptr() if unit.storage.state is not StorageState.SHARDED else None
                )
                for entry, offset in entries:
                    param = entry.param
                    if (
                        entry.registry.get(entry.name) is not param
                        or param.dtype is not dtype
                        or param.shape != entry.shape
                        or (entry.dtensor and param._cdata != entry.tensor_id)
                        or (base is not None and _moved(entry, base + offset))
                    ):
                        self._refuse(entry)

    @staticmethod
    def _refuse(entry: Registration) -> None:
        param = entry.param
        if entry.registry.get(entry.name) is not param:
            raise ModelChangedError(
                f"The parameter '{entry.fqn}' was replaced after ZeRO sharded the model, so the engine "
                f"would keep training the old one. {_ADVICE}"
            )
        if entry.dtensor and param._cdata != entry.tensor_id:
            raise ModelChangedError(
                f"The tensor-parallel parameter '{entry.fqn}' was converted after sharding (model.to(), .float(), "
                "or another conversion, which gives a DTensor parameter a new tensor), so the engine's gradient "
                f"hooks no longer see it. {_ADVICE}"
            )
        if param.dtype != entry.unit.precision.compute_dtype or param.shape != entry.shape:
            raise ModelChangedError(
                f"'{entry.fqn}' was cast or reshaped after sharding "
                f"(now {param.dtype}, {tuple(param.shape)}). {_ADVICE}"
            )
        raise ModelChangedError(
            f"The data of '{entry.fqn}' was replaced after sharding (param.data = ..., or a move to "
            f"another device), so the engine would no longer see its updates. {_ADVICE}"
        )
