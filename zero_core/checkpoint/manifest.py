"""Integrity of a checkpoint directory: every file's size and SHA-256, and the save's identity.

The manifest (``zero-manifest.json``) is written last, after every other
file of the save is complete and synced, so its presence marks a complete
save. It is JSON, not a pickle: reading it runs nothing. It carries a
digest of its own body, so a damaged manifest is told apart from damaged
data. Names in it are plain file names (no separators, no ``..``), so a
hostile manifest cannot point a load outside the directory.

Data files also record a digest per DCP item (a byte range): readers check
exactly the bytes they read, as they read them (one item in memory at a
time, no second pass over the files), so a rank's stale or local copy of a
file cannot slip past a check another rank made. Saving computes both in
one sequential pass, the files split between ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import NamedTuple

from ..settings import is_count
from .checkpoint_error import CheckpointError

MANIFEST_FILENAME = "zero-manifest.json"
MANIFEST_FORMAT = 1
_MAX_MANIFEST_BYTES = 64 << 20  # a hostile size must not exhaust memory
_CHUNK_BYTES = 8 << 20
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


class FileDigest(NamedTuple):
    size: int
    sha256: str
    # For a data file: (offset, length, sha256) of each DCP item in it, so a reader can
    # verify exactly the bytes it reads, as it reads them.
    items: tuple[tuple[int, int, str], ...] = ()


class Manifest(NamedTuple):
    save_id: str
    files: dict[str, FileDigest]


def digest_bytes(data: bytes) -> FileDigest:
    return FileDigest(len(data), hashlib.sha256(data).hexdigest())


def digest_data_file(file: Path, ranges: list[tuple[int, int]], *, sync: bool = False) -> FileDigest:
    """The file's size and SHA-256 and each item's (byte ranges, as DCP wrote them), in one
    sequential pass; ``sync`` also flushes the file to disk first."""
    whole = hashlib.sha256()
    items = []
    with open(file, "rb") as stream:
        if sync:
            os.fsync(stream.fileno())
        position = 0
        for offset, length in sorted(ranges):
            if offset > position:
                whole.update(stream.read(offset - position))  # bytes between items, if any
            data = stream.read(length)
            whole.update(data)
            items.append((offset, length, hashlib.sha256(data).hexdigest()))
            position = offset + length
        while chunk := stream.read(_CHUNK_BYTES):
            whole.update(chunk)
            position += len(chunk)
    return FileDigest(position, whole.hexdigest(), tuple(items))


def is_plain_file_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def _body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _file_entry(digest: FileDigest) -> dict:
    entry: dict = {"bytes": digest.size, "sha256": digest.sha256}
    if digest.items:
        entry["items"] = [list(item) for item in digest.items]
    return entry


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write, sync and then rename into place, so a half-written manifest never exists."""
    body = {
        "format": MANIFEST_FORMAT,
        "save_id": manifest.save_id,
        "files": {name: _file_entry(d) for name, d in sorted(manifest.files.items())},
    }
    text = json.dumps({**body, "manifest_sha256": _body_digest(body)}, indent=1, sort_keys=True)
    temporary = directory / f".{MANIFEST_FILENAME}.tmp"
    with open(temporary, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, directory / MANIFEST_FILENAME)


def read_manifest(directory: Path) -> Manifest:
    """The validated manifest, or CheckpointError saying what is wrong with it."""
    file = directory / MANIFEST_FILENAME
    if file.is_symlink():
        raise CheckpointError(f"{file} is a symbolic link; a checkpoint's files must be its own.")
    if not file.is_file():
        raise CheckpointError(
            f"{directory} is not a complete lightning-zero checkpoint: {MANIFEST_FILENAME} is missing "
            "(a save that did not finish, or a directory another tool wrote)."
        )
    if file.stat().st_size > _MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{file} is corrupt: {file.stat().st_size} bytes is far too large for a manifest.")
    try:
        document = json.loads(file.read_bytes())
        return _parse(document)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise CheckpointError(f"{file} is corrupt ({type(error).__name__}: {error}).") from error


