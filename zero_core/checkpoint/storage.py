"""A checkpoint directory on disk: its files, DCP reads and writes, and atomic replacement.

A save writes into the hidden sibling ``.NAME.partial``; the manifest is
written last, and only then does the directory take ``NAME``'s place. The
replacement is two renames (``NAME`` → ``.NAME.previous``, partial →
``NAME``), so at every instant ``NAME``, a complete partial or the
previous copy holds a complete checkpoint, and :func:`locate_checkpoint`
finds it by itself after a crash between the renames.

Reading: DCP's ``.metadata`` is parsed from verified bytes with the
allow-listed unpickler; tensors are read by DCP with
``torch.load(weights_only=True)``, and pickled objects (param groups) with
``weights_only=True`` too, instead of DCP's default ``False``.
"""

from __future__ import annotations

import io
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from ..collectives import CommContext
from .errors import CheckpointError
from .manifest import MANIFEST_FILENAME, is_plain_file_name

METADATA_FILENAME = ".metadata"
EXTRA_FILENAME = "meta.pt"  # the name Lightning's consolidation tool reads user state from


class CheckpointDirs(NamedTuple):
    """``path`` and the hidden siblings a save uses beside it."""

    path: Path
    partial: Path
    previous: Path

    @classmethod
    def of(cls, path: str | os.PathLike) -> "CheckpointDirs":
        path = Path(path).absolute()
        return cls(path, path.parent / f".{path.name}.partial", path.parent / f".{path.name}.previous")


def is_complete(directory: Path) -> bool:
    """The manifest is written last: its presence marks a finished save."""
    return (directory / MANIFEST_FILENAME).is_file()


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A directory, or a path whose save was interrupted between its renames (not a single file)."""
    dirs = CheckpointDirs.of(path)
    return dirs.path.is_dir() or (not dirs.path.exists() and (is_complete(dirs.partial) or is_complete(dirs.previous)))


def locate_checkpoint(path: str | os.PathLike) -> Path:
    """The directory holding the checkpoint saved at ``path``.

    ``path`` itself, unless a save was interrupted between its two renames:
    then the complete new copy (``.NAME.partial``) or the previous one
    (``.NAME.previous``), with a warning naming it.
    """
    dirs = CheckpointDirs.of(path)
    if dirs.path.exists():
        return dirs.path
    for candidate, which in ((dirs.partial, "the complete new copy"), (dirs.previous, "the previous checkpoint")):
        if is_complete(candidate):
            warnings.warn(
                f"{dirs.path} is missing: a save was interrupted while replacing it. Loading {which} from {candidate}.",
                stacklevel=3,
            )
            return candidate
    hint = ""
    if dirs.partial.exists():
        hint = f" A save into it was interrupted before it completed ({dirs.partial} is incomplete and no earlier checkpoint is left)."
    raise CheckpointError(f"{dirs.path} is not a checkpoint: the directory does not exist.{hint}")


def check_storage_paths(directory: Path, metadata: dcp_metadata.Metadata, manifest_files: set[str]) -> list[str]:
    """The data files the metadata reads, each a plain name the manifest covers (nothing outside the directory)."""
    names = set()
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not is_plain_file_name(name) or name not in manifest_files:
            raise CheckpointError(f"{directory / METADATA_FILENAME} names a data file {name!r} that is not part of this checkpoint.")
        names.add(name)
    return sorted(names)


class SafeReader(FileSystemReader):
    """DCP's file reader, handed metadata that was already verified and parsed."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata):
        super().__init__(path)
        self._verified_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = self._verified_metadata
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


def read_shards(directory: Path, metadata: dcp_metadata.Metadata, state: dict[str, Any]) -> None:
    """Fill ``state`` (tensors and checkpointable views, in place) from the directory.

    Every rank reads on its own (no collectives inside DCP): the ranks agree
    on the outcome afterwards, so a failure on one is an error on all.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        dcp.load(state, storage_reader=SafeReader(directory, metadata),
                 planner=SafeLoadPlanner(allow_partial_load=True), no_dist=True)


def write_shards(directory: Path, state: dict[str, Any], comm: CommContext | None) -> dcp_metadata.Metadata:
    """Every rank writes its pieces; rank 0 writes ``.metadata``. Returns the metadata, on every rank."""
    alone = comm is None or comm.world_size == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return dcp.save(
            state, storage_writer=FileSystemWriter(directory), process_group=None if alone else comm.group, no_dist=alone
        )


def fsync_directory(directory: Path) -> None:
    """Make renames and new files in ``directory`` durable (POSIX; skipped where unsupported)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def prepare_partial(dirs: CheckpointDirs) -> None:
    """An empty partial directory; a leftover one from an interrupted save goes first."""
    dirs.path.parent.mkdir(parents=True, exist_ok=True)
    if is_complete(dirs.partial) and not dirs.path.exists():
        # A crash between the two renames left the newest checkpoint here: finish that replacement first.
        os.replace(dirs.partial, dirs.path)
    if dirs.partial.exists():
        _remove(dirs.partial)
    dirs.partial.mkdir()


def replace_with_partial(dirs: CheckpointDirs) -> None:
    """Put the complete partial at ``path``; the old checkpoint is removed only after the swap."""
    fsync_directory(dirs.partial)
    if dirs.previous.exists():
        _remove(dirs.previous)  # path, or else the complete partial, still holds a checkpoint
    if dirs.path.exists() or dirs.path.is_symlink():
        os.replace(dirs.path, dirs.previous)
    os.replace(dirs.partial, dirs.path)
    fsync_directory(dirs.path.parent)
    try:
        _remove(dirs.previous)
    except OSError:
        pass  # a leftover previous copy is harmless; the next save removes it


def discard_partial(dirs: CheckpointDirs) -> None:
    """After a failed save: remove the partial directory unless it is the only complete copy."""
    only_copy = is_complete(dirs.partial) and not dirs.path.exists() and not is_complete(dirs.previous)
    if dirs.partial.exists() and not only_copy:
        shutil.rmtree(dirs.partial, ignore_errors=True)
