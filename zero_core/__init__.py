"""ZeRO stages 1-3 for PyTorch: the framework-free core of lightning-zero.

Imports neither Lightning nor Accelerate; both adapters build on it.
"""

from .accounting import MemoryReport, expected_model_state_bytes
from .checkpoint.errors import CheckpointError
from .collectives import CollectiveFailed, CollectiveKind, CommStats
from .config import MixedPrecision, WrapPolicy, ZeroConfig, user_settings
from .engine import ZeroEngine, engine_of
from .model.changes import ModelChangedError
from .settings import Setting
from .step.errors import UnscaledBackwardError
from .unit import ParameterAtRestError

__all__ = [
    "CheckpointError",
    "CollectiveFailed",
    "CollectiveKind",
    "CommStats",
    "MemoryReport",
    "MixedPrecision",
    "ModelChangedError",
    "ParameterAtRestError",
    "Setting",
    "WrapPolicy",
    "UnscaledBackwardError",
    "ZeroConfig",
    "ZeroEngine",
    "engine_of",
    "expected_model_state_bytes",
    "user_settings",
]
