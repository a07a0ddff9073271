"""What the Trainer and Fabric strategies share: turning user arguments into the core's config."""

from __future__ import annotations

from torch import nn

from zero_core import WrapPolicy

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
