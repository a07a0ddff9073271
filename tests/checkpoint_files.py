"""Helpers for tests that tamper with checkpoint directories as an adversary or a failing disk would."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from zero_core.checkpoint import load_full_checkpoint
from zero_core.checkpoint.manifest import Manifest, digest_data_file, read_manifest, write_manifest
from zero_core.checkpoint.unpickling import MetadataUnpickler


def resign(directory: Path) -> None:
    """Recompute the manifest over the files as they are now: what an adversary who
    edits a checkpoint would do, so the checks behind the checksums are reached."""
    manifest = read_manifest(directory)
    ranges: dict[str, list[tuple[int, int]]] = {}
    try:
        for info in read_metadata(directory).storage_data.values():
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    except Exception:  # noqa: BLE001 - a hostile .metadata: whole-file digests only
        pass
    names = set(manifest.files) | {p.name for p in directory.iterdir() if p.name.endswith(".distcp")}
    files = {
        name: digest_data_file(directory / name, ranges.get(name, [])) for name in names if (directory / name).exists()
    }
    write_manifest(directory, Manifest(manifest.save_id, files))


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    return target


def largest_shard(directory: Path) -> Path:
    return max(directory.glob("*.distcp"), key=lambda f: f.stat().st_size)


def flip_bytes(file: Path, offset: int, count: int = 4) -> None:
    with open(file, "r+b") as stream:
        stream.seek(offset)
        original = stream.read(count)
        stream.seek(offset)
        stream.write(bytes(b ^ 0xFF for b in original))


def read_metadata(directory: Path):  # type: ignore[no-untyped-def]
    with open(directory / ".metadata", "rb") as stream:
        return MetadataUnpickler(stream).load()


def write_metadata(directory: Path, metadata: object) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


@contextmanager
def tmpfs(mount_point: Path, size_bytes: int) -> Iterator[bool]:
    """A real small filesystem at ``mount_point`` (yields False where mounting is not allowed)."""
    mount_point.mkdir(parents=True, exist_ok=True)
    size_kib = max(64, size_bytes // 1024)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount_point)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def remount_read_only(mount_point: Path) -> bool:
    return subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], capture_output=True).returncode == 0


def directory_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    if isinstance(tree, list):
        return _flatten(dict(enumerate(tree)), prefix)
    return {prefix[:-1]: tree}


def assert_same_checkpoint(original: Path, reloaded: Path, state_key: str | None = "exp_avg_sq") -> None:
    """Every tensor and value of the model and the optimizer (its ``state_key`` among them: Adam's second
    moment, Muon's momentum; None: a directory without the optimizer) equal, bit for bit: what a load followed
    by a save must give back."""
    before, after = _flatten(load_full_checkpoint(original)), _flatten(load_full_checkpoint(reloaded))
    assert before.keys() == after.keys()
    if state_key is None:
        assert any(k.startswith("model.") for k in before) and not any(k.startswith("optimizer_0.") for k in before)
    else:
        assert any(k.startswith("optimizer_0.state.") and k.endswith(state_key) for k in before)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), f"{key} changed in a load/save round trip"
        else:
            assert value == after[key], key
