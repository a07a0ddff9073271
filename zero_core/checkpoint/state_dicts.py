"""Sharded state dicts of the model and optimizer, in full logical shapes.

Every parameter and per-element optimizer-state tensor appears under its
fully qualified name with its full shape (a tensor-parallel parameter's whole
shape), as a :class:`ShardedChunks` view of this rank's fp32 shard; buffers and scalar state (Adam's ``step``) appear as
ordinary tensors every rank holds alike. The layout is FSDP's: the
optimizer state dict is ``{"state": {fqn: {key: tensor}}, "param_groups":
[{..., "params": [fqn, ...]}]}``, so tools that read FSDP checkpoints read
ours, and a checkpoint does not depend on the stage or world size it was
written at.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..offload.nvme_save import NvmeSaveReads
from ..unit import FlatUnit, MasterPiece, ParamSlot, ShardPiece, parameter_name
from ..whole_tensor_plan import StateKind, count_problem, is_whole_state, kept_state_entry
from .checkpoint_error import CheckpointError
from .chunks import LazyValues, Rectangle, ShardedChunks, piece_rectangles


def slot_rectangles(slot: ParamSlot, start: int, end: int) -> list[Rectangle]:
    """Flat elements ``[start, end)`` of a slot (a tensor-parallel parameter's local piece), as rectangles of
    the whole parameter."""
    return piece_rectangles(tuple(slot.shape), start, end, slot.place and slot.offsets_in_whole)


def slot_chunks(slot: ParamSlot, local: torch.Tensor | LazyValues, flat_start: int) -> ShardedChunks:
    """``local`` (from ``flat_start`` of the slot's flat order) as pieces of the whole parameter."""
    return ShardedChunks(slot.whole_shape, local, flat_start, slot.shape, slot.offsets_in_whole)


def _local_chunks(shard: torch.Tensor, slot: ParamSlot, piece: ShardPiece | None) -> ShardedChunks:
    if piece is None:  # this rank's shard holds none of the parameter
        return slot_chunks(slot, shard.new_empty(0), 0)
    return slot_chunks(slot, shard[piece.shard_start : piece.shard_start + piece.numel], piece.param_start)


def _resting_chunks(unit: FlatUnit, slot: ParamSlot, piece: ShardPiece | None, resting: NvmeSaveReads) -> ShardedChunks:
    """A piece of a master that may rest in the NVMe tier's file: read (a unit at a time) when DCP asks."""
    master = unit.storage.resting_master
    if piece is None:
        return slot_chunks(slot, master.new_empty(0), 0)
    span = slice(piece.shard_start, piece.shard_start + piece.numel)
    frozen = resting.rests_frozen(unit)
    lazy = LazyValues(lambda: resting.master(unit)[span], piece.numel, master.dtype, master.device, frozen)
    return slot_chunks(slot, lazy, piece.param_start)


def sharded_model_state_dict(
    model: torch.nn.Module,
    units: Sequence[FlatUnit],
    rank: int,
    shards: Sequence[torch.Tensor | None] | None = None,
    copy_buffers: bool = False,
    resting: NvmeSaveReads | None = None,
) -> dict[str, torch.Tensor]:
    """``model.state_dict()``'s keys and order; parameters as views of the fp32 master shard.

    ``shards`` (one per unit, shaped like its master shard) and ``copy_buffers``
    give a state dict over new tensors instead: what a load fills before it
    is known to have succeeded everywhere (a unit whose shard is None is left
    out, its parameters too: the NVMe tier loads it apart). ``resting``:
    masters that rest in the NVMe tier's files are read from there when DCP
    asks (not all brought back into memory first).
    """
    views: dict[int, ShardedChunks] = {}
    left_out = {id(p) for i, u in enumerate(units) if shards is not None and shards[i] is None for p in u.params}
    for index, unit in enumerate(units):
        shard: torch.Tensor | None = None  # None: read from the tier's file when DCP asks (``resting``)
        if shards is not None:
            shard = shards[index]
            if shard is None:
                continue  # left out
        elif resting is None or not unit.master_rests_on_disk:
            shard = unit.storage.master_shard  # once per unit: it may read the tier back
        piece_of = {piece.slot.index: piece for piece in unit.layout.pieces(rank)}
        for slot, param in zip(unit.layout.slots, unit.params):
            piece = piece_of.get(slot.index)
            if shard is not None:
                views[id(param)] = _local_chunks(shard, slot, piece)
            else:
                assert resting is not None
                views[id(param)] = _resting_chunks(unit, slot, piece, resting)

    def entry(value: Any) -> Any:
        if id(value) in views:
            return views[id(value)]
        if isinstance(value, torch.Tensor):
            return value.detach().clone() if copy_buffers else value.detach()
        return value

    live = model.state_dict(keep_vars=True)
    return {key: entry(value) for key, value in live.items() if id(value) not in left_out}


def _is_per_element(value: Any, master: MasterPiece) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == master.piece.numel


def _per_element_values(
    unit: FlatUnit, key: str, value: torch.Tensor, resting: NvmeSaveReads | None
) -> torch.Tensor | LazyValues:
    """An optimizer-state tensor, or (one of the NVMe tier's buffers) its values, read when DCP asks."""
    buffer_key = resting.state_key(unit, value) if resting is not None else None
    if buffer_key is None:
        return value
    return LazyValues(
        lambda: resting.per_element(unit, buffer_key, value),
        value.numel(),
        value.dtype,
        value.device,
        resting.rests_frozen(unit),
    )


def sharded_optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    units: Sequence[FlatUnit],
    group_names: list[list[str]],
    resting: NvmeSaveReads | None = None,
) -> dict[str, Any]:
    """``resting``: state that rests in the NVMe tier's files is read from there when DCP asks."""
    state: dict[str, dict[str, Any]] = {}
    for unit in units:
        for master in unit.master_pieces:
            slot = master.piece.slot
            for key, value in optimizer.state.get(master.param, {}).items():
                # A whole-tensor optimizer's factor kept whole may be 1-D with the piece's length.
                shape = tuple(slot.shape)
                if _is_per_element(value, master) and not is_whole_state(optimizer, shape, key, tuple(value.shape)):
                    local = _per_element_values(unit, key, value, resting)
                    value = slot_chunks(slot, local, master.piece.param_start)
                state.setdefault(slot.fqns[0], {})[key] = value
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
        for group, names in zip(optimizer.param_groups, group_names)
    ]
    return {"state": state, "param_groups": groups}


