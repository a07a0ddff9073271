"""ZeRO stages 1-3 for PyTorch: the framework-free core of lightning-zero.

Imports neither Lightning nor Accelerate; both adapters build on it, through
the names below and two public submodules only: ``zero_core.checkpoint``
(sharded checkpoints, consolidation) and ``zero_core.sharding`` (sharding a
module once, for adapters asked to set it up again). Every other submodule is
internal and may change shape.
"""

from .accounting import MemoryReport, UnitReport, expected_model_state_bytes
from .checkpoint.errors import CheckpointError
from .collectives import CollectiveFailed, CollectiveKind, CommStats
from .config import MixedPrecision, WrapPolicy, ZeroConfig
from .engine import ZeroEngine, engine_of, engine_owning
from .grad_ops import total_norm
from .model_changes import ModelChangedError
from .param_guard import ParameterAtRestError
from .runtime import TrainingState, UnscaledBackwardError

__all__ = [
    "CheckpointError",
    "CollectiveFailed",
    "CollectiveKind",
    "CommStats",
    "MemoryReport",
    "MixedPrecision",
    "ModelChangedError",
    "ParameterAtRestError",
    "TrainingState",
    "WrapPolicy",
    "UnitReport",
    "UnscaledBackwardError",
    "ZeroConfig",
    "ZeroEngine",
    "engine_of",
    "engine_owning",
    "expected_model_state_bytes",
    "total_norm",
]
