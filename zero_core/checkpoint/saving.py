"""Saving a sharded model and optimizer as a DCP directory, all or nothing, agreed on every rank.

Layout (the one Lightning's FSDP strategy writes, so
``python -m lightning.pytorch.utilities.consolidate_checkpoint`` reads it):
DCP keys ``model`` and ``optimizer_0``; ``meta.pt`` with the caller's extra
state and the engine's record (``zero``); ``zero-manifest.json`` with every
file's checksum and the save's identity, written last.

Steps, each agreed across ranks before the next (see ``agreed_steps.py``):
prepare the hidden partial directory (rank 0), collect the state, write
the shards (DCP, every rank), checksum and sync them (split between
ranks), write ``meta.pt`` and the manifest (rank 0), replace the old
checkpoint (rank 0). A failure removes the partial directory and raises
the same :class:`CheckpointError` everywhere; the previous checkpoint is
untouched. A filesystem that fills up is named as full, with the bytes it
had free and the bytes the save writes (``disk_space.py``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..collectives import CommContext
from .agreed_steps import RankAgreement
from .checkpoint_error import CheckpointError
from .checkpoint_records import MODEL_KEY, OPTIMIZER_KEY, ZERO_KEY, EngineRecord, ShardedModel
from .directory import (
    EXTRA_FILENAME,
    METADATA_FILENAME,
    CheckpointDirs,
    discard_partial,
    prepare_partial,
    replace_with_partial,
    write_shards,
)
from .disk_space import SaveSpace
from .manifest import FileDigest, Manifest, digest_bytes, digest_data_file, write_manifest
from .state_dicts import sharded_model_state_dict, sharded_optimizer_state_dict
from .unpickling import refusal_reason, unpickle_metadata, weights_only_load


def sharded_state(view: ShardedModel, with_model: bool = True, with_optimizer: bool = True) -> dict[str, Any]:
    """The DCP state dict: the model's and the optimizer's, as views of this rank's shards."""
    state: dict[str, Any] = {}
    if with_model:
        state[MODEL_KEY] = sharded_model_state_dict(view.model, view.units, view.rank, resting=view.resting)
    if with_optimizer and view.optimizer is not None:
        state[OPTIMIZER_KEY] = sharded_optimizer_state_dict(
            view.optimizer, view.units, view.param_group_names, view.resting
        )
    return state


def save_checkpoint(
    comm: CommContext,
    path: str | os.PathLike,
    extra: dict[str, Any],
    record: EngineRecord,
    collect: Callable[[], dict[str, Any]],
    *,
    in_order: bool,
) -> Path:
    """``collect()`` gives the DCP state dict (``sharded_state``'s, or an asynchronous save's staged copy);
    ``in_order``: it reads state resting in the NVMe tier's files a unit at a time (``write_shards``)."""
    dirs = CheckpointDirs.of(path)
    agreement = RankAgreement(comm, f"saving checkpoint {dirs.path}")
    coordinator = agreement.rank == 0

    def prepare() -> str | None:
        if not coordinator:
            return None
        prepare_partial(dirs)
        return uuid.uuid4().hex

    _, save_ids = agreement.run("preparing the directory", prepare, share=True)
    # Measured by every rank before any writes (the writes wait for the next steps' agreement).
    space = agreement.space = SaveSpace(dirs.path, dirs.partial)
    try:
        meta = {**extra, ZERO_KEY: dataclasses.replace(record, save_id=save_ids[0]).to_dict()}
        meta_bytes, _ = agreement.run("checking the extra state", lambda: serialize_meta(meta) if coordinator else b"")
        space.add(len(meta_bytes))
        state, _ = agreement.run("collecting the state", collect)
        # A unit at a time when state rests on disk (written in the state dict's order, not by size).
        agreement.run("writing the shards", lambda: write_shards(dirs.partial, state, comm, in_order, space.add))
        # Every rank checksums the files that the written `.metadata` names (read back by the coordinator),
        # not those of the metadata DCP's save returns: on torch 2.11 that has no storage map (storage_data
        # None), the manifest listed no data file, and every load refused the checkpoint.
        _, listed = agreement.run(
            "listing the files", lambda: written_files(dirs.partial) if coordinator else None, share=True
        )
        _, shares = agreement.run(
            "checksumming the shards", lambda: checksum_share(dirs.partial, listed[0], agreement), share=True
        )
        digests: dict[str, FileDigest] = {name: digest for share in shares for name, digest in share.items()}

        def finish() -> None:
            if coordinator:
                _write_meta_and_manifest(dirs.partial, meta_bytes, Manifest(save_ids[0], digests))

        agreement.run("writing meta.pt and the manifest", finish)
        agreement.run("replacing the previous checkpoint", lambda: replace_with_partial(dirs) if coordinator else None)
    except CheckpointError:
        if coordinator:
            discard_partial(dirs)
        raise
    return dirs.path


def written_files(directory: Path) -> dict[str, list[tuple[int, int]]]:
    """The files of the save in ``directory`` (``.metadata`` too), as its ``.metadata`` names them, and the
    (offset, length) of each item stored in them."""
    metadata = unpickle_metadata((directory / METADATA_FILENAME).read_bytes(), directory / METADATA_FILENAME)
    ranges: dict[str, list[tuple[int, int]]] = {METADATA_FILENAME: []}
    for info in (metadata.storage_data or {}).values():
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    return ranges


def checksum_share(
    directory: Path, ranges: dict[str, list[tuple[int, int]]], agreement: RankAgreement
) -> dict[str, FileDigest]:
    """This rank's share of the files (each file once across ranks): synced, digested whole and
    item by item."""
    mine = sorted(ranges)[agreement.rank :: agreement.world_size]
    return {name: digest_data_file(directory / name, ranges[name], sync=True) for name in mine}


def serialize_meta(meta: dict[str, Any]) -> bytes:
    """``meta.pt``'s bytes, refused now (before any shard is written) if they could not be loaded safely."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    data = buffer.getvalue()
    try:
        weights_only_load(data)
    except Exception as error:  # noqa: BLE001 - whatever weights_only refuses
        raise CheckpointError(
            f"The extra state given to save_checkpoint holds objects that loading with weights_only=True "
            f"refuses ({refusal_reason(error)}), so the save was refused. Save plain types (numbers, strings, "
            "tensors, lists, dicts), or register your classes with torch.serialization.add_safe_globals."
        ) from error
    return data


def _write_meta_and_manifest(directory: Path, data: bytes, manifest: Manifest) -> None:
    with open(directory / EXTRA_FILENAME, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    files = {**manifest.files, EXTRA_FILENAME: digest_bytes(data)}
    write_manifest(directory, Manifest(manifest.save_id, files))
