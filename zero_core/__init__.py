"""ZeRO stages 1-3 for PyTorch: the framework-free core of lightning-zero.

Imports neither Lightning nor Accelerate; both adapters build on it, through
the names below and four public submodules only: ``zero_core.checkpoint``
(sharded checkpoints, consolidation), ``zero_core.sharding`` (sharding a
module once, for adapters asked to set it up again), ``zero_core.settings``
(the settings schema the adapters are generated from) and
``zero_core.deepspeed`` (a DeepSpeed config read as settings). Every other submodule
is internal and may change shape.
"""

from .checkpoint.checkpoint_error import CheckpointError
from .collectives import CollectiveFailed, CollectiveKind, CommStats, RanksDivergedError, meeting
from .config import MixedPrecision, WrapPolicy, ZeroConfig, user_settings
from .engine import ZeroEngine, engine_of, engine_owning
from .memory.estimate import ZeroEstimate, estimate
from .memory.fit import FitResult, fit
from .memory.memory_reports import MemoryReport, UnitReport
from .memory.predicted import expected_model_state_bytes
from .memory_budget import MemoryBudget
from .mesh import tensor_parallel_mesh
from .model.changes import ModelChangedError
from .muon_with_adamw import MuonWithAuxAdamW
from .offload import OffloadError
from .optim.grad_ops import total_norm
from .passes.runtime import LateGradientError, UnscaledBackwardError
from .passes.state import TrainingState
from .settings import Setting
from .setup_summary import setup_summary
from .unit import ParameterAtRestError

__all__ = [
    "CheckpointError",
    "CollectiveFailed",
    "CollectiveKind",
    "CommStats",
    "FitResult",
    "LateGradientError",
    "MemoryBudget",
    "MemoryReport",
    "MixedPrecision",
    "ModelChangedError",
    "MuonWithAuxAdamW",
    "OffloadError",
    "ParameterAtRestError",
    "RanksDivergedError",
    "Setting",
    "TrainingState",
    "UnitReport",
    "UnscaledBackwardError",
    "WrapPolicy",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroEstimate",
    "engine_of",
    "engine_owning",
    "estimate",
    "expected_model_state_bytes",
    "fit",
    "meeting",
    "setup_summary",
    "tensor_parallel_mesh",
    "total_norm",
    "user_settings",
]
