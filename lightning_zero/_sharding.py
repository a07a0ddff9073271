"""What the Trainer and Fabric strategies share: turning user arguments into
the core's config and sharding a module (once) with the ZeRO engine."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from zero_core import WrapPolicy, ZeroConfig, ZeroEngine
from zero_core.engine import engine_of

WrapPolicyLike = WrapPolicy | type[nn.Module] | set | tuple | list | None


def as_wrap_policy(policy: WrapPolicyLike) -> WrapPolicy:
    """Accept what users write: a policy, one block class, or a collection of them."""
    if policy is None:
        return WrapPolicy()
    if isinstance(policy, WrapPolicy):
        return policy
    if isinstance(policy, type):
        return WrapPolicy(module_classes=(policy,))
    return WrapPolicy(module_classes=tuple(policy))


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)``, leaving meta tensors for the engine to materialise."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        if not tensor.is_meta and tensor.device != device:
            tensor.data = tensor.data.to(device)


def shard_module(
    module: nn.Module, optimizer: Optimizer | None, config: ZeroConfig, device: torch.device
) -> ZeroEngine:
    """The module's engine: reused if it was sharded alike before (fit, then test),
    rebuilt if it was sharded with other settings (another Trainer)."""
    engine = engine_of(module)
    if engine is not None and engine.config != config:
        engine.unshard()
        engine = None
    if engine is None:
        move_real_tensors(module, device)
        return ZeroEngine(module, optimizer, config, device=device)
    if optimizer is not None and optimizer is not engine.optimizer:
        engine.attach_optimizer(optimizer)
    return engine


def single_optimizer(optimizers: list[Optimizer]) -> Optimizer | None:
    if len(optimizers) > 1:
        raise ValueError(
            f"The ZeRO strategies support one optimizer; got {len(optimizers)}. "
            "Put the parameters in param groups of a single optimizer instead."
        )
    return optimizers[0] if optimizers else None
