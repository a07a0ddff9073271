"""Loading ordinary full weights into an already-sharded model.

Each rank copies only the flat range of each parameter its shard covers (under tensor parallelism, of
its local piece, read as rectangles of the whole parameter):
from an in-memory state dict (a view), a memory-mapped torch file (only the
touched pages are read) or a safetensors file (rectangular slices), so no
rank materialises the whole model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from .agreed_steps import RankAgreement
from .checkpoint_error import CheckpointError, mismatch_error
from .checkpoint_records import LoadedWeights, ShardedModel
from .chunks import Rectangle, flat_range_to_rectangles, read_rectangles
from .loading import expected_model_shapes
from .state_dicts import slot_rectangles


class FlatSource(Protocol):
    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read_flat(self, name: str, start: int, end: int) -> torch.Tensor: ...
    def read_rectangles(self, name: str, rectangles: list[Rectangle]) -> torch.Tensor: ...


class DictSource:
    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self._tensors = state_dict

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read_flat(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._tensors[name].reshape(-1)[start:end]

    def read_rectangles(self, name: str, rectangles: list[Rectangle]) -> torch.Tensor:
        return read_rectangles(self._tensors[name], rectangles)


class SafetensorsSource:
    def __init__(self, path: Path):
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="pt")

    def names(self) -> set[str]:
        return set(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def read_flat(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.read_rectangles(name, flat_range_to_rectangles(self.shape(name), start, end))

    def read_rectangles(self, name: str, rectangles: list[Rectangle]) -> torch.Tensor:
        view = self._file.get_slice(name)
        if not view.get_shape():
            return self._file.get_tensor(name).reshape(-1)[: sum(math.prod(r.sizes) for r in rectangles)]
        parts = [view[tuple(slice(o, o + s) for o, s in zip(r.offsets, r.sizes))].reshape(-1) for r in rectangles]
        return torch.cat(parts) if parts else torch.empty(0)


def open_source(source: Mapping[str, torch.Tensor] | str | os.PathLike) -> FlatSource:
    if isinstance(source, Mapping):
        return DictSource(source)
    path = Path(source)
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file of weights (expected .safetensors, .pt, .pth, .bin or .ckpt).")
    if path.suffix == ".safetensors":
        return SafetensorsSource(path)
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(loaded, Mapping) and "state_dict" in loaded and isinstance(loaded["state_dict"], Mapping):
        loaded = loaded["state_dict"]  # a Lightning checkpoint file
    return DictSource(loaded)


def _resolve_names(view: ShardedModel, source: FlatSource, strict: bool) -> dict[str, str]:
    """Map each model key to the source key holding it (a tied parameter needs one of its names)."""
    expected = expected_model_shapes(view)
    available = source.names()
    slot_names = {name: slot.fqns for u in view.units for slot in u.layout.slots for name in slot.fqns}
    resolved, missing, misshaped = {}, [], []
    for key, shape in expected.items():
        candidates = [n for n in slot_names.get(key, (key,)) if n in available]
        if not candidates:
            missing.append(key)
            continue
        resolved[key] = candidates[0]
        if source.shape(candidates[0]) != shape:
            misshaped.append(f"{key} (file {source.shape(candidates[0])}, model {shape})")
    unexpected = sorted(available - set(expected))
    if misshaped or (strict and (missing or unexpected)):
        raise mismatch_error("The weights do not fit this model", missing, unexpected, misshaped)
    return resolved


def _read_weights(
    view: ShardedModel, source: Mapping[str, torch.Tensor] | str | os.PathLike, strict: bool
) -> LoadedWeights:
    tensors = open_source(source)
    names = _resolve_names(view, tensors, strict)
    shards = [unit.storage.master_shard.clone() for unit in view.units]
    for unit, shard in zip(view.units, shards):
        for piece in unit.layout.pieces(view.rank):
            name = names.get(piece.slot.fqns[0])
            if name is None:
                continue
            values = tensors.read_rectangles(
                name, slot_rectangles(piece.slot, piece.param_start, piece.param_start + piece.numel)
            )
            shard[piece.shard_start : piece.shard_start + piece.numel].copy_(values)
    buffers = {}
    for key, buffer in view.model.named_buffers():
        if key in names:
            shape = tensors.shape(names[key])
            buffers[key] = tensors.read_flat(names[key], 0, math.prod(shape)).view(shape).to(buffer.dtype).clone()
    return LoadedWeights(shards, buffers)


def load_full_weights(
    view: ShardedModel, source: Mapping[str, torch.Tensor] | str | os.PathLike, strict: bool
) -> LoadedWeights:
    """This rank's part of ordinary full weights, in new tensors, once every rank has read its part."""
    where = "a state dict" if isinstance(source, Mapping) else str(source)
    agreement = RankAgreement(view.comm, f"loading full weights from {where}")
    weights, _ = agreement.run("reading the weights", lambda: _read_weights(view, source, strict))
    return weights
