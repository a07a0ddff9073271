"""A bad checkpoint fails fast with a message naming the problem, on every
rank; a crash mid-save leaves the previous checkpoint loadable; loading runs
no code from the checkpoint."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from zero_core import ZeroEngine
from zero_core.checkpoint import CheckpointError, load_full_checkpoint

from .distributed import run_distributed
from .models import TinyTransformer, batch, lm_loss, make_optimizer
from .workers import config_for


def _engine(blocks: int = 3, width: int = 16) -> tuple[TinyTransformer, ZeroEngine]:
    torch.manual_seed(0)
    model = TinyTransformer(blocks=blocks, width=width)
    return model, ZeroEngine(model, make_optimizer("adamw", model), config_for(3))


def _train_step(model: TinyTransformer, engine: ZeroEngine, step: int) -> None:
    ids = batch(step, engine.rank)
    engine.backward(lm_loss(model(ids), ids))
    engine.step()


def _save(rank: int, world_size: int, path: str, steps: int) -> dict[str, torch.Tensor]:
    model, engine = _engine()
    for step in range(steps):
        _train_step(model, engine, step)
    engine.save_checkpoint(path)
    return engine.full_state_dict()


def _crash_during_save(rank: int, world_size: int, path: str) -> None:
    model, engine = _engine()
    for step in range(4):
        _train_step(model, engine, step)
    if rank == 1:
        original = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):  # type: ignore[no-untyped-def]
            original(self, plan, planner).wait()
            os._exit(17)  # killed after writing its shard, before the save completes

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    engine.save_checkpoint(path)


def _load_error(rank: int, world_size: int, path: str, blocks: int, width: int) -> str:
    model, engine = _engine(blocks, width)
    try:
        engine.load_checkpoint(path)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def _load_state(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    model, engine = _engine()
    engine.load_checkpoint(path)
    return engine.full_state_dict()


@pytest.fixture()
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path / "checkpoint"
    return path, run_distributed(_save, 2, str(path), 2)[0]


def test_crash_mid_save_leaves_previous_checkpoint_loadable(checkpoint: tuple) -> None:
    path, saved = checkpoint
    with pytest.raises((RuntimeError, TimeoutError)):
        run_distributed(_crash_during_save, 2, str(path), timeout=60)
    loaded = run_distributed(_load_state, 2, str(path))[0]
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def _assert_same_error_everywhere(path: Path, expected: str, blocks: int = 3, width: int = 16) -> None:
    messages = run_distributed(_load_error, 2, str(path), blocks, width, timeout=60)
    assert messages[0] == messages[1], messages
    assert expected in messages[0], messages[0]


def test_deleted_shard_file_is_named(checkpoint: tuple) -> None:
    path, _ = checkpoint
    shard = sorted(path.glob("*.distcp"))[-1]
    shard.unlink()
    _assert_same_error_everywhere(path, f"shard file {shard.name} is missing")


def test_truncated_shard_file_is_named(checkpoint: tuple) -> None:
    path, _ = checkpoint
    shard = sorted(path.glob("*.distcp"))[0]
    with open(shard, "r+b") as stream:
        stream.truncate(shard.stat().st_size // 2)
    _assert_same_error_everywhere(path, f"shard file {shard.name} is truncated")


def test_checkpoint_of_another_model_lists_the_differences(checkpoint: tuple) -> None:
    path, _ = checkpoint
    messages = run_distributed(_load_error, 2, str(path), 2, 24, timeout=60)
    assert messages[0] == messages[1]
    message = messages[0]
    assert "does not hold this model's weights" in message
    assert "unexpected keys: ['blocks.2." in message
    assert "mis-shaped: [" in message and "embed.weight (checkpoint (37, 16), model (37, 24))" in message


def test_corrupt_metadata_is_reported(checkpoint: tuple) -> None:
    path, _ = checkpoint
    (path / ".metadata").write_bytes(b"not a pickle at all")
    _assert_same_error_everywhere(path, "is corrupt or not DCP metadata")


def test_missing_directory_is_reported(tmp_path: Path) -> None:
    _assert_same_error_everywhere(tmp_path / "nowhere", "is not a checkpoint: .metadata is missing")


class _Exploit:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch pwned",))


def test_loading_never_runs_code_from_the_checkpoint(checkpoint: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = checkpoint
    monkeypatch.chdir(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError, match="refusing to load posix.system|refusing to load os.system"):
        load_full_checkpoint(path)
    assert not (tmp_path / "pwned").exists()
