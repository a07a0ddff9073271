"""Which module subtrees become units: the policy, and the forms users write it in (a class, classes, or
Accelerate's class names looked up in the model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class WrapPolicy:
    """Which module subtrees become units (flattened, gathered, reduced together).

    ``module_classes``: every module of these classes becomes a unit (the
    transformer-block policy). Without classes, units are chosen by size: a
    module whose not-yet-claimed parameters reach ``min_unit_numel`` (default:
    the bucket size) becomes a unit. Whatever no unit claims belongs to the
    root unit, the whole model.
    """

    module_classes: tuple[type[nn.Module], ...] = ()
    min_unit_numel: int | None = None

    def __post_init__(self) -> None:
        classes = self.module_classes
        if not isinstance(classes, tuple) or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise ValueError(
                "WrapPolicy.module_classes must be a tuple of nn.Module subclasses, for example (MyTransformerBlock,)."
            )
        if self.min_unit_numel is not None and self.min_unit_numel < 1:
            raise ValueError("WrapPolicy.min_unit_numel must be a positive number of parameters.")


WrapPolicyLike = WrapPolicy | type[nn.Module] | set | tuple | list | None


def as_wrap_policy(policy: WrapPolicyLike) -> WrapPolicy:
    """Accept what users write: a policy, one block class, or a collection of them."""
    if policy is None:
        return WrapPolicy()
    if isinstance(policy, WrapPolicy):
        return policy
    if isinstance(policy, type):
        return WrapPolicy(module_classes=(policy,))
    if callable(policy):
        return _of_fsdp_policy(policy)
    return WrapPolicy(module_classes=tuple(policy))


def _of_fsdp_policy(policy: Callable) -> WrapPolicy:
    """FSDP's ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``, which a
    user moving from FSDP passes as it is: its classes. Any other callable decides per module, which a
    unit policy of classes cannot follow, so it is refused with what to pass instead."""
    classes = getattr(policy, "keywords", {}).get("transformer_layer_cls")
    if getattr(getattr(policy, "func", None), "__name__", "") == "transformer_auto_wrap_policy" and classes:
        return WrapPolicy(module_classes=tuple(classes))
    raise ValueError(
        f"wrap_policy={policy!r} is a callable; pass the module classes that become units instead "
        "(wrap_policy=Block or (Block, OtherBlock)); FSDP's partial(transformer_auto_wrap_policy, "
        "transformer_layer_cls={Block}) is read as its classes."
    )


def wrap_policy_of_names(names: tuple[str, ...], model: nn.Module | None) -> WrapPolicy:
    """Class names (Accelerate's ``wrap_classes``) as the classes of ``model`` that bear them;
    without a model yet (checking a plugin), the default policy."""
    if not names or model is None:
        return WrapPolicy()
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    missing = [name for name in names if name not in by_name]
    if missing:
        raise ValueError(f"wrap_classes: the model has no module class named {missing}; it has {sorted(by_name)[:20]}.")
    return WrapPolicy(module_classes=tuple(by_name[name] for name in names))
