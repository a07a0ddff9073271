"""What a parsed ``.metadata`` must look like before anything acts on it.

The unpickler guarantees only which classes appear. Here the tree is
checked field by field: DCP's records where records belong, plain names of
files the manifest covers, byte ranges inside those files, sizes that the
stored bytes can actually hold (so a forged size cannot make a reader
allocate terabytes), and planner data made of short tuples of names and
small indices (so rebuilding nested dicts cannot run away).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from .checkpoint_error import CheckpointError
from .manifest import Manifest, is_plain_file_name

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
