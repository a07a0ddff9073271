"""``model.state_dict()`` and ``model.load_state_dict()`` on the sharded model.

- ``state_dict()`` (stage 3): the module's units are gathered from the fp32
  master shards, one at a time, into full CPU tensors, which the parameters'
  ``detach()`` hands to torch's own ``state_dict`` (unit/guard.py). Every
  rank must call it, as with ``engine.full_state_dict()``, whose values it
  returns. Stages 1 and 2 hold full parameters and need nothing; stage-3
  units kept gathered (``persistence_threshold``) export alike, their entries
  replaced with the gathered fp32 values after torch saved them.
  ``keep_vars=True`` returns the parameter objects themselves.
- ``load_state_dict()`` (every stage): each parameter's new full value goes
  into this rank's master and compute shards before torch copies it into
  the full parameters (stages 1/2), so the next optimizer step starts from
  the loaded values. No communication: every rank holds the full source.
  ``assign=True`` would replace the sharded parameter objects and is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..collectives import meeting
from ..hook_copies import InertWhenCopied
from ..pass_listeners import PassListener
from ..unit import FlatUnit
from ..unit.dtensor_params import as_dtensor_like, exported_copy, is_dtensor, local_piece_of
from .full_params import of_units
from .pass_control import PassControl


class StateDictHooks(PassListener):
    """``sync_buffers``: called before an export, so it holds rank 0's buffers (DDP's rule)."""

    def __init__(
        self,
        model: nn.Module,
        units: list[FlatUnit],
        runtime: PassControl,
        params_sharded_at_rest: bool,
        sync_buffers: Callable[[], None],
    ):
        self.model, self.units, self.runtime = model, units, runtime
        self.params_sharded_at_rest = params_sharded_at_rest
        self.sync_buffers = sync_buffers
        self.unit_of: dict[int, FlatUnit] = {id(p): unit for unit in units for p in unit.params}
        self._exports: dict[int, list[FlatUnit]] = {}  # id(module) -> units whose values its state_dict() gathered

    def install(self) -> list[RemovableHandle]:
        handles = []
        for module in self.model.modules():
            if any(id(p) in self.unit_of for p in module.parameters(recurse=False)):
                handles.append(module.register_load_state_dict_pre_hook(InertWhenCopied(self._before_load)))
            if self.params_sharded_at_rest and any(True for _ in module.parameters()):
                handles.append(module.register_state_dict_pre_hook(InertWhenCopied(self._before_state_dict)))
                # torch marks post-hooks with an attribute, which a bound method cannot take.
                handles.append(
                    module.register_state_dict_post_hook(
                        InertWhenCopied(functools.partial(StateDictHooks._after_state_dict, self))
                    )
                )
        return handles

    # -------------------------------------------------------------- export
    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:
            return
        if not prefix:
            self.before_outermost_forward()  # a new outermost call: nothing of an earlier, failed one survives
        wanted = {id(p) for p in module.parameters()}
        units = [u for u in self.units if u.guard.exported is None and any(id(p) in wanted for p in u.params)]
        if not units:
            return  # an enclosing module's state_dict() gathered them already
        with meeting(of_units("state_dict()", units)):  # it gathers: every rank must call it
            self.runtime.quiesce()
            self.sync_buffers()
            for unit in units:
                full = unit.storage.gather_full_master()
                exported = {
                    # A tensor-parallel parameter exports as a DTensor, as the unsharded model's state_dict() does.
                    i: exported_copy(param, view)
                    for i, (param, view) in enumerate(zip(unit.params, unit.full_param_views(full)))
                }
                unit.guard.exported = exported
                del full
        self._exports[id(module)] = units

    def _after_state_dict(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        units = self._exports.pop(id(module), [])
        # Units kept gathered (persistence_threshold) have no guard to hand out the exported
        # values: torch saved their live compute-dtype parameters, which are replaced here.
        kept_gathered = {id(p): u for u in units if not u.stage_plan.params_sharded_at_rest for p in u.params}
        if kept_gathered:
            for name, param in module.named_parameters(remove_duplicate=False):
                unit = kept_gathered.get(id(param))
                if unit is not None and prefix + name in state_dict:
                    state_dict[prefix + name] = unit.guard.exported[unit.slot_of(param)]
        for unit in units:
            unit.guard.exported = None

    def before_outermost_forward(self) -> None:
        """An export that raised midway must not outlive the next forward (nor the next export)."""
        self._exports.clear()
        for unit in self.units:
            unit.guard.exported = None

    # ---------------------------------------------------------------- load
    def _before_load(
        self,
        module: nn.Module,
        state_dict: Any,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError(
                "load_state_dict(assign=True) would replace the parameters ZeRO has sharded. "
                "Load with assign=False (the default), or use engine.load_full_state_dict()."
            )
        for name, param in module.named_parameters(recurse=False):
            value = state_dict.get(prefix + name)
            unit = self.unit_of.get(id(param))
            if unit is not None and isinstance(value, torch.Tensor):
                unit.write_param(param, value)  # a wrong shape is left to torch's own error
                if is_dtensor(param) and not is_dtensor(value) and value.shape == param.shape:
                    # Torch copies the value into the parameter next (stages 1/2), and a DTensor parameter
                    # takes a DTensor: this rank's piece of the whole value (torch's load works on a copy).
                    state_dict[prefix + name] = as_dtensor_like(param, local_piece_of(param, value))
