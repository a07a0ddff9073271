"""Gradient accumulation equals one big batch; the optimizer object, its
scheduler and the full-parameter views behave as a user expects."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, relative_difference
from zero_core import ZeroEngine

MICRO_BATCHES = 3


def _accumulate_vs_big_batch(rank: int, world_size: int, stage: int) -> float:
    """Worst relative parameter difference, over 3 steps, to one process on the whole batch."""
    torch.manual_seed(0)
    reference = TinyTransformer().eval()  # BatchNorm on running statistics: batch-size independent
    model = copy.deepcopy(reference)
    reference_optimizer = make_optimizer("sgd", reference)
    engine = ZeroEngine(model, make_optimizer("sgd", model), config_for(stage))
    worst = 0.0
    for step in range(3):
        micro = [[batch(100 * step + m, r) for m in range(MICRO_BATCHES)] for r in range(world_size)]
        for m, ids in enumerate(micro[rank]):
            with engine.no_sync() if m < MICRO_BATCHES - 1 else contextlib.nullcontext():
                engine.backward(lm_loss(model(ids), ids) / MICRO_BATCHES)
        engine.clip_grad_norm_(0.5)
        engine.step()
        everything = torch.cat([ids for per_rank in micro for ids in per_rank])
        lm_loss(reference(everything), everything).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        worst = max(worst, relative_difference(engine.full_state_dict(), reference.state_dict()))
    return worst


def _scheduler_and_views(rank: int, world_size: int, stage: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TinyTransformer()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer("adamw", model, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # bound before sharding
    engine = ZeroEngine(model, optimizer, config_for(stage))
    same_object = engine.optimizer is optimizer
    full_at_start = relative_difference(engine.full_state_dict(), {k: v.float() for k, v in initial.items()})
    lrs = []
    for step in range(3):
        ids = batch(step, rank)
        engine.backward(lm_loss(model(ids), ids))
        engine.step()
        scheduler.step()
        lrs.append([group["lr"] for group in optimizer.param_groups])
    with engine.gathered_parameters():
        shapes_ok = model.blocks[0].up.weight.shape == (48, 16)
        seen_norm = float(model.blocks[0].up.weight.norm())
        with torch.no_grad():
            model.blocks[1].down.bias.fill_(0.25)
    full = engine.full_state_dict()
    ids = batch(9, rank)
    loss_after_edit = lm_loss(model(ids), ids).item()
    fresh = TinyTransformer()
    fresh.load_state_dict(full)
    fresh_loss = lm_loss(fresh(ids), ids).item()
    return {
        "same_object": same_object,
        "full_at_start": full_at_start,
        "lrs": lrs,
        "shapes_ok": shapes_ok,
        "norm_matches": abs(seen_norm - float(full["blocks.0.up.weight"].norm())) < 1e-5,
        "edit_written_back": bool((full["blocks.1.down.bias"] == 0.25).all()),
        "tied": full["head.weight"].data_ptr() == full["embed.weight"].data_ptr(),
        "loss_after_edit": loss_after_edit,
        "fresh_loss": fresh_loss,
    }


class _AdamWWithItsOwnStep(torch.optim.AdamW):
    """A user's optimizer: its own ``step`` around AdamW's (torch then runs the step hooks at both levels)."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        return super().step(closure)


SUBCLASS_CASES = [(1, "none"), (2, "cpu"), (3, "none")]


def _subclass_steps_once(rank: int, world_size: int, stage: int, offload: str) -> dict[str, object]:
    """Three steps with the subclass after a plain AdamW was built (which gives AdamW.step torch's hooks too),
    against the same steps with AdamW itself."""
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    runs = {}
    for optimizer_class in (_AdamWWithItsOwnStep, torch.optim.AdamW):
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        config = dataclasses.replace(config_for(stage), offload_optimizer=offload)
        engine = ZeroEngine(model, optimizer_class(model.parameters(), lr=1e-2), config)
        for step in range(3):
            ids = batch(step, rank)
            engine.backward(lm_loss(model(ids), ids))
            engine.step()
            engine.zero_grad()
        weights = torch.cat([tensor.flatten() for tensor in engine.full_state_dict().values()])
        runs[optimizer_class.__name__] = {"steps": engine.steps_taken, "weights": weights}
    return runs


def _grid(rank: int, world_size: int) -> dict[str, list]:
    return {
        "accumulation": [_accumulate_vs_big_batch(rank, world_size, s) for s in (1, 2, 3)],
        "api": [_scheduler_and_views(rank, world_size, s) for s in (1, 2, 3)],
        "subclass": [_subclass_steps_once(rank, world_size, *case) for case in SUBCLASS_CASES],
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, list]]:
    return run_distributed(_grid, 3)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_equals_one_big_batch(results: list, stage: int) -> None:
    for per_rank in results:
        assert per_rank["accumulation"][stage - 1] <= 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_scheduler_and_full_parameters(results: list, stage: int) -> None:
    for per_rank in results:
        api = per_rank["api"][stage - 1]
        assert api["same_object"]
        assert api["full_at_start"] == 0.0
        assert api["lrs"] == [[5e-3, 2.5e-3], [2.5e-3, 1.25e-3], [1.25e-3, 6.25e-4]]
        assert api["shapes_ok"] and api["norm_matches"]
        assert api["edit_written_back"]
        assert api["tied"]  # tied names share one tensor, as in model.state_dict()
        assert api["loss_after_edit"] == pytest.approx(api["fresh_loss"], rel=1e-5)


@pytest.mark.parametrize("case", SUBCLASS_CASES, ids=lambda case: f"stage{case[0]}-offload_{case[1]}")
def test_an_optimizer_subclass_calling_super_step_steps_once_per_call(results: list, case: tuple) -> None:
    """Our step hooks run once per step the user takes, not once per level of ``super().step()`` (counted
    twice before; with offload_optimizer it recursed without end)."""
    for per_rank in results:
        runs = per_rank["subclass"][SUBCLASS_CASES.index(case)]
        assert runs["_AdamWWithItsOwnStep"]["steps"] == runs["AdamW"]["steps"] == 3
        assert torch.equal(runs["_AdamWWithItsOwnStep"]["weights"], runs["AdamW"]["weights"])
