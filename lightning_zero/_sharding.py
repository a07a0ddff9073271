"""What the Trainer and Fabric strategies share: their arguments turned into the
core's config, the precision plugin they coerce to, building the engine,
teardown, and registration."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from zero_core import WrapPolicy, ZeroConfig, ZeroEngine
from zero_core.sharding import shard_module

from .precision import ZeroPrecisionSettings

PrecisionT = TypeVar("PrecisionT", bound=ZeroPrecisionSettings)

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


def zero_settings(
    stage: int,
    wrap_policy: WrapPolicyLike,
    bucket_size_mb: float,
    prefetch: int | str,
    prefetch_cap_mb: float,
    broadcast_buffers: bool,
    overlap_param_refresh: bool,
    shard_group_size: int | None,
    persistence_threshold: int,
) -> ZeroConfig:
    """The Trainer's and Fabric's strategy arguments as the core's config, validated when the
    strategy is built, before Lightning launches any process."""
    return ZeroConfig(
        stage=stage,
        wrap_policy=as_wrap_policy(wrap_policy),
        bucket_size_mb=bucket_size_mb,
        prefetch=prefetch,
        prefetch_cap_mb=prefetch_cap_mb,
        broadcast_buffers=broadcast_buffers,
        overlap_param_refresh=overlap_param_refresh,
        shard_group_size=shard_group_size,
        persistence_threshold=persistence_threshold,
    )


def register_zero_strategies(strategy_class: type, registry: Any) -> None:
    for stage in (1, 2, 3):
        registry.register(
            f"zero{stage}",
            strategy_class,
            description=f"ZeRO stage {stage} (lightning-zero)",
            stage=stage,
            override=True,
        )


def as_zero_precision(plugin: Any, precision_class: type[PrecisionT]) -> PrecisionT | None:
    """Lightning hands every strategy its generic plugin for the precision flag;
    ZeRO owns the precision, so keep only the flag."""
    if plugin is None or isinstance(plugin, precision_class):
        return plugin
    return precision_class(getattr(plugin, "precision", "32-true"))


def build_engine(
    module: nn.Module,
    optimizer: Optimizer | None,
    config: ZeroConfig,
    precision: ZeroPrecisionSettings,
    device: torch.device,
) -> ZeroEngine:
    """Shard ``module`` in the precision's dtypes and hand the engine to the precision plugin."""
    engine = shard_module(module, optimizer, replace(config, mixed_precision=precision.policy), device)
    precision.engine = engine
    return engine


def teardown_keeping_module(strategy: Any, precision: Any) -> None:
    """DDP's teardown without moving the module: its parameters are views of the
    engine's buffers (``engine.unshard()`` gives an ordinary module back)."""
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.teardown()
    precision.teardown()
    if strategy.accelerator is not None:
        strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()


def check_sync_batchnorm_device(device: torch.device) -> None:
    """torch's SyncBatchNorm trains on accelerators only; say so before training starts."""
    if device.type == "cpu":
        raise ValueError(
            "Trainer(sync_batchnorm=True) needs GPUs: torch's SyncBatchNorm trains only on CUDA, XPU or HPU "
            "devices. On CPU leave it off; ZeRO broadcasts rank 0's BatchNorm statistics before each "
            "training forward, as DDP does (broadcast_buffers=True)."
        )


def refuse_late_sync_batchnorm(module: nn.Module) -> None:
    """sync_batchnorm asked for on a module an earlier fit sharded without it: converting
    now would replace sharded layers."""
    if any(type(m) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) for m in module.modules()):
        raise ValueError(
            "Trainer(sync_batchnorm=True) on a module an earlier fit sharded without it: its BatchNorm layers "
            "cannot be converted once sharded. Use the same sync_batchnorm setting for every fit of a module, "
            "or call lightning_zero's engine.unshard() (zero_core.engine_of(module).unshard()) first."
        )
