"""Loading a checkpoint directory into a sharded model, all or nothing, agreed on every rank.

Steps, each agreed across ranks before the next: find the checkpoint (the
path, or the copy an interrupted save left), verify it (manifest,
``.metadata`` and ``meta.pt`` against their checksums, every data file
present with its size, the save identity), check the model's and the
optimizer's keys and shapes, then read this rank's pieces into new tensors,
each item's bytes checked against its digest as they are read (the parsed
``.metadata`` checked field by field first: at the end of this file). Nothing of
the live model or optimizer is touched: the engine applies the returned
:class:`LoadedCheckpoint` only once every rank has it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from ..offload.nvme_load import NvmeLoad
from ..unit import parameter_name
from ..whole_tensor_plan import is_whole_state, whole_state_problem
from .agreed_steps import RankAgreement
from .checkpoint_error import CheckpointError, mismatch_error
from .checkpoint_records import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    EngineRecord,
    LoadedCheckpoint,
    LoadedOptimizer,
    LoadedWeights,
    ShardedModel,
    parse_engine_record,
)
from .chunks import ShardedChunks
from .directory import EXTRA_FILENAME, METADATA_FILENAME, locate_checkpoint, read_shards
from .manifest import Manifest, check_present, is_plain_file_name, read_manifest, read_verified
from .nvme_load_reads import check_staging_room, is_staged, read_staged_units
from .state_dicts import (
    optimizer_load_targets,
    saved_optimizer_state,
    sharded_model_state_dict,
    with_loaded_numbers,
)
from .unpickling import load_weights_only, unpickle_metadata


class VerifiedCheckpoint(NamedTuple):
    directory: Path
    manifest: Manifest
    metadata: dcp_metadata.Metadata
    extra: dict[str, Any]
    record: EngineRecord


def open_checkpoint(agreement: RankAgreement, path: str | os.PathLike) -> VerifiedCheckpoint:
    """Find and verify the checkpoint at ``path`` (data bytes are checked later, as they are read)."""
    _, places = agreement.run("finding the checkpoint", lambda: str(locate_checkpoint(path)), share=True)
    if len(set(places)) > 1:
        raise CheckpointError(
            f"{agreement.operation}: the ranks found different directories ({places}); is the filesystem shared?"
        )
    directory = Path(places[0])

    def verify() -> VerifiedCheckpoint:
        manifest = read_manifest(directory)
        metadata = unpickle_metadata(
            read_verified(directory, manifest, METADATA_FILENAME), directory / METADATA_FILENAME
        )
        data_files = check_metadata(directory, metadata, manifest)
        meta = load_weights_only(
            read_verified(directory, manifest, EXTRA_FILENAME),
            directory / EXTRA_FILENAME,
            "the step counter and extra state",
        )
        extra, record = parse_engine_record(meta, directory / EXTRA_FILENAME, manifest.save_id)
        for name in data_files:  # present and whole; their bytes are checked as they are read
            check_present(directory, manifest, name)
        return VerifiedCheckpoint(directory, manifest, metadata, extra, record)

    checkpoint, _ = agreement.run("verifying the files", verify)
    return checkpoint


def expected_model_shapes(view: ShardedModel) -> dict[str, tuple[int, ...]]:
    """Every key of ``model.state_dict()`` with its full (logical) shape."""
    shapes = {}
    slot_of = {id(p): slot for u in view.units for slot, p in zip(u.layout.slots, u.params)}
    for key, value in view.model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            slot = slot_of.get(id(value))
            shapes[key] = tuple(slot.whole_shape) if slot is not None else tuple(value.shape)
    return shapes


def check_model_keys(path: Path, metadata: dcp_metadata.Metadata, expected: dict[str, tuple[int, ...]]) -> None:
    """Raise, naming every difference, unless the checkpoint's model keys and shapes are ours."""
    prefix = MODEL_KEY + "."
    stored = {k[len(prefix) :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    misshaped = [
        f"{key} (checkpoint {tuple(stored[key].size)}, model {shape})"
        for key, shape in expected.items()
        if key in stored and hasattr(stored[key], "size") and tuple(stored[key].size) != shape
    ]
    if missing or unexpected or misshaped:
        raise mismatch_error(f"{path} does not hold this model's weights", missing, unexpected, misshaped)


def check_optimizer_entries(path: Path, metadata: dcp_metadata.Metadata, view: ShardedModel) -> None:
    """Every saved optimizer tensor belongs to a parameter of this model and is either per element
    (the parameter's full shape), a scalar (``step``) or a factor a whole-tensor optimizer keeps (Adafactor's
    row and column means, of the shape its rule says): anything else would be installed as is."""
    slots = {slot.fqns[0]: slot for unit in view.units for slot in unit.layout.slots}
    unknown, misshaped = set(), []
    for fqn, entries in saved_optimizer_state(metadata, OPTIMIZER_KEY).items():
        slot = slots.get(fqn)
        if slot is None:
            unknown.add(fqn)
            continue
        for state_key, entry in entries:
            if problem := whole_state_problem(view.optimizer, tuple(slot.shape), state_key, tuple(entry.size)):
                misshaped.append(f"{fqn} {problem}")
            elif tuple(entry.size) not in (tuple(slot.whole_shape), ()) and not is_whole_state(
                view.optimizer, tuple(slot.shape), state_key, tuple(entry.size)
            ):
                whole = tuple(slot.whole_shape)
                misshaped.append(f"{fqn} {state_key} (checkpoint {tuple(entry.size)}, parameter {whole})")
    if unknown or misshaped:
        raise mismatch_error(f"{path}'s optimizer state does not fit this model", [], sorted(unknown), misshaped)


def load_checkpoint(
    view: ShardedModel,
    path: str | os.PathLike,
    *,
    load_model: bool,
    load_optimizer: bool,
    staging: NvmeLoad | None = None,
) -> LoadedCheckpoint:
    """``staging``: the NVMe optimizer tier's units are read one at a time into files beside theirs (put in
    place by the caller once the load is applied, removed by it otherwise)."""
    agreement = RankAgreement(view.comm, f"loading checkpoint {Path(path).absolute()}")
    checkpoint = open_checkpoint(agreement, path)

    def check_contents() -> None:
        if load_model:
            check_model_keys(checkpoint.directory, checkpoint.metadata, expected_model_shapes(view))
        saved = checkpoint.metadata.state_dict_metadata
        if load_optimizer and not any(k.startswith(OPTIMIZER_KEY + ".") for k in saved):
            raise CheckpointError(
                f"{checkpoint.directory} holds no optimizer state; pass load_optimizer=False to load the weights only."
            )
        if load_optimizer:
            check_optimizer_entries(checkpoint.directory, checkpoint.metadata, view)

    agreement.run("checking the contents", check_contents)
    if staging is not None:  # the NVMe tier's copy must fit beside it: refused now, not part-way on a full disk
        check_staging_room(agreement, view, checkpoint.metadata, load_model, load_optimizer, staging)
    loaded, _ = agreement.run(
        "reading the shards", lambda: _read(view, checkpoint, load_model, load_optimizer, staging)
    )
    return loaded


def _read(
    view: ShardedModel,
    checkpoint: VerifiedCheckpoint,
    load_model: bool,
    load_optimizer: bool,
    staging: NvmeLoad | None,
) -> LoadedCheckpoint:
    state: dict[str, Any] = {}
    shards = None
    if load_model:
        # Padding keeps its values; a master the NVMe tier keeps in its file is loaded apart (None here).
        shards = [None if is_staged(staging, unit) else unit.storage.master_shard.clone() for unit in view.units]
        state[MODEL_KEY] = sharded_model_state_dict(view.model, view.units, view.rank, shards, copy_buffers=True)
    installs: list = []
    if load_optimizer:
        assert view.optimizer is not None
        in_memory = [unit for unit in view.units if not is_staged(staging, unit)]
        state[OPTIMIZER_KEY], installs = optimizer_load_targets(
            view.optimizer, in_memory, checkpoint.metadata, OPTIMIZER_KEY
        )
    read_shards(checkpoint.directory, checkpoint.metadata, checkpoint.manifest, state)
    if load_optimizer:
        installs = with_loaded_numbers(view.optimizer, state[OPTIMIZER_KEY], installs)
    if staging is not None:
        installs += read_staged_units(view, checkpoint, load_model, load_optimizer, staging)
    weights = None
    if load_model:
        assert shards is not None
        buffers = {
            key: value
            for key, value in state[MODEL_KEY].items()
            if isinstance(value, torch.Tensor) and not isinstance(value, ShardedChunks)
        }
        weights = LoadedWeights(shards, buffers)
    optimizer = None
    if load_optimizer:
        settings = group_settings(view, state[OPTIMIZER_KEY]["param_groups"], checkpoint.directory)
        optimizer = LoadedOptimizer(settings, installs)
    return LoadedCheckpoint(checkpoint.extra, checkpoint.record, weights, optimizer)


def group_settings(view: ShardedModel, saved_groups: Any, path: Path | str) -> list[dict[str, Any]]:
    """The saved groups' hyperparameters, once their parameters and value types are known to match ours."""
    assert view.optimizer is not None
    valid = isinstance(saved_groups, list) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved_groups
    )
    if not valid:
        raise CheckpointError(f"{path}: the optimizer's param groups are malformed.")
    # Our names: a name saved by an older engine (its checkpoint_wrapper prefix kept) is the same parameter.
    saved_names = [[parameter_name(n) if isinstance(n, str) else n for n in group["params"]] for group in saved_groups]
    if saved_names != view.param_group_names:
        raise CheckpointError(
            f"{path}: the optimizer's param groups differ from the checkpoint's "
            f"({len(saved_names)} groups saved, {len(view.param_group_names)} now, or other parameters in them)."
        )
    settings = []
    for index, (group, saved) in enumerate(zip(view.optimizer.param_groups, saved_groups)):
        for key, value in saved.items():
            if key != "params" and key in group and not _same_kind(group[key], value):
                raise CheckpointError(
                    f"{path}: param group {index}'s {key!r} is {value!r} in the checkpoint, of another kind than "
                    f"this optimizer's {group[key]!r}; was it saved from another optimizer?"
                )
        settings.append({k: v for k, v in saved.items() if k != "params"})
    return settings


def _same_kind(current: Any, saved: Any) -> bool:
    def kind(value: Any) -> str:
        if isinstance(value, bool) or value is None:
            return type(value).__name__
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            return "number"
        if isinstance(value, (tuple, list)):
            return "sequence of " + ",".join(kind(v) for v in value)
        return type(value).__name__

    return current is None or saved is None or kind(current) == kind(saved)


# ---------------------------------------------------------------- the parsed .metadata, checked
# What a parsed ``.metadata`` must look like before anything acts on it.
#
# The unpickler guarantees only which classes appear. Here the tree is
# checked field by field: DCP's records where records belong, plain names of
# files the manifest covers, byte ranges inside those files, sizes that the
# stored bytes can actually hold (so a forged size cannot make a reader
# allocate terabytes), and planner data made of short tuples of names and
# small indices (so rebuilding nested dicts cannot run away).

_MAX_NESTING = 32


def _is_size(value: Any) -> bool:
    return isinstance(value, (torch.Size, tuple, list)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    )


def _check_tensor_entry(key: str, entry: Any) -> int:
    """The entry's byte size, once its properties, size and chunks are well formed."""
    properties = getattr(entry, "properties", None)
    if not isinstance(properties, dcp_metadata.TensorProperties) or not isinstance(properties.dtype, torch.dtype):
        raise ValueError(f"{key!r} has malformed tensor properties")
    if not _is_size(entry.size) or not isinstance(entry.chunks, list):
        raise ValueError(f"{key!r} has a malformed size or chunk list")
    for chunk in entry.chunks:
        valid = (
            isinstance(chunk, dcp_metadata.ChunkStorageMetadata)
            and _is_size(chunk.offsets)
            and _is_size(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
            and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))
        )
        if not valid:
            raise ValueError(f"{key!r} has a chunk outside the tensor")
    return math.prod(entry.size) * properties.dtype.itemsize


