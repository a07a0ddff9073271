"""``engine.save_checkpoint(..., asynchronous=True)``: the state staged in host memory, written by a thread of its
own while training goes on, with the synchronous save's guarantees.

Checked on 2 gloo ranks: what an asynchronous save writes is, bit for bit, what a synchronous save at the same
point writes, though the weights change while it is written (nothing staged aliases them); the next save, a
load and ``wait_for_checkpoint`` wait for it; a write that fails on one rank (its disk full) is raised on every
rank alike at the next optimizer step, naming the checkpoint, training goes on after it, and the previous
checkpoint at that path still loads; a bad extra state is refused at once, as a synchronous save refuses it; the
host copies are counted in ``memory_report()``, and a save that host memory cannot stage is refused before anything
is copied, with the numbers, on every rank alike (or, with ``asynchronous_checkpoints_fallback``, written
synchronously); under the NVMe tier the resting state is linked, not copied. A rank killed inside its background
write ends the save on the survivor with an error naming the checkpoint, at once; the previous checkpoint loads
in the next run, and that run's first save there removes what the killed one left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from tests.checkpoint_files import assert_same_checkpoint
from tests.models import SEQ, VOCAB, TinyTransformer, lm_loss, make_optimizer
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import config_for, refusal
from zero_core import CheckpointError, ZeroEngine, estimate
from zero_core.checkpoint import load_full_checkpoint, save_and_load


class _Opaque:
    """Pickles, but weights_only loading refuses it: a save of it is refused before anything is written."""


def _engine(stage: int, **settings: Any) -> tuple[TinyTransformer, ZeroEngine]:
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    return model, ZeroEngine(model, make_optimizer("adamw", model), config_for(stage, **settings))


def _train(model: TinyTransformer, engine: ZeroEngine, steps: range) -> None:
    for step in steps:
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(10 * step + engine.rank))
        engine.backward(lm_loss(model(ids), ids))
        engine.step()
        engine.zero_grad()


def _saved_once(stage: int, path: Path) -> tuple[TinyTransformer, ZeroEngine, dict[str, torch.Tensor]]:
    """An engine trained a step and saved synchronously to ``path`` (the previous checkpoint there), and its
    full weights then (gathered on every rank)."""
    model, engine = _engine(stage)
    _train(model, engine, range(1))
    engine.save_checkpoint(path)
    return model, engine, engine.full_state_dict()


def _same_as_synchronous(rank: int, world_size: int, directory: str, stage: int, nvme: bool = False) -> dict[str, Any]:
    """A synchronous and an asynchronous save of the same state; the weights change while the second is
    written; then a load of it while the next asynchronous save is still being written. ``nvme``: the optimizer
    state rests in the NVMe tier's files, which the steps after the save rewrite while it is written."""
    root = Path(directory) / (f"stage{stage}" + ("-nvme" if nvme else ""))
    scratch = root / "offload"
    scratch.mkdir(parents=True, exist_ok=True)
    model, engine = _engine(stage, **({"offload_optimizer": "nvme", "offload_dir": str(scratch)} if nvme else {}))
    _train(model, engine, range(2))
    engine.save_checkpoint(root / "sync", {"epoch": [1, 2]})
    extra = {"epoch": [1, 2]}
    staging_before = engine.memory_report().checkpoint_staging_bytes
    path = engine.save_checkpoint(root / "async", extra, asynchronous=True)
    staging = engine.memory_report().checkpoint_staging_bytes
    extra["epoch"].append(3)  # changed after the call returned: not what was saved
    before = engine.full_state_dict()
    _train(model, engine, range(2, 5))
    changed = not all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    waited = engine.wait_for_checkpoint()
    again = engine.save_checkpoint(root / "async-2", asynchronous=True)
    other_model, other = _engine(stage)
    loaded_extra = other.load_checkpoint(path)  # waits for nothing of its own; the other engine's write goes on
    loaded = other.full_state_dict()
    second = engine.save_checkpoint(root / "after", asynchronous=False)  # waits for async-2 first
    # The model and the optimizer in two directories of one save (as Accelerate keeps them), in the background.
    engine.save_checkpoint(root / "pair-sync", optimizer_path=root / "pair-sync-optimizer")
    done: list = []
    engine.save_checkpoint(
        root / "pair-async",
        optimizer_path=root / "pair-async-optimizer",
        asynchronous=True,
        when_done=lambda path, error: done.append((str(path), error)),
    )
    before_collected = list(done)
    engine.wait_for_checkpoint()
    return {
        "path": str(path),
        # Waited for here, or collected by a step once every rank's write had finished.
        "returned": path == (root / "async").absolute() and waited in (path, None),
        "weights changed meanwhile": changed,
        "loaded the saved state": all(torch.equal(before[k], loaded[k]) for k in before),
        "extra": loaded_extra,
        "both written": again.is_dir() and second.is_dir() and engine.wait_for_checkpoint() is None,
        "pair done": (before_collected, done),
        "staging": (staging_before, staging, engine.memory_report().checkpoint_staging_bytes),
        "snapshots left": sorted(str(p) for p in scratch.rglob("checkpoint-snapshot-*")) if nvme else [],
    }


