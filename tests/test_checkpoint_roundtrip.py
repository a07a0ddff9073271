"""Sharded checkpoints: save at one world size and stage, resume at another.

The data is one fixed global batch per step, split evenly over the ranks,
so training does not depend on the world size beyond rounding. Checked:
loading is bitwise exact (a checkpoint re-saved right after loading holds
the same full parameters and optimizer state), resuming at the same world
size continues bitwise like an uninterrupted run, and at another world size
or stage within fp32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero_core import ZeroEngine
from zero_core.checkpoint import load_full_checkpoint

from .distributed import run_distributed
from .models import VOCAB, SEQ, TinyTransformer, lm_loss, make_optimizer
from .workers import config_for, relative_difference

GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3, 4
TOTAL_STEPS, SAVE_AT = 5, 2


def global_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    everything = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    share = GLOBAL_BATCH // world_size
    return everything[rank * share : (rank + 1) * share]


def _engine(stage: int) -> tuple[TinyTransformer, ZeroEngine]:
    torch.manual_seed(0)
    model = TinyTransformer().eval()  # BatchNorm on running statistics: independent of the split
    return model, ZeroEngine(model, make_optimizer("adamw", model), config_for(stage))


def _train(model: TinyTransformer, engine: ZeroEngine, steps: range) -> list[float]:
    rank, world_size = engine.rank, engine.world_size
    losses = []
    for step in steps:
        ids = global_batch(step, rank, world_size)
        loss = lm_loss(model(ids), ids)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        mean = loss.detach().clone()  # the global batch's loss, whatever the split
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def _save_job(rank: int, world_size: int, stage: int, directory: str) -> dict:
    model, engine = _engine(stage)
    _train(model, engine, range(SAVE_AT))
    engine.save_checkpoint(Path(directory) / "saved", extra={"note": "hello", "step": SAVE_AT})
    losses = _train(model, engine, range(SAVE_AT, TOTAL_STEPS))
    return {"losses": losses, "final": engine.full_state_dict()}


def _resume_job(rank: int, world_size: int, stage: int, directory: str) -> dict:
    model, engine = _engine(stage)
    extra = engine.load_checkpoint(Path(directory) / "saved")
    engine.save_checkpoint(Path(directory) / f"reloaded-{world_size}-{stage}")
    losses = _train(model, engine, range(SAVE_AT, TOTAL_STEPS))
    return {"losses": losses, "final": engine.full_state_dict(), "extra": extra, "steps": engine.steps_taken}


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, list):
        return _flatten(dict(enumerate(tree)), prefix)
    return {prefix[:-1]: tree}


@pytest.mark.parametrize(
    "save_world, save_stage, load_world, load_stage",
    [(4, 3, 4, 3), (4, 3, 2, 3), (4, 2, 3, 2), (4, 1, 1, 1), (2, 3, 2, 1), (2, 1, 2, 3), (2, 2, 3, 3)],
)
def test_resume_at_any_world_size_and_stage(tmp_path: Path, save_world: int, save_stage: int, load_world: int, load_stage: int) -> None:
    saved = run_distributed(_save_job, save_world, save_stage, str(tmp_path))
    resumed = run_distributed(_resume_job, load_world, load_stage, str(tmp_path))

    original = _flatten(load_full_checkpoint(tmp_path / "saved"))
    reloaded = _flatten(load_full_checkpoint(tmp_path / f"reloaded-{load_world}-{load_stage}"))
    assert original.keys() == reloaded.keys()
    assert any(k.startswith("optimizer_0.state.") and k.endswith("exp_avg_sq") for k in original)
    for key, value in original.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, reloaded[key]), f"{key} changed in a load/save round trip"
        else:
            assert value == reloaded[key], key

    assert resumed[0]["extra"] == {"note": "hello", "step": SAVE_AT}
    assert resumed[0]["steps"] == TOTAL_STEPS
    reference, ours = saved[0], resumed[0]
    if save_world == load_world:
        assert ours["losses"] == reference["losses"]
        tolerance = 0.0
    else:
        assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        tolerance = 1e-5
    assert relative_difference(ours["final"], reference["final"]) <= tolerance
