"""``offload_activations``: what each unit's forward saves for backward waits in host memory (the paper's
P_a+cpu; with ``partition_activations`` a checkpointed block's inputs are split first, in
partitioned_activations.py, and only this rank's slices go to the host).

Each unit's forward runs under saved-tensor hooks (torch's ``save_on_cpu``, less what must not move): a
tensor autograd saves is copied into pinned host memory when it is saved and copied back to the device when
backward needs it. Parameters are not copied: autograd saves views of a unit's gathered parameters, which
stage 3 gathers again for backward anyway. The hooks are entered by the outermost unit forward running (the
root's, or a unit called directly) and left by its forward hook, which also runs when the forward raised
(``always_call``), so a failed forward never leaves them active for code outside the model. Units inside run
under that one context, so an activation checkpoint around a block (``torch.utils.checkpoint``) pushes its own
hooks above it and keeps checkpointing the block; its recompute in backward gets no context of ours. On a CPU
device the hooks run and keep every tensor as it is: nothing moves. With tensor parallelism what autograd saves
inside the split layers is DTensors: their local tensors go to the host, and come back as DTensors with the
same mesh, placements, shape and strides.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..unit import FlatUnit
from .hooks import eager
from .state import inside_autograd


class SavedOnHost(saved_tensors_hooks):
    """Saved tensors of the device copied to pinned host memory, back to the device when unpacked; the
    tensors ``keep`` names (a unit's parameters) and host tensors are kept as they are."""

    def __init__(self, keep: Any) -> None:
        def pack(tensor: torch.Tensor) -> Any:
            if not self.moves(tensor) or keep(tensor):
                return tensor
            if isinstance(tensor, DTensor):
                with torch.no_grad():
                    local = tensor.to_local()
                return _DTensorOnHost(tensor, local.device, self.to_host(local))
            return tensor.device, self.to_host(tensor)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            if isinstance(packed, _DTensorOnHost):
                return packed.back()
            device, on_host = packed
            return on_host.to(device, non_blocking=True)

        super().__init__(pack, unpack)

    @staticmethod
    def moves(tensor: torch.Tensor) -> bool:
        return tensor.device.type != "cpu" and tensor.layout == torch.strided

    @staticmethod
    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        on_host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
        return on_host.copy_(tensor)  # strides are not kept: what autograd gets back is contiguous


class _DTensorOnHost:
    """A DTensor's local tensor in host memory, with what makes it that DTensor again."""

    def __init__(self, tensor: DTensor, device: torch.device, on_host: torch.Tensor) -> None:
        self.mesh, self.placements = tensor.device_mesh, tensor.placements
        self.shape, self.stride = tensor.shape, tensor.stride()
        self.device, self.on_host = device, on_host

    def back(self) -> DTensor:
        local = self.on_host.to(self.device, non_blocking=True)
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


class ActivationOffload:
    def __init__(self, units: list[FlatUnit]):
        self.units = units
        self._open: tuple[nn.Module, SavedOnHost] | None = None  # the outermost unit forward running, its context

    def install(self) -> list[RemovableHandle]:
        handles = []
        for unit in self.units:
            module: nn.Module = unit.module
            handles.append(module.register_forward_pre_hook(eager(self._enter)))
            handles.append(module.register_forward_hook(eager(self._leave), always_call=True))
        return handles

    def _is_parameter(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, DTensor):
            with torch.no_grad():
                tensor = tensor.to_local()
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            return False  # a wrapper without storage (an async collective's result): an activation
        storage = tensor.untyped_storage().data_ptr()
        return any(storage == unit.storage.gathered_params.untyped_storage().data_ptr() for unit in self.units)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if self._open is not None or inside_autograd():
            return  # inside the outermost unit's context already, or a checkpoint's recompute in backward
        context = SavedOnHost(self._is_parameter)
        context.__enter__()
        self._open = (module, context)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._open is not None and self._open[0] is module:  # only the forward that entered it leaves it
            self._open[1].__exit__(None, None, None)
            self._open = None
