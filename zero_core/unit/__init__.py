"""One unit: a module subtree's parameters flattened, sharded and guarded. It knows nothing of the
step or the engine (arrows point one way: the pass drives units, never the reverse)."""

from .flat_unit import FlatUnit, MasterPiece
from .grads import PendingReduce
from .guard import ParameterAtRestError, ParameterDigests
from .layout import FlatLayout, ParamSlot, ShardPiece
from .storage import StorageState
from .unit_selection import UnitPlan, check_wrap_classes_present, parameter_name, plan_units

__all__ = [
    "FlatLayout",
    "FlatUnit",
    "MasterPiece",
    "ParamSlot",
    "ParameterAtRestError",
    "ParameterDigests",
    "PendingReduce",
    "ShardPiece",
    "StorageState",
    "UnitPlan",
    "check_wrap_classes_present",
    "parameter_name",
    "plan_units",
]
