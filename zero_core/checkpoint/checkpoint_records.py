"""What a checkpoint directory holds besides tensors, and the typed records that move between
the checkpoint code and the engine.

The checkpoint code sees the sharded model through :class:`ShardedModel`
(units, communication context, optimizer) and hands what it loaded back as
a :class:`LoadedCheckpoint` for the engine to apply; it never writes an
engine's fields itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ..collectives import CommContext
from ..optim.loss_scaling import LossScalerState, state_from_checkpoint
from .checkpoint_error import CheckpointError

if TYPE_CHECKING:
    from ..offload.nvme_save import NvmeSaveReads
    from ..unit import FlatUnit, MasterPiece

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer_0"  # Lightning's FSDP layout, which its consolidation tool reads
ZERO_KEY = "zero"  # the engine's own entry in meta.pt
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShardedModel:
    """The narrow view of an engine that saving and loading need."""

    model: nn.Module
    units: Sequence["FlatUnit"]
    comm: CommContext
    optimizer: torch.optim.Optimizer | None
    param_group_names: list[list[str]]
    # With the NVMe optimizer tier: its state read from its files a few units at a time, for a save.
    resting: "NvmeSaveReads | None" = None

    @property
    def rank(self) -> int:
        """This rank's place in its shard group: which pieces of each unit it holds. (The units' own context:
        on a 2-D mesh ``comm`` spans every rank, the shard group the data-parallel ones.)"""
        return self.units[0].comm.shard_rank


@dataclass(frozen=True)
class EngineRecord:
    """The engine's entry in ``meta.pt``: how it was saved, and the state that is not tensors."""

    stage: int
    world_size: int
    steps: int
    loss_scaler: LossScalerState | None
    save_id: str = ""
    format: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        scaler = dataclasses.asdict(self.loss_scaler) if self.loss_scaler is not None else None
        return {
            "format": self.format,
            "stage": self.stage,
            "world_size": self.world_size,
            "steps": self.steps,
            "loss_scaler": scaler,
            "save_id": self.save_id,
        }


class LoadedOptimizer(NamedTuple):
    group_settings: list[dict[str, Any]]  # each group's hyperparameters, without "params"
    state: list[tuple["MasterPiece", str, torch.Tensor]]  # (piece, key, this rank's tensor)


class LoadedWeights(NamedTuple):
    # Per unit, the new fp32 master shard (padding as it was); None: the NVMe tier loads it into its file.
    master_shards: list[torch.Tensor | None]
    buffers: dict[str, torch.Tensor]  # by state-dict key


class LoadedCheckpoint(NamedTuple):
    """Everything a load read, held aside until every rank succeeded; the engine applies it."""

    extra: dict[str, Any]
    record: EngineRecord
    weights: LoadedWeights | None  # None: the model was not loaded
    optimizer: LoadedOptimizer | None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_engine_record(record: Any, file: Path, save_id: str) -> tuple[dict[str, Any], EngineRecord]:
    """Split ``meta.pt``'s contents into the caller's extra state and our validated record."""
    if not isinstance(record, dict) or not isinstance(record.get(ZERO_KEY), dict):
        raise CheckpointError(f"{file} is not lightning-zero's meta.pt: it has no '{ZERO_KEY}' entry.")
    extra = {k: v for k, v in record.items() if k != ZERO_KEY}
    info = record[ZERO_KEY]
    expected = {"format", "stage", "world_size", "steps", "loss_scaler", "save_id"}
    if set(info) != expected:
        raise CheckpointError(f"{file}: the '{ZERO_KEY}' entry has keys {sorted(info)}, expected {sorted(expected)}.")
    if info["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: checkpoint format {info['format']!r}; this lightning-zero reads format {FORMAT_VERSION}."
        )
    if not all(_is_int(info[k]) and info[k] >= 0 for k in ("stage", "world_size", "steps")):
        raise CheckpointError(f"{file}: stage, world_size and steps must be non-negative integers.")
    if info["save_id"] != save_id:
        raise CheckpointError(
            f"{file} comes from another save than the rest of the checkpoint (save identity differs)."
        )
    return extra, EngineRecord(
        info["stage"], info["world_size"], info["steps"], _loss_scaler(info["loss_scaler"], file), save_id
    )


def _loss_scaler(state: Any, file: Path) -> LossScalerState | None:
    if state is None:
        return None
    try:
        return state_from_checkpoint(state)  # by its exact names (loss_scaling.py keeps the list)
    except ValueError as error:
        raise CheckpointError(f"{file}: {error}.") from None