class SavedStateEntry(NamedTuple):
    """One optimizer state entry a checkpoint holds: under which parameter name it is stored (its spelling in
    the file, which DCP's destination must use), its state key (exp_avg, step, ...) and its storage."""

    stored_name: str
    key: str
    storage: TensorStorageMetadata | BytesStorageMetadata


def saved_state_entries(metadata: Metadata, prefix: str) -> dict[str, list[SavedStateEntry]]:
    """The checkpoint's optimizer state entries by our name of their parameter (``parameter_name``: an older
    engine's checkpoint_wrapper prefix dropped), tensors and pickled objects alike."""
    # Saved keys are "<prefix>.state.<fqn>.<key>"; state keys (exp_avg, step, ...) hold no dots.
    state_prefix = f"{prefix}.state."
    saved: dict[str, list[SavedStateEntry]] = {}
    for flat_key, entry in metadata.state_dict_metadata.items():
        if flat_key.startswith(state_prefix) and isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            fqn, key = flat_key[len(state_prefix) :].rsplit(".", 1)
            saved.setdefault(parameter_name(fqn), []).append(SavedStateEntry(fqn, key, entry))
    return saved


def saved_optimizer_state(metadata: Metadata, prefix: str) -> dict[str, list[tuple[str, TensorStorageMetadata]]]:
    """The checkpoint's optimizer state tensors by our parameter name: (state key, its metadata)."""
    return {
        name: tensors
        for name, entries in saved_state_entries(metadata, prefix).items()
        if (tensors := [(e.key, e.storage) for e in entries if isinstance(e.storage, TensorStorageMetadata)])
    }


class LoadedNumber(NamedTuple):
    """Where a Python number of the optimizer's state (transformers' Adafactor's step count) arrives: DCP
    reads its pickled bytes into the destination's ``[stored_name][key]`` (``with_loaded_numbers`` takes it from
    there)."""

    stored_name: str
    key: str