@contextlib.contextmanager
def _disk_full_on(rank: int, failing: int) -> Iterator[None]:
    """DCP's file writer fails with ENOSPC on rank ``failing`` (in the background thread, where DCP writes), as
    a full disk fails it: inside DCP's own protocol, which gathers every rank's write result."""
    original = FileSystemWriter.write_data

    def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        if rank == failing:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(self.path) / "__1_0.distcp"))
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileSystemWriter.write_data = original  # type: ignore[method-assign]


def _failing_write(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    root = Path(directory) / "failing"
    model, engine, kept = _saved_once(3, root / "ckpt")
    _train(model, engine, range(1, 2))
    raised_at, message, done = None, None, []
    with _disk_full_on(rank, failing=1):
        engine.save_checkpoint(root / "ckpt", asynchronous=True, when_done=lambda _, error: done.append(str(error)))
        for step in range(2, 40):  # the write ends within a few steps; the step after every rank's raises
            try:
                _train(model, engine, range(step, step + 1))
            except CheckpointError as error:
                raised_at, message = step, str(error)
                break
    _train(model, engine, range(40, 41))  # training goes on
    other_model, other = _engine(3)
    other.load_checkpoint(root / "ckpt")
    previous = other.full_state_dict()
    leftovers = sorted(p.name for p in root.iterdir())
    bad_extra = refusal(lambda: engine.save_checkpoint(root / "bad", {"f": _Opaque()}, asynchronous=True), Exception)
    return {
        "raised at": raised_at,
        "message": message,
        "previous loads": all(torch.equal(kept[k], previous[k]) for k in kept),
        "leftovers": leftovers,
        "bad extra": bad_extra,
        "nothing pending after": engine.wait_for_checkpoint() is None,
        "when_done": done,
    }


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(value) for value in tree)
    return 0


@contextlib.contextmanager
def _host_memory_short(rank: int, short: int) -> Iterator[None]:
    """Rank ``short`` sees almost no host memory available (as on a host that is nearly full)."""
    original = save_and_load.available_host_memory_bytes
    if rank == short:
        save_and_load.available_host_memory_bytes = lambda: 4096  # type: ignore[assignment]
    try:
        yield
    finally:
        save_and_load.available_host_memory_bytes = original  # type: ignore[assignment]


