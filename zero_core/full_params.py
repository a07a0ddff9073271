"""Full parameters on demand: inspection and editing, full state dicts, and
handing the model back unsharded. All gather from the fp32 master shards, so
values are exact in every precision."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from .unit import FlatUnit, StorageState

if TYPE_CHECKING:
    from .engine import ZeroEngine


def _units_of(engine: "ZeroEngine", module: nn.Module | None) -> list[FlatUnit]:
    if module is None:
        return engine.units
    wanted = {id(p) for p in module.parameters()}
    return [u for u in engine.units if any(id(p) in wanted for p in u.params)]


@contextlib.contextmanager
def gathered_parameters(engine: "ZeroEngine", module: nn.Module | None, writeback: bool) -> Iterator[None]:
    units = _units_of(engine, module)
    engine.runtime.quiesce()  # the parameters' data is swapped below: no all-gather may still write it
    fulls = [unit.gather_full_master() for unit in units]
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    for unit, full in zip(units, fulls):
        unit.set_guard(False)
        for param, view in zip(unit.params, unit.full_param_views(full)):
            saved.append((param, param.data))
            param.data = view
    try:
        with engine.runtime.suspend():
            yield
    finally:
        for param, data in saved:
            param.data = data
        for unit in units:
            unit.set_guard(unit.state is StorageState.SHARDED)
        if writeback:
            for unit, full in zip(units, fulls):
                unit.load_full_master(full)


def full_state_dict(engine: "ZeroEngine", *, to_cpu: bool, rank0_only: bool) -> dict[str, torch.Tensor]:
    """Unit by unit: at most one gathered unit lives beyond the result itself."""
    keep = not rank0_only or engine.rank == 0
    full_values: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        full = unit.gather_full_master()
        if keep:
            for param, view in zip(unit.params, unit.full_param_views(full)):
                full_values[id(param)] = view.to("cpu", copy=True) if to_cpu else view.clone()
        del full
    if not keep:
        return {}
    result = {}
    for key, value in engine.model.state_dict(keep_vars=True).items():
        if id(value) in full_values:
            result[key] = full_values[id(value)]
        else:
            tensor = value.detach()
            result[key] = tensor.to("cpu", copy=True) if to_cpu else tensor.clone()
    return result


def unshard(engine: "ZeroEngine") -> None:
    """Every parameter becomes an ordinary fp32 tensor of its own again; hooks are removed."""
    engine.runtime.quiesce()
    engine.remove_hooks()
    for unit in engine.units:
        unit.stop_guarding()
        full = unit.gather_full_master()
        for param, view in zip(unit.params, unit.full_param_views(full)):
            param.data = view.clone()
            param.grad = None
        unit.release()
