"""An NVMe load's DCP reads: a checkpoint read into the optimizer state's files one unit at a time
(``offload/nvme_load.py``; the save's side is ``offload/nvme_save.py``).

Each unit of the tier is read on its own (DCP's load of just its keys: its parameters, its optimizer state),
into about one unit's memory, and written beside its file at once;
the checkpoint's other keys are read the usual way. Scalar state (Adam's ``step``) stays in memory. Before
anything is read, every rank's offload_dir must hold what the load stages there (:func:`check_staging_room`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..offload.nvme_load import NvmeLoad, StagingRoom, room_problem
from ..unit import FlatUnit, MasterPiece
from .agreed_steps import RankAgreement
from .checkpoint_error import CheckpointError
from .checkpoint_records import MODEL_KEY, OPTIMIZER_KEY, ShardedModel
from .chunks import ShardedChunks
from .directory import read_shards
from .state_dicts import (
    LoadedNumber,
    is_per_element,
    optimizer_load_targets,
    saved_optimizer_state,
    sharded_model_state_dict,
    with_loaded_numbers,
)

Install = tuple[MasterPiece, str, torch.Tensor]


def is_staged(staging: NvmeLoad | None, unit: FlatUnit) -> bool:
    """The unit (its master and its state) is loaded apart, into the tier's files (else with the checkpoint's
    other keys)."""
    return staging is not None and staging.takes(unit)


def check_staging_room(
    agreement: RankAgreement,
    view: ShardedModel,
    metadata: Metadata,
    load_model: bool,
    load_optimizer: bool,
    staging: NvmeLoad,
) -> None:
    """The same CheckpointError on every rank, before anything is read, unless every rank's offload_dir has room
    for the files this load stages beside the tier's (each unit's loaded state, as the checkpoint holds it, and
    its master): without it, a load would fail part-way on a full disk."""

    def measure() -> StagingRoom:
        dtypes = _loaded_state_dtypes(view, metadata, staging) if load_optimizer else None
        return staging.room(load_model, dtypes)

    _, rooms = agreement.run("measuring offload_dir's room for the load", measure, share=True)
    problem = room_problem(rooms)  # every rank's figures alike: the same verdict everywhere
    if problem is not None:
        raise CheckpointError(
            f"{problem} ({agreement.operation} refused before reading the shards; nothing was changed)."
        )


def _loaded_state_dtypes(view: ShardedModel, metadata: Metadata, staging: NvmeLoad) -> dict[int, list[torch.dtype]]:
    """Per unit of the tier: the dtypes of the per-element state keys its flat buffers take from the checkpoint."""
    saved = saved_optimizer_state(metadata, OPTIMIZER_KEY)
    dtypes: dict[int, list[torch.dtype]] = {}
    for unit in view.units:
        if not is_staged(staging, unit):
            continue
        by_key: dict[str, torch.dtype] = {}
        for master in unit.master_pieces:
            slot = master.piece.slot
            for key, entry in saved.get(slot.fqns[0], []):
                if is_per_element(slot, key, entry):
                    by_key.setdefault(key, entry.properties.dtype)
        dtypes[unit.index] = list(by_key.values())
    return dtypes


def read_staged_units(
    view: ShardedModel, checkpoint: Any, load_model: bool, load_optimizer: bool, staging: NvmeLoad
) -> list[Install]:
    """Every unit of the tier read and staged, one after the other; returns the scalar state to install."""
    scalars: list[Install] = []
    for unit in view.units:
        if not is_staged(staging, unit):
            continue
        state: dict[str, Any] = {}
        master = None
        if load_model:
            master = staging.current_master(unit)
            state[MODEL_KEY] = sharded_model_state_dict(
                view.model, view.units, view.rank, [master if u is unit else None for u in view.units]
            )
            # The other units are left out: what is left of the model's keys but this unit's are buffers.
            state[MODEL_KEY] = {k: v for k, v in state[MODEL_KEY].items() if isinstance(v, ShardedChunks)}
        flat: dict[str, torch.Tensor] | None = None
        pieces: list[tuple[MasterPiece, str]] = []
        installs: list[Install] = []
        numbers: list = []
        if load_optimizer:
            assert view.optimizer is not None
            flat = {}
            targets, installs = optimizer_load_targets(
                view.optimizer, [unit], checkpoint.metadata, OPTIMIZER_KEY, _into_flat(unit, flat)
            )
            state[OPTIMIZER_KEY] = {"state": targets["state"]}
            for piece, key, tensor in installs:  # per-element state lands in the flat buffers; scalars stay apart
                if isinstance(tensor, LoadedNumber):
                    numbers.append((piece, key, tensor))
                elif key in flat and tensor.untyped_storage() is flat[key].untyped_storage():
                    pieces.append((piece, key))
                else:
                    scalars.append((piece, key, tensor))
        if not state:
            continue
        read_shards(checkpoint.directory, checkpoint.metadata, checkpoint.manifest, state)
        if numbers:
            scalars += with_loaded_numbers(view.optimizer, state[OPTIMIZER_KEY], numbers)
        staging.write(unit, master, flat, pieces)
        del state, master, flat, installs
        # DCP's load leaves the unit's targets in reference cycles: freed now, not when the collector next runs
        # (until then every unit read so far would stay in memory).
        gc.collect()
    return scalars


def _into_flat(
    unit: FlatUnit, flat: dict[str, torch.Tensor]
) -> Callable[[MasterPiece, str, torch.dtype], torch.Tensor]:
    """Where a piece's per-element state is loaded: its place in one flat buffer per key, laid out like the unit's
    master shard (as the tier keeps it)."""
    numel = unit.storage.resting_master.numel()

    def place(master: MasterPiece, key: str, dtype: torch.dtype) -> torch.Tensor:
        buffer = flat.setdefault(key, torch.zeros(numel, dtype=dtype))
        return buffer[master.piece.shard_start : master.piece.shard_start + master.piece.numel]

    return place
