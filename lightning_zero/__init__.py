"""ZeRO stages 1-3 for Lightning: ``import lightning_zero`` registers the
strategies "zero1", "zero2" and "zero3" for the Trainer and for Fabric."""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from zero_core import MixedPrecision, WrapPolicy, ZeroConfig

from .checkpoints import consolidated
from .fabric import ZeroFabricPrecision, ZeroFabricStrategy
from .grad_norm import grad_norm
from .precision_plugins import ZeroPrecision
from .strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)
ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "MixedPrecision",
    "WrapPolicy",
    "ZeroConfig",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "consolidated",
    "grad_norm",
]
