"""ZeRO stages 1-3 for Lightning: ``import lightning_zero`` registers the
strategies "zero1", "zero2" and "zero3" for the Trainer and for Fabric."""

from lightning.pytorch.strategies import StrategyRegistry

from zero_core import MixedPrecision, WrapPolicy, ZeroConfig

from .precision import ZeroPrecision
from .strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["MixedPrecision", "WrapPolicy", "ZeroConfig", "ZeroPrecision", "ZeroStrategy"]
