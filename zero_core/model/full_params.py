"""Full parameters on demand: inspection and editing, full state dicts, and
handing the model back unsharded. All gather from the fp32 master shards, so
values are exact in every precision."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..collectives import meeting
from ..unit import FlatUnit, StorageState
from ..unit.dtensor_params import global_value, local_values, point_at
from .pass_control import PassControl


def units_of(units: list[FlatUnit], module: nn.Module | None) -> list[FlatUnit]:
    """The units holding parameters of ``module`` (every unit for None)."""
    if module is None:
        return units
    wanted = {id(p) for p in module.parameters()}
    return [u for u in units if any(id(p) in wanted for p in u.params)]


def of_units(operation: str, units: list[FlatUnit]) -> str:
    """``operation`` with the units it gathers: ranks gathering other units are in another operation."""
    names = ", ".join(unit.label for unit in units[:3]) + (f" and {len(units) - 3} more" if len(units) > 3 else "")
    return f"{operation} of {names}"


@contextlib.contextmanager
def gathered_parameters(units: list[FlatUnit], runtime: PassControl, writeback: bool) -> Iterator[None]:
    """Inside, the parameters of ``units`` are views of full fp32 master values (every rank enters)."""
    with meeting(of_units("gathered_parameters()", units)):
        runtime.quiesce()  # the parameters' data is swapped below: no all-gather may still write it
        fulls = [unit.storage.gather_full_master() for unit in units]
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    for unit, full in zip(units, fulls):
        unit.guard.guard(False)
        for param, view in zip(unit.params, unit.full_param_views(full)):
            saved.append((param, local_values(param)))
            point_at(param, view)
    try:
        with runtime.suspend():
            yield
    finally:
        for param, data in saved:
            point_at(param, data)
        for unit in units:
            unit.guard.guard(unit.storage.state is StorageState.SHARDED)
        if writeback:
            for unit, full in zip(units, fulls):
                unit.storage.load_full_master(full)


def full_state_dict(
    model: nn.Module, units: list[FlatUnit], sync_buffers: Callable[[], None], *, to_cpu: bool, keep: bool
) -> dict[str, torch.Tensor]:
    """Unit by unit: at most one gathered unit lives beyond the result itself. Every rank gathers (after
    ``sync_buffers``: exports hold rank 0's buffers); only with ``keep`` does this one build the result."""
    full_values: dict[int, torch.Tensor] = {}
    with meeting("full_state_dict()"):
        sync_buffers()
        for unit in units:
            full = unit.storage.gather_full_master()
            for param, view in zip(unit.params, unit.full_param_views(full)):
                # Tensor parallelism: the whole parameter from every tensor-parallel rank's piece; each
                # of them takes part in that gather, kept or not.
                value = global_value(param, view)
                if keep:
                    full_values[id(param)] = value.to("cpu", copy=True) if to_cpu else value.clone()
            del full
    if not keep:
        return {}
    result = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in full_values:
            result[key] = full_values[id(value)]
        else:
            tensor = value.detach()
            result[key] = tensor.to("cpu", copy=True) if to_cpu else tensor.clone()
    return result


def unshard(units: list[FlatUnit]) -> None:
    """Every parameter becomes an ordinary fp32 tensor of its own again (after the hooks are gone)."""
    with meeting("unshard()"):
        _unshard(units)


def _unshard(units: list[FlatUnit]) -> None:
    for unit in units:
        unit.guard.stop_guarding()
        full = unit.storage.gather_full_master()
        for param, view in zip(unit.params, unit.full_param_views(full)):
            point_at(param, view.clone())
            param.grad = None
        unit.storage.reshard()