def _short_of_host_memory(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """An asynchronous save that host memory cannot stage is refused before anything is copied or written."""
    root = Path(directory) / "short"
    model, engine, kept = _saved_once(2, root / "ckpt")
    with _host_memory_short(rank, short=1):
        message = refusal(lambda: engine.save_checkpoint(root / "ckpt", asynchronous=True), CheckpointError)
    staging = engine.memory_report().checkpoint_staging_bytes
    _train(model, engine, range(1, 2))  # training goes on
    other_model, other = _engine(2)
    other.load_checkpoint(root / "ckpt")
    previous = other.full_state_dict()
    then_saves = engine.save_checkpoint(root / "ckpt", asynchronous=True) is not None
    then_saves = then_saves and engine.wait_for_checkpoint() is not None
    # asynchronous_checkpoints_fallback: the same shortage writes the checkpoint before the save returns.
    model, engine = _engine(2, asynchronous_checkpoints=True, asynchronous_checkpoints_fallback=True)
    _train(model, engine, range(1))
    done: list = []
    with _host_memory_short(rank, short=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(root / "fallback", when_done=lambda path, error: done.append(error))
        written_at_once = engine.checkpoint_being_written is None and done == [None]
    engine.save_checkpoint(root / "fallback-sync", asynchronous=False)
    return {
        "message": message,
        "nothing staged": staging == 0 and engine.checkpoint_being_written is None,
        "previous loads": all(torch.equal(kept[k], previous[k]) for k in kept),
        "leftovers": sorted(p.name for p in root.iterdir() if p.name.startswith("ckpt") or p.name.startswith(".")),
        "then saves": then_saves,
        "fallback written at once": written_at_once,
        "fallback warned": [str(w.message) for w in caught if "synchronously" in str(w.message)],
        "fallback staged nothing": engine.memory_report().checkpoint_staging_bytes == 0,
        "path": str(root / "fallback"),
    }


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("async"))
    same = functools.partial(_same_as_synchronous, directory=directory)
    workers = {f"stage {stage}": functools.partial(same, stage=stage) for stage in (1, 2, 3)}
    workers["nvme"] = functools.partial(same, stage=1, nvme=True)
    workers["failing"] = functools.partial(_failing_write, directory=directory)
    workers["short"] = functools.partial(_short_of_host_memory, directory=directory)
    return run_distributed(run_each, 2, workers, timeout=240)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_asynchronous_save_writes_what_a_synchronous_one_does(grid: list, stage: int) -> None:
    for result in by_rank(grid, f"stage {stage}"):
        assert result["returned"] and result["weights changed meanwhile"]
        assert result["loaded the saved state"] and result["extra"] == {"epoch": [1, 2]}
        assert result["both written"]
    path = Path(by_rank(grid, f"stage {stage}")[0]["path"])
    assert_same_checkpoint(path.parent / "sync", path)
    # The second asynchronous save refilled the first one's host copies; "after" is a synchronous save of the
    # same state (nothing trained between them).
    assert_same_checkpoint(path.parent / "after", path.parent / "async-2")
    assert_same_checkpoint(path.parent / "pair-sync", path.parent / "pair-async", state_key=None)
    assert_same_checkpoint(path.parent / "pair-sync-optimizer", path.parent / "pair-async-optimizer")
    for result in by_rank(grid, f"stage {stage}"):  # when_done: once, where the write was collected
        assert result["pair done"] == ([], [(str(path.parent / "pair-async"), None)])
    # memory_report() counts the host copies from the first asynchronous save on, refilled (not grown) by the
    # next ones; together the ranks' copies hold the checkpoint's every tensor, each replicated one (buffers,
    # the optimizer's step counts) once per rank holding it.
    staged = [result["staging"] for result in by_rank(grid, f"stage {stage}")]
    assert all(before == 0 and after > 0 and later == after for before, after, later in staged)
    whole = _tensor_bytes(load_full_checkpoint(path))
    assert whole <= sum(after for _, after, _ in staged) <= whole * 1.02
    # zero-estimate's figure per rank, from the parameter counts: within 5% of what the ranks copied on average
    # (the buffers, staged by rank 0, and the optimizer's step counts aside).
    config = dataclasses.replace(config_for(stage), asynchronous_checkpoints=True)
    estimated = estimate(TinyTransformer(batchnorm=False), 2, config).checkpoint_staging_bytes
    mean = sum(after for _, after, _ in staged) / len(staged)
    assert abs(estimated - mean) <= 0.05 * mean, (estimated, staged)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_asynchronous_checkpoint_resumes_at_one_rank_another_stage_and_on_nvme_as_a_synchronous_one(
    grid: list, stage: int, tmp_path: Path
) -> None:
    """Saved asynchronously by 2 ranks at ``stage``, loaded by one process at another stage with the optimizer
    state in the NVMe tier, and saved again: bit for bit the synchronous save of the same state."""
    saved = Path(by_rank(grid, f"stage {stage}")[0]["path"])
    _, engine = _engine(1 if stage == 3 else 3, offload_optimizer="nvme", offload_dir=str(tmp_path))
    assert engine.load_checkpoint(saved) == {"epoch": [1, 2]}
    engine.save_checkpoint(tmp_path / "again")
    assert_same_checkpoint(saved.parent / "sync", tmp_path / "again")


def test_the_nvme_tiers_resting_state_is_linked_not_copied_and_written_as_a_synchronous_save(grid: list) -> None:
    """offload_optimizer="nvme": the state resting in the tier's files is staged as hard links to them (the tier
    writes each file anew, so the steps after the save leave the linked files alone): the host copy holds the
    rest, the directory is bit for bit the synchronous save's, and the links are gone once written."""
    results = by_rank(grid, "nvme")
    for result in results:
        assert result["returned"] and result["weights changed meanwhile"] and result["loaded the saved state"]
        assert result["both written"] and result["snapshots left"] == []
    path = Path(results[0]["path"])
    assert_same_checkpoint(path.parent / "sync", path)
    assert_same_checkpoint(path.parent / "after", path.parent / "async-2")
    whole = _tensor_bytes(load_full_checkpoint(path))
    assert sum(after for _, after, _ in (result["staging"] for result in results)) < whole / 2


def test_a_failed_background_write_is_raised_on_every_rank_at_a_step_and_keeps_the_previous(grid: list) -> None:
    results = by_rank(grid, "failing")
    assert results[0]["raised at"] is not None and results[0]["raised at"] == results[1]["raised at"]
    assert results[0]["message"] == results[1]["message"]
    message = results[0]["message"]
    assert message.startswith("The asynchronous save to ") and "/failing/ckpt failed: " in message
    assert "No space left on device" in message and "on rank 1" in message
    for result in results:
        assert result["previous loads"]
        assert result["leftovers"] == ["ckpt"]  # the partial directory removed
        assert "weights_only" in result["bad extra"]
        assert result["nothing pending after"]
        assert result["when_done"] == [message]  # told of the error it raises, on every rank


def test_an_asynchronous_save_host_memory_cannot_stage_is_refused_alike_with_the_numbers(grid: list) -> None:
    results = by_rank(grid, "short")
    assert results[0]["message"] == results[1]["message"]
    message = results[0]["message"]
    assert "asynchronously was refused before staging: host " in message
    assert "has 4.00 KiB of memory available and its ranks [0, 1] need " in message
    assert "Save synchronously (asynchronous=False" in message
    for result in results:
        assert result["nothing staged"] and result["previous loads"] and result["then saves"]
        assert result["leftovers"] == ["ckpt"]
        assert result["fallback written at once"] and result["fallback staged nothing"]
    # asynchronous_checkpoints_fallback: written synchronously on every rank, warned once (rank 0) with the numbers.
    warned = [result["fallback warned"] for result in results]
    assert len(warned[0]) == 1 and warned[1] == [], warned
    assert warned[0][0].startswith("Saving checkpoint ") and " synchronously: host " in warned[0][0]
    assert "need " in warned[0][0] and "(asynchronous_checkpoints_fallback)" in warned[0][0]
    path = Path(results[0]["path"])
    assert_same_checkpoint(path.parent / "fallback-sync", path.parent / "fallback")


KILLED_PG_TIMEOUT = 5.0  # the survivor's collectives give up on a dead rank within this, when gloo does not see it


def _raised(action: Any) -> str | None:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - which kind is part of what is checked
        return f"{type(error).__name__}: {error}"
    return None


def _killed_during_write(rank: int, world_size: int, directory: str, killed: int) -> dict[str, Any]:
    """Rank ``killed`` is killed (SIGKILL) inside its background write, once its shard file is written into the
    partial directory; the other waits for the write, then tries a step. The survivor's findings go to a file:
    the body's result dies with the killed rank."""
    root = Path(directory)
    # The previous checkpoint, which the asynchronous save below replaces.
    model, engine, previous = _saved_once(3, root / "ckpt")
    if rank == 0:
        torch.save(previous, root / "previous.pt")
    _train(model, engine, range(1, 2))
    original = FileSystemWriter.write_data

    def write_then_die(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        written = original(self, plan, planner)
        os.kill(os.getpid(), signal.SIGKILL)
        return written

    if rank == killed:
        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    started = time.monotonic()
    engine.save_checkpoint(root / "ckpt", asynchronous=True)
    outcome = {"waited": _raised(engine.wait_for_checkpoint), "waited_s": time.monotonic() - started}
    outcome["then a step"] = _raised(lambda: _train(model, engine, range(2, 3)))
    outcome["entries"] = sorted(p.name for p in root.iterdir())
    (root / "survivor.json").write_text(json.dumps(outcome))
    return outcome


def _after_the_kill(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """A new run at the same path: the previous checkpoint loads as it was saved, and the next save there
    removes whatever the killed save left."""
    root = Path(directory)
    model, engine = _engine(3)
    engine.load_checkpoint(root / "ckpt")
    previous = torch.load(root / "previous.pt", weights_only=True)
    loaded = engine.full_state_dict()
    same = all(torch.equal(previous[key], loaded[key]) for key in previous)
    _train(model, engine, range(2, 3))
    engine.save_checkpoint(root / "ckpt", asynchronous=True)
    engine.wait_for_checkpoint()
    return {"previous loads": same, "entries after a save": sorted(p.name for p in root.iterdir())}


@pytest.mark.parametrize("killed", [0, 1], ids=["the coordinator killed", "another rank killed"])
def test_a_rank_killed_in_its_background_write_ends_the_save_with_an_error_and_keeps_the_previous(
    tmp_path: Path, killed: int
) -> None:
    with pytest.raises(RuntimeError, match=rf"rank {killed} ended without a result \(exit code -9\)"):
        run_distributed(_killed_during_write, 2, str(tmp_path), killed, timeout=120, pg_timeout=KILLED_PG_TIMEOUT)
    survivor = json.loads((tmp_path / "survivor.json").read_text())
    # The survivor's wait raises at once (gloo sees the closed connection), naming the checkpoint, and keeps
    # the previous one; its next step fails as well instead of waiting.
    waited = survivor["waited"]
    assert waited.startswith(f"CheckpointError: The asynchronous save to {tmp_path / 'ckpt'} failed: "), waited
    assert "the process group is broken" in waited and "The previous checkpoint there, if any, is as it was." in waited
    assert survivor["waited_s"] < KILLED_PG_TIMEOUT * 4, survivor
    step = survivor["then a step"]
    assert step is not None and "did not complete" in step and "The process group is broken" in step, survivor
    assert "restart every process, then resume from the last checkpoint that saved" in step, step
    # Nothing of the killed save is at the checkpoint's name; where the coordinator died, its partial
    # directory is left, with the shard the killed rank wrote.
    left = [name for name in survivor["entries"] if name not in ("previous.pt",)]
    assert left == (["ckpt"] if killed == 1 else [".ckpt.partial", "ckpt"]), survivor
    if killed == 0:
        assert not (tmp_path / ".ckpt.partial" / "zero-manifest.json").exists()
    # The next run: the previous checkpoint loads bit for bit, and its first save there leaves only the new one.
    for result in run_distributed(_after_the_kill, 2, str(tmp_path)):
        assert result["previous loads"], result
        assert result["entries after a save"] == ["ckpt", "previous.pt", "survivor.json"], result
