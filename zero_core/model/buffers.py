"""The model's buffers: their dtype under mixed precision, and rank 0's values everywhere."""

from __future__ import annotations

import torch
from torch import nn

from .. import collectives
from ..collectives import CommContext
from ..config import MixedPrecision


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