def _check_planner_data(planner_data: Any, entries: int) -> None:
    if planner_data is None:
        return
    if not isinstance(planner_data, dict):
        raise ValueError("planner data is not a mapping")
    for key, path in planner_data.items():
        valid = (
            isinstance(key, str)
            and isinstance(path, tuple)
            and 0 < len(path) <= _MAX_NESTING
            and all(
                isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= entries)
                for p in path
            )
        )
        if not valid:
            raise ValueError(f"planner data for {key!r} is malformed")


def check_metadata(directory: Path, metadata: dcp_metadata.Metadata, manifest: Manifest) -> list[str]:
    """Raise CheckpointError unless the metadata is well formed; returns the data files it reads."""
    try:
        return _check(metadata, manifest)
    except (ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{directory / '.metadata'} is malformed: {error}.") from error


def _check(metadata: dcp_metadata.Metadata, manifest: Manifest) -> list[str]:
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise ValueError("its entries or storage map are not mappings")
    tensor_bytes, chunks, chunk_lists = 0, 0, set()
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise ValueError(f"entry name {key!r} is not a string")
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            # Each chunk is one stored item: more chunks than items, or one chunk list shared
            # by many entries (pickle stores it once), would only make checking take quadratic time.
            if id(entry.chunks) in chunk_lists:
                raise ValueError(f"{key!r} shares its chunk list with another entry")
            chunk_lists.add(id(entry.chunks))
            chunks += len(entry.chunks) if isinstance(entry.chunks, list) else 0
            if chunks > len(metadata.storage_data):
                raise ValueError("it lists more chunks than stored items")
            tensor_bytes += _check_tensor_entry(key, entry)
        elif not isinstance(entry, dcp_metadata.BytesStorageMetadata):
            raise ValueError(f"{key!r} is neither a tensor nor an object entry")
    names = set()
    for index, info in metadata.storage_data.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, dcp_filesystem._StorageInfo):
            raise ValueError("its storage map holds something other than DCP's records")
        name = info.relative_path
        if not is_plain_file_name(name) or name not in manifest.files:
            raise ValueError(f"it names a data file {name!r} that is not part of this checkpoint")
        in_range = all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (info.offset, info.length))
        if not in_range or info.offset + info.length > manifest.files[name].size:
            raise ValueError(f"it points outside {name}")
        if info.transform_descriptors:
            raise ValueError(f"{name} was written with transforms (compression?) that lightning-zero never writes")
        names.add(name)
    stored = sum(manifest.files[name].size for name in names)
    if tensor_bytes > stored:
        raise ValueError(f"its tensors would take {tensor_bytes} bytes, more than the {stored} bytes stored")
    _check_planner_data(metadata.planner_data, len(metadata.state_dict_metadata))
    return sorted(names)
