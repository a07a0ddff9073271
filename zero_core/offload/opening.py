"""This rank's file tiers, opened before the units are built: the scratch directory sized from the offload
plan, the engine's one I/O pool over it, the parameter shards' files and the optimizer state's files in it."""

from __future__ import annotations

from typing import NamedTuple

from ..collectives import CommContext
from ..offload_plan import OffloadPlan, OffloadTier, UnitOffload
from .scratch import ScratchDirectory
from .shard_files import ShardFiles
from .state_files import StateFiles
from .tier import IOPool
from .unit_file import MASTER_DTYPE

ADAM_STATE_BYTES = 2 * 4  # the moments the directory is sized for: two fp32 per element, Adam's


class OffloadFiles(NamedTuple):
    """The file tiers of this rank (units join both as they are built); all None without any."""

    pool: IOPool | None = None  # the one I/O pool, over the scratch directory
    params: ShardFiles | None = None  # offload_params="nvme"
    optimizer: StateFiles | None = None  # offload_optimizer="nvme"


def scratch_bytes(where: list[UnitOffload], shards: list[int], compute_bytes: int) -> tuple[int, int]:
    """What this rank's files take (each unit's per-element state, Adam's two fp32 moments, and its fp32 master
    where it rests in the unit's file; each parameter shard in a file), and what a checkpoint load stages beside
    them (each unit's loaded moments and fp32 master, the master even where it stays in memory; the parameter
    shards' files are rewritten in place). ``where``: each unit's plan; ``shards``: its shard's elements."""
    master_bytes = MASTER_DTYPE.itemsize
    needed = load = 0
    for unit, shard in zip(where, shards):
        if unit.state_in_file:
            needed += (ADAM_STATE_BYTES + master_bytes * unit.master_in_file) * shard
            load += (ADAM_STATE_BYTES + master_bytes) * shard
        if unit.param_shard_in_file:
            needed += compute_bytes * shard
    return needed, load


def open_offload_files(
    plan: OffloadPlan,
    where: list[UnitOffload],
    shards: list[int],
    compute_bytes: int,
    offload_dir: str | None,
    comm: CommContext,
) -> OffloadFiles:
    """The file tiers the plan chose (a tier is opened even where no unit rests in it): the scratch directory
    checked on every rank for room for what the units put there (``where``, per unit: :func:`scratch_bytes`),
    and told what a checkpoint load stages beside it."""
    if not plan.uses_files:
        return OffloadFiles()
    params_in_files, state_in_files = plan.params is OffloadTier.NVME, plan.optimizer is OffloadTier.NVME
    needed, load = scratch_bytes(where, shards, compute_bytes)
    scratch = ScratchDirectory(offload_dir, comm, needed, load)
    pool = IOPool(scratch, tiers=params_in_files + state_in_files)
    units_in_memory = plan.units_in_memory
    params = ShardFiles(scratch.path, units_in_memory, pool) if params_in_files else None
    optimizer = StateFiles(len(where), comm, scratch.path, pool, units_in_memory) if state_in_files else None
    return OffloadFiles(pool, params, optimizer)
