"""Save and load a ZeroEngine's model and optimizer as a sharded DCP directory.

Layout (the one Lightning's FSDP strategy writes, so
``python -m lightning.pytorch.utilities.consolidate_checkpoint`` reads it):
DCP keys ``model`` and ``optimizer_0``, plus ``meta.pt`` with the caller's
extra state and this engine's own (``zero``: stage, world size, loss scale).
Loading reads whichever pieces the current layout needs, so the world size
and the stage may differ from the saving run's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .state_dicts import optimizer_load_targets, sharded_model_state_dict, sharded_optimizer_state_dict
from .storage import CheckpointError, check_files, load_into, mismatch_error, read_extra, read_metadata, save_atomically

if TYPE_CHECKING:
    from ..engine import ZeroEngine

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer_0"
ZERO_KEY = "zero"
FORMAT_VERSION = 1


def engine_state(engine: "ZeroEngine", with_model: bool = True, with_optimizer: bool = True) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if with_model:
        state[MODEL_KEY] = sharded_model_state_dict(engine.model, engine.units, engine.rank)
    if with_optimizer and engine.optimizer is not None:
        state[OPTIMIZER_KEY] = sharded_optimizer_state_dict(engine.optimizer, engine.units, engine.param_group_names)
    return state


def zero_info(engine: "ZeroEngine") -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "stage": engine.stage,
        "world_size": engine.world_size,
        "steps": engine.steps_taken,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
    }


def save_checkpoint(
    engine: "ZeroEngine",
    path: str | os.PathLike,
    extra: dict[str, Any] | None = None,
    include_optimizer: bool = True,
    include_model: bool = True,
) -> Path:
    """Model and/or optimizer as one DCP directory (Accelerate keeps them in two)."""
    if not (include_model or include_optimizer):
        raise ValueError("Nothing to save: include the model, the optimizer or both.")
    engine.runtime.settle()
    engine.sync_buffers_for_export()
    state = engine_state(engine, include_model, include_optimizer)
    return save_atomically(path, state, {**(extra or {}), ZERO_KEY: zero_info(engine)})


def _expected_model_shapes(engine: "ZeroEngine") -> dict[str, tuple[int, ...]]:
    shapes = {}
    slot_of = {id(p): slot for u in engine.units for slot, p in zip(u.layout.slots, u.params)}
    for key, value in engine.model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            slot = slot_of.get(id(value))
            shapes[key] = tuple(slot.shape) if slot is not None else tuple(value.shape)
    return shapes


def check_model_keys(path: Path, saved: dict[str, Any], expected: dict[str, tuple[int, ...]], prefix: str) -> None:
    """Raise, naming every difference, unless the checkpoint's model keys and shapes are ours."""
    stored = {k[len(prefix) + 1 :]: v for k, v in saved.items() if k.startswith(prefix + ".")}
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    misshaped = [
        f"{key} (checkpoint {tuple(stored[key].size)}, model {shape})"
        for key, shape in expected.items()
        if key in stored and hasattr(stored[key], "size") and tuple(stored[key].size) != shape
    ]
    if missing or unexpected or misshaped:
        raise mismatch_error(f"{path} does not hold this model's weights", missing, unexpected, misshaped)


def load_checkpoint(
    engine: "ZeroEngine", path: str | os.PathLike, *, load_optimizer: bool = True, load_model: bool = True
) -> dict[str, Any]:
    """Load what ``save_checkpoint`` wrote; returns the caller's extra state.

    Everything is checked before any state changes, on every rank alike
    (no collectives), so a bad checkpoint fails everywhere with one message.
    """
    path = Path(path).absolute()
    load_optimizer = load_optimizer and engine.optimizer is not None
    metadata = read_metadata(path)
    if load_model:
        check_model_keys(path, metadata.state_dict_metadata, _expected_model_shapes(engine), MODEL_KEY)
    has_optimizer = any(k.startswith(OPTIMIZER_KEY + ".") for k in metadata.state_dict_metadata)
    if load_optimizer and not has_optimizer:
        raise CheckpointError(f"{path} holds no optimizer state; pass load_optimizer=False to load the weights only.")
    check_files(path, metadata)
    extra = read_extra(path)
    engine.runtime.settle()
    state: dict[str, Any] = {}
    if load_model:
        state[MODEL_KEY] = sharded_model_state_dict(engine.model, engine.units, engine.rank)
    installs: list = []
    if load_optimizer:
        state[OPTIMIZER_KEY], installs = optimizer_load_targets(engine.optimizer, engine.units, metadata, OPTIMIZER_KEY)
    load_into(path, state, no_dist=not dist.is_initialized())
    if load_optimizer:
        _install_optimizer_state(engine, state[OPTIMIZER_KEY]["param_groups"], installs, path)
    engine.refresh_parameters()
    info = extra.pop(ZERO_KEY, None) or {}
    if engine.loss_scaler is not None and info.get("loss_scaler"):
        engine.loss_scaler.load_state_dict(info["loss_scaler"])
    engine.steps_taken = int(info.get("steps", engine.steps_taken))
    return extra


def _install_optimizer_state(engine: "ZeroEngine", saved_groups: list[dict], installs: list, path: Path) -> None:
    optimizer = engine.optimizer
    saved_names = [list(group["params"]) for group in saved_groups]
    if saved_names != engine.param_group_names:
        raise CheckpointError(
            f"{path}: the optimizer's param groups differ from the checkpoint's "
            f"({len(saved_names)} groups saved, {len(engine.param_group_names)} now, or other parameters in them)."
        )
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.state.clear()
    for master, key, tensor in installs:
        optimizer.state[master.param][key] = tensor
