"""Checkpoints you can trust, attacked as an adversary or a failing disk would (2 ranks).

Loads: a damaged, substituted, hostile or incomplete checkpoint fails with
the same CheckpointError on every rank, naming the file, and leaves the
model, optimizer and step counter bit-identical; an interrupted replacement
is recovered by itself. Saves: a failure anywhere (disk full, permission
denied, a failed write on one rank, a failed rename, a rank that stopped)
raises the same CheckpointError on every rank, root cause first, never
returns normally on any rank, removes its partial directory, and leaves the
previous checkpoint loading bit-identically. Each spawn runs a whole grid.
"""

from __future__ import annotations

import copy
import errno
import os
import pickle
import re
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from tests import checkpoint_files as files
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import by_rank, run_distributed
from tests.workers import config_for
from zero_core import CheckpointError, ZeroEngine
from zero_core.checkpoint import directory, saving


def _engine() -> tuple[TinyTransformer, ZeroEngine]:
    torch.manual_seed(0)
    model = TinyTransformer(blocks=3, width=16)
    return model, ZeroEngine(model, make_optimizer("adamw", model), config_for(3))


def _train(model: TinyTransformer, engine: ZeroEngine, steps: range) -> None:
    for step in steps:
        ids = batch(step, engine.rank)
        engine.backward(lm_loss(model(ids), ids))
        engine.step()


def _snapshot(engine: ZeroEngine) -> dict[str, Any]:
    """Everything a load may change: full weights, this rank's optimizer state and settings, the step counter."""
    optimizer = engine.optimizer
    assert optimizer is not None
    # torch's own state dict: this rank's master pieces' state and every group's settings.
    state = copy.deepcopy(optimizer.state_dict())
    assert state["state"], "the snapshot must hold optimizer state to compare"
    return {"weights": engine.full_state_dict(), "optimizer": state, "steps": engine.steps_taken}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ------------------------------------------------------------------ saving the baselines
