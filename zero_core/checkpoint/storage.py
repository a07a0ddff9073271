"""Reading and writing DCP directories safely.

Trust: a checkpoint is data. Its ``.metadata`` is unpickled with an
allow-list of DCP's own record classes and torch dtypes; tensors are read
with ``torch.load(weights_only=True)`` (DCP's default); pickled objects in
the checkpoint (param groups, extras) are read with ``weights_only=True``
too, instead of DCP's default ``weights_only=False``. Nothing in a
checkpoint can run code when it is loaded here.

Saves are atomic: everything is written into a hidden sibling directory
that replaces the target only once complete, so a crash mid-save leaves the
previous checkpoint as it was.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILENAME = ".metadata"
EXTRA_FILENAME = "meta.pt"  # the name Lightning's consolidation tool reads user state from


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model; the message says why."""


def mismatch_error(what: str, missing: list[str], unexpected: list[str], misshaped: list[str]) -> CheckpointError:
    """One message naming every difference (the first ten of each kind)."""
    problems = [
        f"{label}: {names[:10]}{' ...' if len(names) > 10 else ''}"
        for label, names in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped", misshaped))
        if names
    ]
    return CheckpointError(f"{what}; " + "; ".join(problems))


_ALLOWED_MODULES = {dcp_metadata.__name__, dcp_filesystem.__name__}
_ALLOWED_BUILTINS = {"set", "frozenset", "slice", "complex", "list", "dict", "tuple"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout  # name -> torch.layout lookup
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            return super().find_class(module, name)  # the checkpoint_id DCP records
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    file = path / METADATA_FILENAME
    if not file.is_file():
        hint = ""
        partial = _partial_dir(path)
        if partial.exists():
            hint = f" A save into it was interrupted ({partial.name} is left over); the previous checkpoint, if any, is intact."
        raise CheckpointError(f"{path} is not a checkpoint: {METADATA_FILENAME} is missing.{hint}")
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except Exception as error:  # noqa: BLE001 - any failure means the file is unusable
        raise CheckpointError(f"{file} is corrupt or not DCP metadata ({error}).") from error
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file} is not DCP metadata (found {type(metadata).__name__}).")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with the allow-listed metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading pickled objects with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own helper

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def check_files(path: Path, metadata: dcp_metadata.Metadata) -> None:
    """Every data file the metadata names exists and is long enough."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: shard file {name} is missing; the checkpoint is incomplete.")
        size = file.stat().st_size
        if size < length:
            raise CheckpointError(
                f"{path}: shard file {name} is truncated ({size} bytes, the metadata needs {length})."
            )


def load_into(path: Path, state: dict[str, Any], *, no_dist: bool = False) -> None:
    """Fill ``state`` (tensors and checkpointable views, in place) from the DCP directory."""
    dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(allow_partial_load=True), no_dist=no_dist)


def read_extra(path: Path) -> dict[str, Any]:
    file = path / EXTRA_FILENAME
    return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else {}


# ---------------------------------------------------------------- saving
def _partial_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _is_coordinator() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_atomically(path: str | os.PathLike, state: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """Write ``state`` as a DCP directory at ``path`` (and ``extra`` as meta.pt), all or nothing.

    Every rank calls it. The directory is complete before it takes the
    target's place; an existing checkpoint there is replaced only then.
    """
    path = Path(path).absolute()
    partial = _partial_dir(path)
    if _is_coordinator():
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(state, storage_writer=FileSystemWriter(partial), no_dist=not dist.is_initialized())
    if _is_coordinator():
        if extra is not None:
            torch.save(extra, partial / EXTRA_FILENAME)
        _replace(path, partial)
    _barrier()
    return path


def _replace(path: Path, partial: Path) -> None:
    """Put ``partial`` at ``path``; the old directory is removed only after the swap."""
    for file in partial.iterdir():
        with open(file, "rb") as stream:
            os.fsync(stream.fileno())
    previous = path.parent / f".{path.name}.previous"
    shutil.rmtree(previous, ignore_errors=True)
    if path.exists():
        os.replace(path, previous)
    os.replace(partial, path)
    shutil.rmtree(previous, ignore_errors=True)