def with_loaded_numbers(optimizer: torch.optim.Optimizer, destination: dict[str, Any], installs: list) -> list:
    """``installs`` with each ``LoadedNumber`` replaced by the number DCP read into ``destination["state"]``.
    Only a step count a whole-tensor optimizer keeps as a Python int (``StateKind.COUNT``) is installed, and
    only a count is accepted there; other pickled state is left out, as it always was."""
    resolved = []
    for master, key, value in installs:
        if isinstance(value, LoadedNumber):
            entry = kept_state_entry(optimizer, tuple(master.piece.slot.shape), key)
            if entry is None or entry.kind is not StateKind.COUNT:
                continue
            value = destination["state"][value.stored_name][value.key]
            if problem := count_problem(value):
                raise CheckpointError(f"the optimizer state {master.piece.slot.fqns[0]}.{key} is {problem}.")
        resolved.append((master, key, value))
    return resolved


def is_per_element(slot: ParamSlot, key: str, entry: TensorStorageMetadata) -> bool:
    """Saved state shaped like the parameter (sharded with it), not a scalar (a 0-d parameter's ``step``)."""
    return tuple(entry.size) == tuple(slot.whole_shape) and (len(slot.shape) > 0 or key != "step")


def optimizer_load_targets(
    optimizer: torch.optim.Optimizer,
    units: Sequence[FlatUnit],
    metadata: Metadata,
    prefix: str,
    per_element: Callable[[MasterPiece, str, torch.dtype], torch.Tensor] | None = None,
) -> tuple[dict[str, Any], list[tuple[MasterPiece, str, torch.Tensor]]]:
    """A state dict to load optimizer state into, built from what the checkpoint holds.

    Returns the DCP destination and (piece, key, tensor) triples to install
    as ``optimizer.state`` once loaded (a number saved as a pickled object
    comes as a ``LoadedNumber``: ``with_loaded_numbers`` after the read).
    Per-element state is recognised by having the parameter's full shape;
    ``per_element`` gives where a piece's is loaded (None: a new tensor of
    its own).
    """
    saved = saved_state_entries(metadata, prefix)
    targets: dict[str, dict[str, Any]] = {}  # by the names as stored: DCP reads the file's keys into it
    installs: list[tuple[MasterPiece, str, Any]] = []
    for unit in units:
        for master in unit.master_pieces:
            slot = master.piece.slot
            for stored_name, key, entry in saved.get(slot.fqns[0], []):
                if isinstance(entry, BytesStorageMetadata):  # filled by DCP, checked by with_loaded_numbers
                    counted = kept_state_entry(optimizer, tuple(slot.shape), key)
                    if counted is None or counted.kind is not StateKind.COUNT:
                        continue  # other pickled state is not read at all, as before numbers were
                    targets.setdefault(stored_name, {})[key] = None
                    installs.append((master, key, LoadedNumber(stored_name, key)))
                    continue
                dtype = entry.properties.dtype
                # A factor kept whole (Adafactor's row means of an m x 1 matrix) may have the parameter's shape.
                kept_whole = is_whole_state(optimizer, tuple(slot.shape), key, tuple(entry.size))
                if is_per_element(slot, key, entry) and not kept_whole:
                    if per_element is not None:
                        local = per_element(master, key, dtype)
                    else:
                        local = torch.zeros(master.piece.numel, dtype=dtype, device=unit.storage.resting_master.device)
                    target: torch.Tensor = slot_chunks(slot, local, master.piece.param_start)
                else:  # whole on every rank holding a piece: a factor on the master's device, as the step keeps it
                    kept = kept_state_entry(optimizer, tuple(slot.shape), key)
                    factor = kept is not None and kept.kind is StateKind.FACTOR
                    device = unit.storage.resting_master.device if factor else torch.device("cpu")
                    local = target = torch.zeros(entry.size, dtype=dtype, device=device)
                targets.setdefault(stored_name, {})[key] = target
                installs.append((master, key, local))
    groups = [dict(group, params=[]) for group in optimizer.param_groups]
    return {"state": targets, "param_groups": groups}, installs
