"""Reading a checkpoint into the NVMe optimizer tier's units one at a time (``optim/nvme_staging.py``).

Each unit of the tier is read on its own (DCP's load of just its keys: its parameters, its optimizer state),
into about one unit's memory, and written beside its file at once;
the checkpoint's other keys are read the usual way. Scalar state (Adam's ``step``) stays in memory.
"""

from __future__ import annotations

from typing import Any

import torch

from ..optim.nvme_staging import StagedLoad
from ..unit import FlatUnit, MasterPiece
from .chunks import ShardedChunks
from .records import MODEL_KEY, OPTIMIZER_KEY, ShardedModel
from .state_dicts import optimizer_load_targets, sharded_model_state_dict
from .storage import read_shards

Install = tuple[MasterPiece, str, torch.Tensor]


def master_is_staged(staging: StagedLoad | None, unit: FlatUnit) -> bool:
    """The unit's master is loaded apart, with its state (else with the checkpoint's other keys)."""
    return staging is not None and staging.takes(unit)


def read_staged_units(
    view: ShardedModel, checkpoint: Any, load_model: bool, load_optimizer: bool, staging: StagedLoad
) -> list[Install]:
    """Every unit of the tier read and staged, one after the other; returns the scalar state to install."""
    scalars: list[Install] = []
    for unit in view.units:
        if not staging.takes(unit):
            continue
        state: dict[str, Any] = {}
        master = None
        if load_model and master_is_staged(staging, unit):
            master = staging.current_master(unit)
            state[MODEL_KEY] = sharded_model_state_dict(
                view.model, view.units, view.rank, [master if u is unit else None for u in view.units]
            )
            # The other units are left out: what is left of the model's keys but this unit's are buffers.
            state[MODEL_KEY] = {k: v for k, v in state[MODEL_KEY].items() if isinstance(v, ShardedChunks)}
        installs: list[Install] = []
        if load_optimizer:
            assert view.optimizer is not None
            targets, installs = optimizer_load_targets(view.optimizer, [unit], checkpoint.metadata, OPTIMIZER_KEY)
            state[OPTIMIZER_KEY] = {"state": targets["state"]}
        if not state:
            continue
        read_shards(checkpoint.directory, checkpoint.metadata, checkpoint.manifest, state)
        flat, pieces = _flat_state(unit, installs, scalars) if load_optimizer else (None, [])
        staging.write(unit, master, flat, pieces)
    return scalars


def _flat_state(
    unit: FlatUnit, installs: list[Install], scalars: list[Install]
) -> tuple[dict[str, torch.Tensor], list[tuple[MasterPiece, str]]]:
    """The loaded per-element state as one flat buffer per key, laid out like the unit's master shard (as the
    tier keeps it), and the (piece, key) views to install; the scalars go to ``scalars``."""
    numel = unit.resting_master.numel()
    flat: dict[str, torch.Tensor] = {}
    pieces: list[tuple[MasterPiece, str]] = []
    for master, key, tensor in installs:
        piece = master.piece
        if tensor.dim() == 1 and tensor.numel() == piece.numel:
            buffer = flat.setdefault(key, torch.zeros(numel, dtype=tensor.dtype))
            buffer[piece.shard_start : piece.shard_start + piece.numel].copy_(tensor)
            pieces.append((master, key))
        else:
            scalars.append((master, key, tensor))
    return flat, pieces
