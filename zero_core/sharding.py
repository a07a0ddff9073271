"""Sharding a module once, for adapters that may be asked to set it up again
(Lightning's fit then test, a second Trainer, a second ``prepare``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from .config import ZeroConfig
from .engine import ZeroEngine, engine_of
from .mesh import OPTIMIZER_BEFORE_SPLIT


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)``, leaving meta tensors for the engine to materialise."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        if not tensor.is_meta and tensor.device != device:
            tensor.data = tensor.data.to(device)


def shard_module(
    module: nn.Module,
    optimizer: Optimizer | None,
    config: ZeroConfig,
    device: torch.device,
    device_mesh: DeviceMesh | None = None,
) -> ZeroEngine:
    """The module's engine: reused if it was sharded alike before, rebuilt if
    it was sharded with other settings, created otherwise."""
    engine = engine_of(module)
    if engine is not None and engine.requested_config != config:  # as asked: memory_budget's choice is its own
        engine.unshard()
        engine = None
    if engine is None:
        move_real_tensors(module, device)
        return ZeroEngine(module, optimizer, config, device=device, device_mesh=device_mesh)
    if optimizer is not None and optimizer is not engine.optimizer:
        engine.attach_optimizer(optimizer)
    return engine


def single_optimizer(optimizers: list[Optimizer]) -> Optimizer | None:
    if len(optimizers) > 1:
        kinds = ", ".join(type(optimizer).__name__ for optimizer in optimizers)
        raise ValueError(
            f"ZeRO shards one optimizer per model; got {len(optimizers)} ({kinds}). Put the parameters in param "
            "groups of a single optimizer instead (Muon for the matrices with AdamW for the rest: "
            "zero_core.MuonWithAuxAdamW, its groups marked use_muon=True or False)."
        )
    return optimizers[0] if optimizers else None


def refuse_optimizer_before_split(optimizer: Optimizer | None) -> None:
    """For adapters that split the model themselves (Fabric's parallelize_fn): an optimizer handed over with
    the unsplit model holds the parameters the split replaces; refused in the words the engine uses."""
    if optimizer is not None:
        raise ValueError(OPTIMIZER_BEFORE_SPLIT)
