"""Consolidation by our tool, Lightning's and Accelerate's, and starting from full weights."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.in_process import run_module
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, relative_difference
from zero_core import ZeroEngine
from zero_core.checkpoint import CheckpointError, consolidate_checkpoint

ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]  # console-script shims may not be on PATH


def _train_and_save(rank: int, world_size: int, directory: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer()
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3))
    for step in range(3):
        ids = batch(step, rank)
        engine.backward(lm_loss(model(ids), ids))
        engine.step()
    engine.save_checkpoint(Path(directory) / "full", extra={"epoch": 7})
    engine.save_checkpoint(Path(directory) / "weights", include_optimizer=False)
    return engine.full_state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("checkpoints")
    in_memory = run_distributed(_train_and_save, 3, str(directory))[0]
    return directory, in_memory


def _assert_same_weights(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key].to(value.dtype), value), key


def test_our_tool_writes_safetensors_and_lightning_files(
    saved: tuple, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    directory, expected = saved
    consolidate_checkpoint(directory / "full", tmp_path / "model.safetensors")
    _assert_same_weights(load_file(tmp_path / "model.safetensors"), expected)
    run_module("zero_core.checkpoint.consolidate", str(directory / "full"), str(tmp_path / "model.ckpt"))
    assert "wrote" in capsys.readouterr().out
    checkpoint = torch.load(tmp_path / "model.ckpt", weights_only=True)
    _assert_same_weights(checkpoint["state_dict"], expected)
    assert checkpoint["epoch"] == 7 and "zero" not in checkpoint
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(1e-2)


def test_lightning_consolidation_tool_reads_our_checkpoints(saved: tuple, tmp_path: Path) -> None:
    directory, expected = saved
    output = tmp_path / "lightning.ckpt"
    run_module(
        "lightning.pytorch.utilities.consolidate_checkpoint", str(directory / "full"), "--output_file", str(output)
    )
    checkpoint = torch.load(output, weights_only=False)
    _assert_same_weights(checkpoint["state_dict"], expected)
    assert checkpoint["epoch"] == 7
    state = checkpoint["optimizer_states"][0]["state"]
    assert state["blocks.0.up.weight"]["exp_avg"].shape == expected["blocks.0.up.weight"].shape


def test_accelerate_merge_weights_reads_our_model_checkpoints(saved: tuple, tmp_path: Path) -> None:
    directory, expected = saved
    subprocess.run(
        [*ACCELERATE, "merge-weights", str(directory / "weights"), str(tmp_path / "merged")],
        capture_output=True,
        text=True,
        check=True,
    )
    _assert_same_weights(load_file(tmp_path / "merged" / "model.safetensors"), expected)


def _start_from_full_weights(rank: int, world_size: int, files: list[str]) -> list[float]:
    """Load each file into a freshly sharded model; return the differences to the first file's weights."""
    errors = []
    for stage, file in zip((1, 2, 3), files):
        torch.manual_seed(123)  # other initial values than the saved run's
        model = TinyTransformer()
        engine = ZeroEngine(model, make_optimizer("sgd", model), config_for(stage))
        engine.load_full_state_dict(file)
        errors.append(relative_difference(engine.full_state_dict(), load_file(files[0])))
    return errors


def test_full_weights_load_into_a_sharded_model(saved: tuple, tmp_path: Path) -> None:
    directory, expected = saved
    save_file({k: v.clone() for k, v in expected.items()}, tmp_path / "weights.safetensors")  # untie for safetensors
    torch.save(expected, tmp_path / "weights.pt")
    consolidate_checkpoint(directory / "full", tmp_path / "lightning.ckpt", "lightning")
    files = [str(tmp_path / name) for name in ("weights.safetensors", "weights.pt", "lightning.ckpt")]
    for errors in run_distributed(_start_from_full_weights, 2, files):
        assert errors == [0.0, 0.0, 0.0]


def _one_process(steps: range, model: TinyTransformer, optimizer: torch.optim.Optimizer) -> list[float]:
    """The reference: one process on both ranks' batches."""
    losses = []
    for step in steps:
        ids = torch.cat([batch(step, 0), batch(step, 1)])
        loss = lm_loss(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _resume_from_full_state_dicts(rank: int, world_size: int) -> dict[str, object]:
    """A one-process run's state dicts (as a DDP run saves them) resume at every stage; bad ones are refused
    on every rank, changing nothing."""
    torch.manual_seed(0)
    reference = TinyTransformer(batchnorm=False)
    reference_optimizer = make_optimizer("adamw", reference)  # two groups, not in parameter order
    _one_process(range(3), reference, reference_optimizer)
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    saved = copy.deepcopy(reference_optimizer.state_dict())  # its tensors are the live state's
    _one_process(range(3, 5), reference, reference_optimizer)
    results: dict[str, object] = {}
    for stage in (1, 2, 3):
        torch.manual_seed(123)
        model = TinyTransformer(batchnorm=False)
        engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(stage))
        engine.load_full_state_dict(weights, optimizer_state_dict=saved)
        for step in range(3, 5):
            ids = batch(step, rank)
            engine.backward(lm_loss(model(ids), ids))
            engine.step()
        results[f"zero{stage}"] = relative_difference(engine.full_state_dict(), reference.state_dict())
    bad = {
        "one group": {**saved, "param_groups": saved["param_groups"][:1]},
        "unknown index": {**saved, "state": {**saved["state"], 999: saved["state"][0]}},
        # only rank 1's copy is bad: both ranks must refuse
        "misshaped": {**saved, "state": {**saved["state"], 0: {**saved["state"][0], "exp_avg": torch.zeros(3)}}}
        if rank == 1
        else saved,
    }
    torch.manual_seed(123)
    model = TinyTransformer(batchnorm=False)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3))
    before = engine.full_state_dict()
    for case, optimizer_state in bad.items():
        try:
            engine.load_full_state_dict(weights, optimizer_state_dict=optimizer_state)
            results[case] = "loaded"
        except CheckpointError as error:
            results[case] = str(error)
    results["unchanged"] = relative_difference(engine.full_state_dict(), before) == 0.0
    results["no optimizer state"] = len(engine.optimizer.state) == 0
    return results


def test_full_optimizer_state_dicts_resume_like_one_process_and_bad_ones_change_nothing() -> None:
    """DDP's files index parameters group by group, in order, as optimizer.load_state_dict matches them."""
    results = run_distributed(_resume_from_full_state_dicts, 2)
    for stage in (1, 2, 3):
        assert all(r[f"zero{stage}"] <= 1e-5 for r in results), stage
    assert all("3 param groups" not in r["one group"] and "1 param groups" in r["one group"] for r in results)
    assert all("999" in r["unknown index"] for r in results)
    assert results[0]["misshaped"] == results[1]["misshaped"] and "exp_avg" in results[0]["misshaped"]
    assert all(r["unchanged"] and r["no optimizer state"] for r in results)
