"""A checkpoint directory on disk: its files, DCP reads and writes, and atomic replacement.

A save writes into the hidden sibling ``.NAME.partial``; the manifest is
written last, and only then does the directory take ``NAME``'s place. The
replacement is two renames (``NAME`` → ``.NAME.previous``, partial →
``NAME``, undone if the second fails), so at every instant ``NAME`` or
the complete partial holds a complete checkpoint, and
:func:`locate_checkpoint` finds the partial by itself after a crash
between the renames. Saving over a directory that is not a checkpoint is
refused: its files would be deleted.

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
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner

from ..collectives import CommContext
from .checkpoint_error import CheckpointError
from .disk_space import planned_bytes
from .manifest import MANIFEST_FILENAME, Manifest, check_item, item_digests

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
    return dirs.path.is_dir() or (not dirs.path.exists() and is_complete(dirs.partial))


def locate_checkpoint(path: str | os.PathLike) -> Path:
    """The directory holding the checkpoint saved at ``path``.

    ``path`` itself, unless a save was interrupted between its two renames:
    then the complete new copy (``.NAME.partial``), with a warning naming it.
    A ``.NAME.previous`` is never loaded by itself: after a failed save the
    previous checkpoint is back at ``path``, so a lone previous copy means
    ``path`` was removed on purpose.
    """
    dirs = CheckpointDirs.of(path)
    if dirs.path.is_file():
        raise CheckpointError(
            f"{dirs.path} is a file, not a sharded checkpoint directory; full weights (.safetensors, .pt, "
            ".ckpt) load with load_full_state_dict."
        )
    if dirs.path.exists():
        return dirs.path
    if is_complete(dirs.partial):
        warnings.warn(
            f"{dirs.path} is missing: a save was interrupted between its two renames. Loading the complete "
            f"new copy from {dirs.partial}.",
            stacklevel=3,
        )
        return dirs.partial
    hint = ""
    if is_complete(dirs.previous):
        hint = f" An older copy remains at {dirs.previous}; rename it to {dirs.path.name} to load it."
    elif dirs.partial.exists():
        hint = f" A save into it was interrupted before it completed ({dirs.partial} is incomplete)."
    raise CheckpointError(f"{dirs.path} is not a checkpoint: the directory does not exist.{hint}")


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint and whatever an interrupted save left beside it."""
    for directory in CheckpointDirs.of(path):
        if directory.exists() or directory.is_symlink():
            _remove(directory)


if not hasattr(FileSystemReader, "_slice_file"):  # where every item's bytes pass; verified there
    raise ImportError(
        "lightning-zero needs torch.distributed.checkpoint.FileSystemReader._slice_file (torch 2.4-2.13)."
    )


class SafeReader(FileSystemReader):
    """DCP's file reader, handed metadata that was already verified and parsed, and checking the
    bytes of every item it reads against the manifest before torch.load sees them."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata, manifest: Manifest):
        super().__init__(path)
        self._directory = Path(path)
        self._verified_metadata = metadata
        self._item_digests = item_digests(manifest)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = self._verified_metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: IO[bytes], sinfo: Any) -> IO[bytes]:
        name = sinfo.relative_path
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        check_item(self._directory / name, self._item_digests[name], sinfo.offset, data)
        check_stored_zip(self._directory / name, sinfo.offset, data)
        return io.BytesIO(data)


def check_stored_zip(file: Path, offset: int, data: bytes) -> None:
    """An item is a torch.save zip whose records are stored, not compressed: a deflated
    record could inflate a thousandfold inside torch.load before any size check."""
    where = f"{file} (bytes {offset}..{offset + len(data)})"
    try:
        records = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except zipfile.BadZipFile as error:
        raise CheckpointError(f"{where} is not a torch.save archive ({error}).") from error
    if any(r.compress_type != zipfile.ZIP_STORED for r in records) or sum(r.file_size for r in records) > len(data):
        raise CheckpointError(
            f"{where} holds compressed records, which lightning-zero never writes; refusing to inflate them."
        )


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading pickled objects with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own helper

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_shards(directory: Path, metadata: dcp_metadata.Metadata, manifest: Manifest, state: dict[str, Any]) -> None:
    """Fill ``state`` (tensors and checkpointable views, in place) from the directory.

    Every rank reads on its own (no collectives inside DCP), verifying each
    item's bytes as it reads them: the ranks agree on the outcome afterwards,
    so a failure on one is an error on all.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        dcp.load(
            state,
            storage_reader=SafeReader(directory, metadata, manifest),
            planner=SafeLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )


