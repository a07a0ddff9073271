"""Integrity of a checkpoint directory: every file's size and SHA-256, and the save's identity.

The manifest (``zero-manifest.json``) is written last, after every other
file of the save is complete and synced, so its presence marks a complete
save. It is JSON, not a pickle: reading it runs nothing. It carries a
digest of its own body, so a damaged manifest is told apart from damaged
data. Names in it are plain file names (no separators, no ``..``), so a
hostile manifest cannot point a load outside the directory.

Verification streams each file in fixed-size chunks (no copy of the model
in memory); the data files are split between ranks, so together they read
each byte once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import NamedTuple

from .errors import CheckpointError

MANIFEST_FILENAME = "zero-manifest.json"
MANIFEST_FORMAT = 1
_MAX_MANIFEST_BYTES = 64 << 20  # a hostile size must not exhaust memory
_CHUNK_BYTES = 8 << 20
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


class FileDigest(NamedTuple):
    size: int
    sha256: str


class Manifest(NamedTuple):
    save_id: str
    files: dict[str, FileDigest]


def digest_bytes(data: bytes) -> FileDigest:
    return FileDigest(len(data), hashlib.sha256(data).hexdigest())


def digest_file(file: Path, *, sync: bool = False) -> FileDigest:
    """Size and SHA-256 of ``file``, streamed; ``sync`` also flushes it to disk first."""
    with open(file, "rb") as stream:
        if sync:
            os.fsync(stream.fileno())
        digest = hashlib.file_digest(stream, "sha256")
        return FileDigest(stream.tell(), digest.hexdigest())


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


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write, sync and then rename into place, so a half-written manifest never exists."""
    body = {
        "format": MANIFEST_FORMAT,
        "save_id": manifest.save_id,
        "files": {name: {"bytes": d.size, "sha256": d.sha256} for name, d in sorted(manifest.files.items())},
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
        if not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not a plain file name")
        size, sha256 = entry["bytes"], entry["sha256"]
        if not (isinstance(size, int) and size >= 0 and isinstance(sha256, str) and _HEX_DIGEST.fullmatch(sha256)):
            raise ValueError(f"the entry for {name} is malformed")
        files[name] = FileDigest(size, sha256)
    return Manifest(document["save_id"], files)


def _check(file: Path, expected: FileDigest, actual: FileDigest) -> None:
    if actual.size != expected.size:
        state = "truncated" if actual.size < expected.size else "longer than saved"
        raise CheckpointError(f"{file} is {state} ({actual.size} bytes, the manifest records {expected.size}).")
    if actual.sha256 != expected.sha256:
        raise CheckpointError(f"{file} does not match its checksum: it is corrupt, or it comes from another save.")


def expected_digest(directory: Path, manifest: Manifest, name: str) -> FileDigest:
    if name not in manifest.files:
        raise CheckpointError(f"{directory / name} is not listed in {MANIFEST_FILENAME}; the checkpoint is inconsistent.")
    return manifest.files[name]


def verify_file(directory: Path, manifest: Manifest, name: str) -> None:
    """Stream ``name`` and compare it with the manifest; CheckpointError naming the file otherwise."""
    expected = expected_digest(directory, manifest, name)
    file = directory / name
    if not file.is_file():
        raise CheckpointError(f"{directory / name} is missing; the checkpoint is incomplete.")
    _check(file, expected, digest_file(file))


def read_verified(directory: Path, manifest: Manifest, name: str) -> bytes:
    """A small file's bytes, checked against the manifest; what is parsed is what was checked."""
    expected = expected_digest(directory, manifest, name)
    file = directory / name
    if not file.is_file():
        raise CheckpointError(f"{directory / name} is missing; the checkpoint is incomplete.")
    if file.stat().st_size != expected.size:
        _check(file, expected, FileDigest(file.stat().st_size, ""))
    data = file.read_bytes()
    _check(file, expected, digest_bytes(data))
    return data
