"""The model's buffers (their dtype under mixed precision, rank 0's values everywhere) and its inputs' dtype."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from .. import collectives
from ..collectives import CommContext
from ..config import MixedPrecision
from ..pass_listeners import PassListener
from .pass_control import PassControl


def cast_buffers(model: nn.Module, precision: MixedPrecision) -> None:
    """Buffers keep the dtype the model gave them, except where a module's own
    parameters are cast: BatchNorm's running statistics must match its weight.
    ``MixedPrecision.buffer_dtype`` casts every floating buffer instead.
    Each buffer is cast once, in place, so shared buffers stay shared."""
    targets: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
    for module in model.modules():
        owns_cast_params = any(
            p.is_floating_point() and p.dtype == precision.compute_dtype for p in module.parameters(recurse=False)
        )
        target = precision.buffer_dtype or (precision.compute_dtype if owns_cast_params else None)
        for buffer in module.buffers(recurse=False):
            if target is not None and buffer.is_floating_point() and id(buffer) not in targets:
                targets[id(buffer)] = (buffer, target)
    for buffer, target in targets.values():
        if buffer.dtype != target:
            buffer.data = buffer.data.to(target)


def broadcast_buffers(model: nn.Module, comm: CommContext) -> None:
    """Rank 0's buffers everywhere, as DDP's broadcast_buffers does: one broadcast per
    dtype of a flat copy (a BatchNorm model has three buffers per layer; a call each
    cost more than the bytes)."""
    if comm.world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in model.buffers():
        if buffer.numel():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
    flats = {dtype: torch.cat([b.detach().reshape(-1) for b in buffers]) for dtype, buffers in by_dtype.items()}
    handles = [collectives.broadcast(comm, flat, label="buffers") for flat in flats.values()]
    for handle in handles:
        handle.wait()
    for dtype, buffers in by_dtype.items():
        for buffer, value in zip(buffers, flats[dtype].split([b.numel() for b in buffers])):
            buffer.detach().copy_(value.view_as(buffer))


class BufferSync(PassListener):
    """DDP's ``broadcast_buffers`` rule: rank 0's buffers before a training forward, and in exports.

    The next forward broadcasts only if the last one was a synchronising training forward (grad
    enabled, not inside ``no_sync``), as DDP does; the first forward always does.
    """

    def __init__(self, model: nn.Module, comm: CommContext, enabled: bool, runtime: PassControl):
        self.model, self.comm, self.enabled = model, comm, enabled
        self.runtime = runtime  # whether this forward's backward synchronises the gradients
        self._sync_next_forward = True

    def before_root_forward(self) -> None:
        if self.enabled and self._sync_next_forward:
            broadcast_buffers(self.model, self.comm)

    def after_root_forward(self) -> None:
        self._sync_next_forward = torch.is_grad_enabled() and self.runtime.require_grad_sync

    def for_export(self) -> None:
        """Exports hold rank 0's buffers, which the next forward would broadcast anyway."""
        if self.enabled:
            broadcast_buffers(self.model, self.comm)


def floating_inputs_cast(dtype: torch.dtype) -> Callable[[tuple, dict], tuple[tuple, dict]] | None:
    """Floating inputs of every unit arrive in the compute dtype (as FSDP2's cast_forward_inputs); None in
    fp32, which casts nothing."""
    if dtype == torch.float32:
        return None

    def cast_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
        return pytree.tree_map(cast, (args, kwargs))

    return cast_inputs
