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


def _save_job(rank: int, world_size: int, stages: list[int], directory: str) -> dict[int, dict]:
    """For each stage: train, save, keep training (the uninterrupted reference)."""
    results = {}
    for stage in stages:
        model, engine = _engine(stage)
        _train(model, engine, range(SAVE_AT))
        engine.save_checkpoint(Path(directory) / f"saved-{world_size}-{stage}", extra={"note": "hello", "step": SAVE_AT})
        losses = _train(model, engine, range(SAVE_AT, TOTAL_STEPS))
        results[stage] = {"losses": losses, "final": engine.full_state_dict()}
        engine.unshard()
    return results


def _resume_job(rank: int, world_size: int, cases: list[tuple[int, int, int]], directory: str) -> dict[tuple, dict]:
    """For each (saved world size, saved stage, stage): load, re-save, train on."""
    results = {}
    for save_world, save_stage, stage in cases:
        model, engine = _engine(stage)
        extra = engine.load_checkpoint(Path(directory) / f"saved-{save_world}-{save_stage}")
        engine.save_checkpoint(Path(directory) / f"reloaded-{save_world}-{save_stage}-{world_size}-{stage}")
        losses = _train(model, engine, range(SAVE_AT, TOTAL_STEPS))
        results[(save_world, save_stage, stage)] = {
            "losses": losses, "final": engine.full_state_dict(), "extra": extra, "steps": engine.steps_taken
        }
        engine.unshard()
    return results


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, list):
        return _flatten(dict(enumerate(tree)), prefix)
    return {prefix[:-1]: tree}


CASES = [(4, 3, 4, 3), (4, 3, 2, 3), (4, 2, 3, 2), (4, 1, 1, 1), (2, 3, 2, 1), (2, 1, 2, 3), (2, 2, 3, 3)]


@pytest.fixture(scope="module")
def roundtrips(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """One spawn per world size: all saves, then all resumes, of every case."""
    directory = tmp_path_factory.mktemp("roundtrip")
    saved = {}
    for world in sorted({c[0] for c in CASES}):
        stages = sorted({c[1] for c in CASES if c[0] == world})
        saved[world] = run_distributed(_save_job, world, stages, str(directory))[0]
    resumed = {}
    for world in sorted({c[2] for c in CASES}):
        cases = [(c[0], c[1], c[3]) for c in CASES if c[2] == world]
        resumed[world] = run_distributed(_resume_job, world, cases, str(directory))[0]
    return directory, saved, resumed


@pytest.mark.parametrize("save_world, save_stage, load_world, load_stage", CASES)
def test_resume_at_any_world_size_and_stage(
    roundtrips: tuple, save_world: int, save_stage: int, load_world: int, load_stage: int
) -> None:
    directory, saved, resumed = roundtrips
    original = _flatten(load_full_checkpoint(directory / f"saved-{save_world}-{save_stage}"))
    reloaded = _flatten(load_full_checkpoint(directory / f"reloaded-{save_world}-{save_stage}-{load_world}-{load_stage}"))
    assert original.keys() == reloaded.keys()
    assert any(k.startswith("optimizer_0.state.") and k.endswith("exp_avg_sq") for k in original)
    for key, value in original.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, reloaded[key]), f"{key} changed in a load/save round trip"
        else:
            assert value == reloaded[key], key

    reference = saved[save_world][save_stage]
    ours = resumed[load_world][(save_world, save_stage, load_stage)]
    assert ours["extra"] == {"note": "hello", "step": SAVE_AT}
    assert ours["steps"] == TOTAL_STEPS
    if save_world == load_world:
        assert ours["losses"] == reference["losses"]
        tolerance = 0.0
    else:
        assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        tolerance = 1e-5
    assert relative_difference(ours["final"], reference["final"]) <= tolerance