def _save_baselines(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, engine = _engine()
    _train(model, engine, range(3))
    engine.save_checkpoint(Path(root) / "good", extra={"epoch": 3})
    good = _snapshot(engine)
    _train(model, engine, range(3, 4))
    engine.save_checkpoint(Path(root) / "other", extra={"epoch": 4})
    return good


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("baselines")
    return root, run_distributed(_save_baselines, 2, str(root))


# ------------------------------------------------------------------ loads that must fail
class _RunsCode:
    """Unpickling this runs a shell command that leaves a file behind."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.sentinel}",))


def _meta(directory: Path) -> dict[str, Any]:
    return torch.load(directory / "meta.pt", weights_only=True)


def _corruptions(good: Path, other: Path, sentinel: Path) -> dict[str, tuple[Any, str]]:
    """name -> (what to do to a copy of ``good``, what the error must say)."""

    def resigned(action):  # type: ignore[no-untyped-def]
        def both(d: Path) -> None:
            action(d)
            files.resign(d)

        return both

    def shard_name(d: Path) -> str:
        return files.largest_shard(d).name

    def escape(d: Path) -> None:
        metadata = files.read_metadata(d)
        info = next(iter(metadata.storage_data.values()))
        info.relative_path = "../escape.distcp"
        files.write_metadata(d, metadata)

    def meta_from_other(d: Path) -> None:
        shutil.copy(other / "meta.pt", d / "meta.pt")

    def meta_without_record(d: Path) -> None:
        torch.save({k: v for k, v in _meta(d).items() if k != "zero"}, d / "meta.pt")

    def broken_zip_late_in_shard(d: Path) -> None:
        shard = files.largest_shard(d)
        files.flip_bytes(shard, shard.stat().st_size - 200, 16)  # a zip directory near the end: read last

    return {
        "flipped bytes in a shard": (
            lambda d: files.flip_bytes(files.largest_shard(d), files.largest_shard(d).stat().st_size // 2),
            "it is corrupt, or it comes from another save",
        ),
        "a shard from another save": (
            lambda d: shutil.copy(other / shard_name(d), d / shard_name(d)),
            "does not match its checksum",
        ),
        "truncated shard": (
            lambda d: os.truncate(files.largest_shard(d), files.largest_shard(d).stat().st_size // 2),
            "is truncated",
        ),
        "deleted shard": (
            lambda d: files.largest_shard(d).unlink(),
            ".distcp is missing; the checkpoint is incomplete",
        ),
        "meta.pt deleted": (lambda d: (d / "meta.pt").unlink(), "meta.pt is missing"),
        "meta.pt emptied": (lambda d: (d / "meta.pt").write_bytes(b""), "meta.pt is truncated (0 bytes"),
        "meta.pt emptied, manifest re-signed": (
            resigned(lambda d: (d / "meta.pt").write_bytes(b"")),
            "meta.pt is empty",
        ),
        "meta.pt garbage, manifest re-signed": (
            resigned(lambda d: (d / "meta.pt").write_bytes(b"PK\x03\x04garbage")),
            "meta.pt is corrupt",
        ),
        "meta.pt runs code, manifest re-signed": (
            resigned(lambda d: torch.save({**_meta(d), "hook": _RunsCode(sentinel)}, d / "meta.pt")),
            "meta.pt holds objects that only arbitrary code could rebuild",
        ),
        "meta.pt from another save, manifest re-signed": (
            resigned(meta_from_other),
            "comes from another save than the rest",
        ),
        "meta.pt without our record, manifest re-signed": (resigned(meta_without_record), "it has no 'zero' entry"),
        "manifest deleted": (lambda d: (d / "zero-manifest.json").unlink(), "zero-manifest.json is missing"),
        "manifest damaged": (
            lambda d: files.flip_bytes(d / "zero-manifest.json", 40, 1),
            "zero-manifest.json is corrupt",
        ),
        ".metadata runs code, manifest re-signed": (
            resigned(lambda d: (d / ".metadata").write_bytes(pickle.dumps(_RunsCode(sentinel)))),
            "refusing to load posix.system",
        ),
        ".metadata points outside the directory, manifest re-signed": (
            resigned(escape),
            "names a data file '../escape.distcp' that is not part of this checkpoint",
        ),
        "a shard breaks half-way through reading, manifest re-signed": (
            resigned(broken_zip_late_in_shard),
            "failed while reading the shards",
        ),
    }


def _try_loads(
    rank: int, world_size: int, good: str, cases: list[tuple[str, str]], recoveries: list[tuple[str, str]]
) -> dict[str, Any]:
    model, engine = _engine()
    _train(model, engine, range(2))  # live state differs from every checkpoint
    out: dict[str, Any] = {}
    for name, path in cases:
        before = _snapshot(engine)
        try:
            engine.load_checkpoint(path)
            outcome = "loaded"
        except CheckpointError as error:
            outcome = str(error)
        out[name] = (outcome, _same(before, _snapshot(engine)))
    for name, path in recoveries:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = engine.load_checkpoint(path)
        out[name] = (extra, _snapshot(engine), [str(w.message) for w in caught])
        _train(model, engine, range(5, 6))
    # Gradients accumulated before a load never reach a step after it.
    engine.load_checkpoint(good)
    ids = batch(10, rank)
    engine.backward(lm_loss(model(ids), ids))
    engine.load_checkpoint(good)
    _train(model, engine, range(11, 12))
    after_interrupted_accumulation = engine.full_state_dict()
    engine.load_checkpoint(good)
    _train(model, engine, range(11, 12))
    out["accumulation"] = _same(after_interrupted_accumulation, engine.full_state_dict())
    engine.load_checkpoint(good)
    out["good"] = _snapshot(engine)
    return out


@pytest.fixture(scope="module")
def loads(saved: tuple, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root, baselines = saved
    work = tmp_path_factory.mktemp("loads")
    good, other = root / "good", root / "other"
    corruptions = _corruptions(good, other, work / "code-from-a-checkpoint-ran")
    cases = []
    for index, (name, (damage, _)) in enumerate(corruptions.items()):
        target = files.copy_checkpoint(good, work / f"case{index}")
        damage(target)
        cases.append((name, str(target)))
    cases.append(("no such directory", str(work / "nowhere")))
    (work / ".unfinished.partial").mkdir()
    cases.append(("only an unfinished save", str(work / "unfinished")))
    # What a crash between the two renames of a replacement leaves behind: the old copy
    # moved aside, the complete new one not yet in place.
    files.copy_checkpoint(other, work / ".swapped.previous")
    files.copy_checkpoint(good, work / ".swapped.partial")
    recoveries = [("complete partial copy", str(work / "swapped"))]
    # A lone previous copy is never loaded by itself (its checkpoint was removed on purpose), only named.
    files.copy_checkpoint(good, work / ".removed.previous")
    cases.append(("only a previous copy", str(work / "removed")))
    (work / "plain").mkdir()
    (work / "plain" / "notes.txt").write_text("not a checkpoint")
    cases.append(("a directory of other files", str(work / "plain")))
    (work / "weights.safetensors").write_bytes(b"{}")
    cases.append(("a file", str(work / "weights.safetensors")))
    results = run_distributed(_try_loads, 2, str(good), cases, recoveries, timeout=240)
    expected = {name: text for name, (_, text) in corruptions.items()}
    expected["no such directory"] = "the directory does not exist."
    expected["only an unfinished save"] = "was interrupted before it completed"
    expected["only a previous copy"] = "An older copy remains at"
    expected["a directory of other files"] = "zero-manifest.json is missing"
    expected["a file"] = "is a file, not a sharded checkpoint directory; full weights"
    return {"work": work, "expected": expected, "results": results, "baselines": baselines}


def test_every_damaged_checkpoint_fails_alike_on_every_rank_and_changes_nothing(loads: dict) -> None:
    results = loads["results"]
    for name, text in loads["expected"].items():
        (message, unchanged), (other_message, other_unchanged) = results[0][name], results[1][name]
        assert message == other_message, (name, message, other_message)
        assert text in message, (name, message)
        assert unchanged and other_unchanged, f"{name}: the failed load changed the training state"


def test_messages_name_the_file_and_skip_torchs_retry_advice(loads: dict) -> None:
    results = loads["results"]
    assert "__" in results[0]["flipped bytes in a shard"][0] and ".distcp" in results[0]["flipped bytes in a shard"][0]
    refused = results[0]["meta.pt runs code, manifest re-signed"][0]
    assert "posix.system" in refused and "weights_only` set to `False`" not in refused
    assert "previous checkpoint" not in results[0]["no such directory"][0]


def test_no_code_from_a_checkpoint_ran(loads: dict) -> None:
    assert not (loads["work"] / "code-from-a-checkpoint-ran").exists()


def test_interrupted_replacement_is_recovered_by_itself(loads: dict) -> None:
    results, baselines = loads["results"], loads["baselines"]
    for rank in range(2):
        for name, place in (("complete partial copy", ".swapped.partial"),):
            extra, state, warned = results[rank][name]
            assert extra == {"epoch": 3}
            assert _same(state, baselines[rank]), name
            assert any(place in w and "interrupted" in w for w in warned), warned


def test_a_load_discards_gradients_accumulated_before_it(loads: dict) -> None:
    results = loads["results"]
    assert results[0]["accumulation"] and results[1]["accumulation"]


def test_the_good_checkpoint_still_loads_bit_identically(loads: dict) -> None:
    results, baselines = loads["results"], loads["baselines"]
    for rank in range(2):
        assert _same(results[rank]["good"], baselines[rank])


# ------------------------------------------------------------------ saves that must fail
def _oserror(code: int, path: object) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _patched(target: object, name: str, replacement: Any) -> Any:
    original = getattr(target, name)
    setattr(target, name, replacement)
    return original


def _fault_meta_write_rank0(rank: int) -> list[tuple[object, str, Any]]:
    if rank != 0:
        return []

    def failing(directory, meta, manifest):  # type: ignore[no-untyped-def]
        raise _oserror(errno.EIO, directory / "meta.pt")

    return [(saving, "_write_meta_and_manifest", failing)]


def _fault_disk_full_rank1(rank: int) -> list[tuple[object, str, Any]]:
    if rank != 1:
        return []

    def failing(self, plan, planner):  # type: ignore[no-untyped-def]
        raise _oserror(errno.ENOSPC, Path(self.path) / "__1_0.distcp")

    return [(FileSystemWriter, "write_data", failing)]


def _fault_permission_rank0(rank: int) -> list[tuple[object, str, Any]]:
    if rank != 0:
        return []

    def failing(dirs):  # type: ignore[no-untyped-def]
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dirs.partial))

    return [(saving, "prepare_partial", failing)]


def _fault_second_rename_rank0(rank: int) -> list[tuple[object, str, Any]]:
    if rank != 0:
        return []

    def failing(source, destination):  # type: ignore[no-untyped-def]
        if str(source).endswith(".partial"):  # the partial taking the path's place, after the path moved aside
            raise _oserror(errno.EIO, destination)
        return os.rename(source, destination)

    return [(directory.os, "replace", failing)]


def _fault_checksum_rank1(rank: int) -> list[tuple[object, str, Any]]:
    if rank != 1:
        return []

    def failing(file, ranges, sync=False):  # type: ignore[no-untyped-def]
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(file))

    return [(saving, "digest_data_file", failing)]


ZIP_WRITER_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
NEARLY_FULL = 4096  # the free bytes the filesystem reports in the fault below


class _Usage(NamedTuple):
    total: int
    used: int
    free: int


def _fault_zip_writer_full_rank1(rank: int) -> list[tuple[object, str, Any]]:
    """What a filesystem filling up inside a tensor's torch.save does (torch's zip writer's words for ENOSPC;
    DCP pickles the failure, dropping the OSError beneath), and a filesystem that has little room left."""
    patches: list[tuple[object, str, Any]] = [
        (shutil, "disk_usage", lambda path: _Usage(1 << 30, 1 << 30, NEARLY_FULL))
    ]
    if rank == 1:

        def failing(self, plan, planner):  # type: ignore[no-untyped-def]
            raise RuntimeError(ZIP_WRITER_FULL)

        patches.append((FileSystemWriter, "write_data", failing))
    return patches


class _Unsafe:
    """A custom object in the extra state: weights_only loading could not read it back."""


SAVE_FAULTS = {
    "meta.pt write fails on rank 0": (_fault_meta_write_rank0, None, "Input/output error: "),
    "disk full on rank 1": (_fault_disk_full_rank1, None, "No space left on device: "),
    "torch's zip writer runs out of space on rank 1": (
        _fault_zip_writer_full_rank1,
        None,
        "No space left on device: the filesystem holding ",
    ),
    "permission denied on rank 0": (_fault_permission_rank0, None, "Permission denied: "),
    "second rename fails on rank 0": (_fault_second_rename_rank0, None, "Input/output error: "),
    "checksumming fails on rank 1": (_fault_checksum_rank1, None, "No such file or directory: "),
    "extra state needs arbitrary code": (
        None,
        {"obj": _Unsafe()},
        "holds objects that loading with weights_only=True refuses",
    ),
}


def _save_with_fault(engine: ZeroEngine, target: str, fault: Any, extra: Any) -> str:
    patches = [
        (owner, name, _patched(owner, name, replacement))
        for owner, name, replacement in (fault(engine.rank) if fault else [])
    ]
    try:
        engine.save_checkpoint(target, extra=extra)
        return "saved"
    except CheckpointError as error:
        return str(error)
    finally:
        for owner, name, original in patches:
            setattr(owner, name, original)


def _big_engine() -> ZeroEngine:
    """Pieces of tensors larger than a file's write buffer: a filesystem fills up inside torch.save's writes."""
    torch.manual_seed(0)
    model = TinyTransformer(blocks=1, width=128)
    return ZeroEngine(model, make_optimizer("adamw", model), config_for(3))


def _try_saves(
    rank: int,
    world_size: int,
    targets: dict[str, str],
    real_targets: dict[str, str],
    plain_dir: str,
    tiny_filesystem: str | None,
) -> dict[str, Any]:
    model, engine = _engine()
    _train(model, engine, range(5))  # differs from the checkpoint about to be overwritten
    out: dict[str, Any] = {}
    for name, (fault, extra, _) in SAVE_FAULTS.items():
        out[name] = _save_with_fault(engine, targets[name], fault, extra)
    for name, target in real_targets.items():
        out[name] = _save_with_fault(engine, target, None, None)
    for name, target in {**targets, **real_targets}.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.load_checkpoint(target)
        out[f"{name}: reloaded"] = _snapshot(engine)
    out["a later save succeeds"] = _save_with_fault(engine, targets["meta.pt write fails on rank 0"], None, None)
    out["over a directory of other files"] = _save_with_fault(engine, plain_dir, None, None)
    if tiny_filesystem is not None:
        out[FULL_IN_A_TENSOR] = _save_with_fault(_big_engine(), tiny_filesystem, None, None)
    return out


def _stop_during_save(engine: ZeroEngine, target: str) -> tuple[str, float]:
    """Rank 1 stops (SIGSTOP) while checksumming; rank 0 must give up after the process group's
    timeout, naming the step, and then wakes rank 1, whose save must fail as well."""
    pids = [None, None]
    torch.distributed.all_gather_object(pids, os.getpid())
    original = saving.digest_data_file
    if engine.rank == 1:

        def stop_then_digest(file, ranges, sync=False):  # type: ignore[no-untyped-def]
            os.kill(os.getpid(), signal.SIGSTOP)
            return original(file, ranges, sync=sync)

        saving.digest_data_file = stop_then_digest
    started = time.monotonic()
    try:
        engine.save_checkpoint(target)
        outcome = "saved"
    except CheckpointError as error:
        outcome = str(error)
    finally:
        saving.digest_data_file = original
    waited = time.monotonic() - started
    if engine.rank == 0:
        os.kill(pids[1], signal.SIGCONT)
    return outcome, waited


def _stopped_save(rank: int, world_size: int, target: str) -> tuple[str, float, str]:
    model, engine = _engine()
    _train(model, engine, range(1))
    engine.save_checkpoint(f"{target}-good")
    outcome, waited = _stop_during_save(engine, target)
    # Rank 0 gave up on rank 1, and gloo closed the connections between them: every rank now loads the good
    # checkpoint together, and each collective fails at once (the group is broken, no rank is missing).
    try:
        engine.load_checkpoint(f"{target}-good")
        retried = "loaded"
    except CheckpointError as error:
        retried = str(error)
    return outcome, waited, retried


FULL_IN_A_TENSOR = "a really full filesystem, inside a tensor's write"
PG_TIMEOUT = 15  # long enough for every other collective of the grid on a loaded machine
# A spawn of its own for the stopped rank: rank 0 waits out the process group's timeout, which the grid's
# IO-heavy saves need long; here only a setup, a step and the save run (as the divergence tests' grids).
STOPPED_PG_TIMEOUT = 4.0


@pytest.fixture(scope="module")
def saves(saved: tuple, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list, dict]:
    root, baselines = saved
    good = root / "good"
    work = tmp_path_factory.mktemp("saves")
    targets = {
        name: str(files.copy_checkpoint(good, work / f"target{index}")) for index, name in enumerate(SAVE_FAULTS)
    }
    real_targets: dict[str, str] = {}
    size = files.directory_bytes(good)
    with (
        files.tmpfs(work / "full", int(size * 1.5)) as full_mounted,
        files.tmpfs(work / "ro", 4 * size) as ro_mounted,
        files.tmpfs(work / "tiny", 128 * 1024) as tiny_mounted,
    ):
        tiny = str(work / "tiny" / "checkpoint") if tiny_mounted else None
        if full_mounted:
            real_targets["a really full filesystem"] = str(files.copy_checkpoint(good, work / "full" / "checkpoint"))
        if ro_mounted:
            real_targets["a really read-only filesystem"] = str(files.copy_checkpoint(good, work / "ro" / "checkpoint"))
            if not files.remount_read_only(work / "ro"):
                del real_targets["a really read-only filesystem"]
        plain = work / "plain"
        plain.mkdir()
        (plain / "notes.txt").write_text("mine")
        results = run_distributed(
            _try_saves, 2, targets, real_targets, str(plain), tiny, timeout=240, pg_timeout=PG_TIMEOUT
        )
        checked = {**targets, **real_targets, **({FULL_IN_A_TENSOR: tiny} if tiny else {})}
        leftovers = {
            name: sorted(p.name for p in Path(t).parent.iterdir() if p.name.startswith("."))
            for name, t in checked.items()
        }
        plain_contents = sorted(p.name for p in plain.iterdir())
    return {
        "results": results,
        "baselines": baselines,
        "leftovers": leftovers,
        "real": sorted(real_targets),
        "tiny": tiny is not None,
        "plain": plain_contents,
        "size": size,
    }


def test_a_failed_save_fails_alike_on_every_rank_root_cause_first(saves: dict) -> None:
    results = saves["results"]
    for name, (_, _, cause) in SAVE_FAULTS.items():
        assert results[0][name] == results[1][name], (name, results[0][name], results[1][name])
        assert results[0][name] != "saved", f"{name}: a rank returned normally from a failed save"
        assert cause in results[0][name], (name, results[0][name])
    assert results[0]["disk full on rank 1"].startswith("No space left on device")
    assert results[0]["meta.pt write fails on rank 0"].startswith("Input/output error")


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_partial_directory(saves: dict) -> None:
    for name, hidden in saves["leftovers"].items():
        assert not [h for h in hidden if h.endswith(".partial")], (name, hidden)
    for rank in range(2):
        for name in list(SAVE_FAULTS) + saves["real"]:
            assert _same(saves["results"][rank][f"{name}: reloaded"], saves["baselines"][rank]), name


def test_a_save_that_fills_the_filesystem_says_so_with_the_numbers(saves: dict) -> None:
    """torch's zip writer's words for a full disk (DCP drops the OSError beneath) are told as a full
    filesystem: what it had free and what the save writes, alike on every rank."""
    messages = by_rank(saves["results"], "torch's zip writer runs out of space on rank 1")
    assert messages[0] == messages[1], messages
    message = messages[0]
    assert message.startswith("No space left on device: the filesystem holding "), message
    assert f"had {NEARLY_FULL:,} bytes (4.00 KiB) free when the save began" in message, message
    assert "unexpected pos" not in message, message
    written = re.search(r"this save writes about ([\d,]+) bytes", message)
    assert written, message
    needed = int(written.group(1).replace(",", ""))
    assert 0.8 < needed / saves["size"] < 1.25, (needed, saves["size"])  # the estimate is near what a save writes
    assert f"free at least {needed - NEARLY_FULL:,} bytes" in message, message


def test_real_full_and_read_only_filesystems(saves: dict) -> None:
    if not saves["real"]:
        pytest.skip("mounting a small tmpfs needs root and mount permission")
    results = saves["results"]
    full = "No space left on device: the filesystem holding "
    causes = {"a really full filesystem": full, "a really read-only filesystem": "Read-only file system"}
    for name in saves["real"]:
        assert results[0][name] == results[1][name] and results[0][name].startswith(causes[name]), results[0][name]
    if saves["tiny"]:  # where the disk fills inside torch.save: its zip writer's words, not the OSError
        messages = by_rank(results, FULL_IN_A_TENSOR)
        assert messages[0] == messages[1] and messages[0].startswith(full), messages
        assert "free when the save began" in messages[0] and "unexpected pos" not in messages[0], messages


def test_saving_works_again_after_failures(saves: dict) -> None:
    assert by_rank(saves["results"], "a later save succeeds") == ["saved", "saved"]


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused(saves: dict) -> None:
    messages = by_rank(saves["results"], "over a directory of other files")
    assert messages[0] == messages[1] and "Refusing to save to" in messages[0] and "would delete them" in messages[0]
    assert saves["plain"] == ["notes.txt"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, float, str]]:
    target = tmp_path_factory.mktemp("stopped") / "checkpoint"
    return run_distributed(_stopped_save, 2, str(target), timeout=120, pg_timeout=STOPPED_PG_TIMEOUT)


def test_a_stopped_rank_ends_the_save_on_the_others_with_the_step_named(stopped: list) -> None:
    (message, waited, _), (other_message, _, _) = stopped
    assert "gave up waiting for the other ranks while checksumming the shards" in message, message
    assert waited < STOPPED_PG_TIMEOUT * 4, waited
    assert other_message != "saved", "the stopped rank's save returned normally"


def test_a_load_retried_after_the_process_group_broke_says_it_is_broken(stopped: list) -> None:
    """Not that a rank did not answer in time: every rank is loading, and the collectives fail at once."""
    retried = [result[2] for result in stopped]
    assert retried[0] == retried[1], retried
    assert retried[0].startswith("loading checkpoint ") and ": the process group is broken" in retried[0], retried
    assert "Restart every process, then load it." in retried[0], retried
    assert "did not answer within the process group's timeout" not in retried[0], retried


# ------------------------------------------------------------------ fp16: loss scale and step counter
def test_loss_scale_and_step_counter_are_restored_and_survive_a_failed_load(tmp_path: Path) -> None:
    """One process, no process group: the same code path as every rank takes."""
    from zero_core import MixedPrecision

    torch.manual_seed(0)
    model = TinyTransformer(blocks=2, width=16)
    precision = MixedPrecision(compute_dtype=torch.float16)
    config = config_for(3, precision=precision, initial_loss_scale=2.0**10)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)

    def step(overflow: bool) -> None:
        ids = batch(0, 0)
        loss = lm_loss(model(ids), ids)
        engine.backward(loss * float("inf") if overflow else loss)
        engine.step()

    step(False)
    step(True)  # halves the scale, skips the update
    saved = (engine.loss_scale, engine.steps_taken)
    engine.save_checkpoint(tmp_path / "good")
    step(True)
    step(False)
    live = (engine.loss_scale, engine.steps_taken)
    assert live != saved
    broken = files.copy_checkpoint(tmp_path / "good", tmp_path / "broken")
    files.flip_bytes(files.largest_shard(broken), 100)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        engine.load_checkpoint(broken)
    assert (engine.loss_scale, engine.steps_taken) == live
    engine.load_checkpoint(tmp_path / "good")
    assert (engine.loss_scale, engine.steps_taken) == saved == (2.0**9, 1)