def _parse(document: dict) -> Manifest:
    expected_keys = {"format", "save_id", "files", "manifest_sha256"}
    if not isinstance(document, dict) or set(document) != expected_keys:
        raise ValueError(f"expected exactly the keys {sorted(expected_keys)}")
    if document["format"] != MANIFEST_FORMAT:
        raise ValueError(f"format {document['format']!r} is not {MANIFEST_FORMAT}; a newer lightning-zero wrote it?")
    body = {k: v for k, v in document.items() if k != "manifest_sha256"}
    if document["manifest_sha256"] != _body_digest(body):
        raise ValueError("its own checksum does not match its contents")
    if not isinstance(document["save_id"], str) or not isinstance(document["files"], dict):
        raise ValueError("save_id must be a string and files a mapping")
    files = {}
    for name, entry in document["files"].items():
        if (
            not is_plain_file_name(name)
            or not isinstance(entry, dict)
            or not set(entry) <= {"bytes", "sha256", "items"}
        ):
            raise ValueError(f"the entry for {name!r} is malformed")
        size, sha256 = entry["bytes"], entry["sha256"]
        items = tuple(tuple(item) for item in entry.get("items", ()))
        well_formed = (
            is_count(size, 0)
            and _is_digest(sha256)
            and all(
                len(item) == 3 and is_count(item[0], 0) and is_count(item[1], 0) and _is_digest(item[2])
                for item in items
            )
        )
        if not well_formed:
            raise ValueError(f"the entry for {name} is malformed")
        files[name] = FileDigest(size, sha256, items)  # type: ignore[arg-type]
    return Manifest(document["save_id"], files)


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and _HEX_DIGEST.fullmatch(value) is not None


def _check(file: Path, expected: FileDigest, actual: FileDigest) -> None:
    if actual.size != expected.size:
        state = "truncated" if actual.size < expected.size else "longer than saved"
        raise CheckpointError(f"{file} is {state} ({actual.size} bytes, the manifest records {expected.size}).")
    if actual.sha256 != expected.sha256:
        raise CheckpointError(f"{file} does not match its checksum: it is corrupt, or it comes from another save.")


def expected_digest(directory: Path, manifest: Manifest, name: str) -> FileDigest:
    if name not in manifest.files:
        raise CheckpointError(
            f"{directory / name} is not listed in {MANIFEST_FILENAME}; the checkpoint is inconsistent."
        )
    return manifest.files[name]


def check_present(directory: Path, manifest: Manifest, name: str) -> None:
    """``name`` is a regular file of the recorded size (not a link that could lead outside)."""
    expected = expected_digest(directory, manifest, name)
    file = directory / name
    if file.is_symlink():
        raise CheckpointError(f"{file} is a symbolic link; a checkpoint's files must be its own.")
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the checkpoint is incomplete.")
    size = file.stat().st_size
    if size != expected.size:
        _check(file, expected, FileDigest(size, ""))


def item_digests(manifest: Manifest) -> dict[str, dict[tuple[int, int], str]]:
    """Per data file: (offset, length) -> the item's SHA-256, for lookups while reading."""
    return {name: {(o, n): digest for o, n, digest in d.items} for name, d in manifest.files.items()}


def check_item(file: Path, recorded_items: dict[tuple[int, int], str], offset: int, data: bytes) -> None:
    """The bytes read for one DCP item match the digest recorded for them."""
    recorded = recorded_items.get((offset, len(data)))
    if recorded is None:
        raise CheckpointError(
            f"{file}: no checksum is recorded for bytes {offset}..{offset + len(data)}; the checkpoint is inconsistent."
        )
    if hashlib.sha256(data).hexdigest() != recorded:
        raise CheckpointError(
            f"{file} does not match its checksum (bytes {offset}..{offset + len(data)}): it is corrupt, or it "
            "comes from another save."
        )


def read_verified(directory: Path, manifest: Manifest, name: str) -> bytes:
    """A small file's bytes, checked against the manifest; what is parsed is what was checked."""
    check_present(directory, manifest, name)
    data = (directory / name).read_bytes()
    file = directory / name
    expected = manifest.files[name]
    _check(file, expected, digest_bytes(data))
    return data
