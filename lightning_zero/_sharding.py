"""What the Trainer and Fabric strategies share: their arguments turned into the core's config, and registration."""

from __future__ import annotations

from typing import Any

from torch import nn

from zero_core import WrapPolicy, ZeroConfig

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
    stage: int, wrap_policy: WrapPolicyLike, bucket_size_mb: float, prefetch: int, broadcast_buffers: bool
) -> ZeroConfig:
    """Validated when the strategy is built, before Lightning launches any process."""
    return ZeroConfig(
        stage=stage,
        wrap_policy=as_wrap_policy(wrap_policy),
        bucket_size_mb=bucket_size_mb,
        prefetch=prefetch,
        broadcast_buffers=broadcast_buffers,
    )


def register_zero_strategies(strategy_class: type, registry: Any) -> None:
    for stage in (1, 2, 3):
        registry.register(
            f"zero{stage}", strategy_class, description=f"ZeRO stage {stage} (lightning-zero)", stage=stage, override=True
        )