class _PlannedWriter(FileSystemWriter):
    """DCP's file writer, first telling ``planned`` the bytes of this rank's final plan (after DCP dropped
    the duplicates other ranks write): what a message about a full disk says the save needed."""

    def __init__(self, directory: Path, planned: Callable[[int], None], **options: Any):
        super().__init__(directory, **options)
        self._planned = planned

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        self._planned(planned_bytes(plan.items))
        return super().write_data(plan, planner)


def write_shards(
    directory: Path,
    state: dict[str, Any],
    comm: CommContext | None,
    in_order: bool = False,
    planned: Callable[[int], None] = lambda size: None,
) -> dcp_metadata.Metadata:
    """Every rank writes its pieces; rank 0 writes ``.metadata``. Returns the metadata, on every rank.
    ``in_order`` (state read from the NVMe tier's files a unit at a time): the pieces are read in the state
    dict's order (DCP's copy-ahead on a GPU takes them by size), each into a file of its own, synced as it is
    written: DCP keeps every piece of a file alive until the file is written, and a file's unsynced pages
    are memory a cap counts too. ``planned`` hears the bytes this rank is about to write."""
    alone = comm is None or comm.world_size == 1
    if in_order:
        writer = _PlannedWriter(directory, planned, single_file_per_rank=False, per_thread_copy_ahead=0)
    else:
        writer = _PlannedWriter(directory, planned)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return dcp.save(
            state,
            storage_writer=writer,
            process_group=None if alone else comm.group,
            no_dist=alone,
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


def _check_target(dirs: CheckpointDirs) -> None:
    """Refuse to replace a directory that is not a checkpoint: its files would be deleted."""
    path = dirs.path
    if path.is_dir() and not path.is_symlink() and any(path.iterdir()):
        if not (is_complete(path) or (path / METADATA_FILENAME).is_file()):
            raise CheckpointError(
                f"Refusing to save to {path}: it is a directory holding other files, not a checkpoint "
                f"(no {MANIFEST_FILENAME} or {METADATA_FILENAME}); saving would delete them. Choose another "
                "path, or remove it first."
            )


def prepare_partial(dirs: CheckpointDirs) -> None:
    """An empty partial directory; a leftover one from an interrupted save goes first."""
    _check_target(dirs)
    dirs.path.parent.mkdir(parents=True, exist_ok=True)
    if is_complete(dirs.partial) and not dirs.path.exists():
        # A crash between the two renames left the newest checkpoint here: finish that replacement first.
        os.replace(dirs.partial, dirs.path)
    if dirs.partial.exists():
        _remove(dirs.partial)
    dirs.partial.mkdir()


def replace_with_partial(dirs: CheckpointDirs) -> None:
    """Put the complete partial at ``path``; the old checkpoint is removed only after the swap,
    and put back if the swap fails."""
    fsync_directory(dirs.partial)
    if dirs.previous.exists() or dirs.previous.is_symlink():
        _remove(dirs.previous)  # a leftover: path, or else the complete partial, holds the checkpoint
    moved_aside = dirs.path.exists() or dirs.path.is_symlink()
    if moved_aside:
        os.replace(dirs.path, dirs.previous)
    try:
        os.replace(dirs.partial, dirs.path)
    except BaseException:
        if moved_aside:
            os.replace(dirs.previous, dirs.path)
        raise
    fsync_directory(dirs.path.parent)
    try:
        _remove(dirs.previous)
    except OSError:
        pass  # never loaded by itself; the next save removes it


def discard_partial(dirs: CheckpointDirs) -> None:
    """After a failed save: remove the partial directory unless it is the newest complete copy
    (a failed replacement whose undo failed too)."""
    newest = is_complete(dirs.partial) and not dirs.path.exists()
    if dirs.partial.exists() and not newest:
        shutil.rmtree(dirs.partial, ignore_errors=True)
