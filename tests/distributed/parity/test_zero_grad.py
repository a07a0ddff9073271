"""``optimizer.zero_grad()`` and ``model.zero_grad()`` drop the gradients accumulated since the last step,
as under DDP, whichever way they are reached: the common skip-on-NaN loop trains on, with DDP's gradient
norms and weights at every step, at stages 1, 2 and 3 (and stage 1 under hybrid sharding)."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.paths import TESTS
from tests.rank_pool import by_rank, free_port, run_distributed, run_each
from zero_core import ZeroConfig, ZeroEngine, engine_of

STEPS = 5
NAN_STEP = 1  # rank 0's loss is NaN: DDP's averaged gradients are NaN on every rank, and the step is skipped
SKIPPED_STEP = 3  # finite gradients, skipped all the same: they must not leak into the next step

# How each run drops its gradients: (what is called on ours, what on DDP's).
ROUTES = {
    "optimizer.zero_grad()": lambda model, optimizer: optimizer.zero_grad(),
    "optimizer.zero_grad(set_to_none=False)": lambda model, optimizer: optimizer.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda model, optimizer: model.zero_grad(),
}


def _max_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    return max((ours[key] - theirs[key]).abs().max().item() for key in theirs)


def _skip_on_nan_run(rank: int, stage: int, shard_group_size: int | None, route: str) -> dict:
    """The loop users write: clip, step only when the norm is finite, zero the gradients every step.
    Stage 1 also accumulates a micro-batch inside no_sync that a zero_grad drops (DDP drops it too)."""
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    reference = DistributedDataParallel(copy.deepcopy(model))
    # SGD with momentum: gradients that leaked, or a step that was not skipped, show in the weights.
    engine = ZeroEngine(model, make_optimizer("sgd", model), ZeroConfig(stage=stage, shard_group_size=shard_group_size))
    ours_optimizer, reference_optimizer = engine.optimizer, make_optimizer("sgd", reference.module)
    zero = ROUTES[route]
    norms, differences = [], []
    for step in range(STEPS):
        ids = batch(step, rank)
        if step == 0:  # dropped by the zero_grad below, on both
            with engine.no_sync(), reference.no_sync():
                engine.backward(lm_loss(model(ids), ids) * 3.0)
                (lm_loss(reference(ids), ids) * 3.0).backward()
            zero(model, ours_optimizer)
            zero(reference.module, reference_optimizer)
        poison = float("nan") if step == NAN_STEP and rank == 0 else 1.0
        engine.backward(lm_loss(model(ids), ids) * poison)
        (lm_loss(reference(ids), ids) * poison).backward()
        ours = engine.clip_grad_norm_(1.0).item()
        theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
        norms.append((ours, theirs))
        if math.isfinite(theirs) and step != SKIPPED_STEP:
            ours_optimizer.step()
            reference_optimizer.step()
        zero(model, ours_optimizer)
        zero(reference.module, reference_optimizer)
        differences.append(_max_difference(engine.full_state_dict(), reference.module.state_dict()))
    engine.unshard()
    return {"norms": norms, "differences": differences}


def _partial_run(rank: int, stage: int) -> dict:
    """``model.blocks[1].zero_grad()`` drops that block's gradients only: the step skips its parameters
    (set_to_none) and steps the rest, as under DDP."""
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    reference = DistributedDataParallel(copy.deepcopy(model))
    engine = ZeroEngine(model, make_optimizer("sgd", model), ZeroConfig(stage=stage))
    reference_optimizer = make_optimizer("sgd", reference.module)
    differences = []
    for step in range(2):
        ids = batch(step, rank)
        engine.backward(lm_loss(model(ids), ids))
        lm_loss(reference(ids), ids).backward()
        model.blocks[1].zero_grad()
        reference.module.blocks[1].zero_grad()
        engine.step()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        differences.append(_max_difference(engine.full_state_dict(), reference.module.state_dict()))
    with engine.gathered_parameters(model.head, writeback=False):
        copied = copy.deepcopy(model.head)  # a copy's zero_grad is its own: the engine's gradients stay
    ids = batch(2, rank)
    engine.backward(lm_loss(model(ids), ids))
    copied.zero_grad()
    kept = engine.grad_norms()["grad_2.0_norm_total"].item()
    engine.unshard()
    model.zero_grad()  # unsharded: torch's own again
    return {
        "differences": differences,
        "kept": kept,
        "routed": engine_of(model) is None and "zero_grad" not in vars(model),
    }


def _skip_on_nan_worker(rank: int, world_size: int) -> list[dict]:
    results = []
    for stage, shard_group_size in ((1, None), (2, None), (3, None), (1, 1)):
        for route in ROUTES:
            result = _skip_on_nan_run(rank, stage, shard_group_size, route)
            results.append({"stage": stage, "hybrid": shard_group_size is not None, "route": route, **result})
    return results


def _partial_worker(rank: int, world_size: int) -> list[dict]:
    return [{"stage": stage, **_partial_run(rank, stage)} for stage in (1, 2, 3)]


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return run_distributed(run_each, 2, {"skip on nan": _skip_on_nan_worker, "partial": _partial_worker})


def test_a_step_skipped_on_nan_trains_on_as_ddp_through_every_zero_grad(grid: list) -> None:
    for results in by_rank(grid, "skip on nan"):
        for result in results:
            case = (result["stage"], result["hybrid"], result["route"])
            for step, (ours, theirs) in enumerate(result["norms"]):
                if step == NAN_STEP:
                    assert math.isnan(ours) and math.isnan(theirs), case
                else:
                    assert ours == pytest.approx(theirs, rel=1e-5), (case, step, result["norms"])
            assert max(result["differences"]) < 1e-6, (case, result["differences"])


def test_a_submodules_zero_grad_drops_its_own_gradients_only(grid: list) -> None:
    for results in by_rank(grid, "partial"):
        for result in results:
            assert max(result["differences"]) < 1e-6, (result["stage"], result["differences"])
            assert result["kept"] > 0, result["stage"]
            assert result["routed"], result["stage"]


def test_accelerates_skip_on_nan_loop_trains_on_as_accelerates_ddp(tmp_path: Path) -> None:
    """The loop from Accelerate users' scripts: ``optimizer.zero_grad()`` on Accelerate's wrapper drops
    the NaN gradients and the skipped step's, at every stage, with DDP's norms and weights at every step.
    Why a process of its own: plain Accelerate's DDP is the reference, and it runs under its own launcher."""
    script = TESTS / "scripts" / "accelerate_skip_on_nan.py"
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu"]
    launch += ["--num_processes", "2", "--main_process_port", str(free_port())]
    env = {key: value for key, value in os.environ.items() if not key.startswith("ACCELERATE_ZERO")}
    result = subprocess.run(
        [*launch, str(script), str(tmp_path)],
        env={**env, "ACCELERATE_USE_CPU": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    reference = torch.load(tmp_path / "ddp.pt", weights_only=True)
    for stage in (1, 2, 3):
        ours = torch.load(tmp_path / f"zero{stage}.pt", weights_only=True)
        assert ours["norms"] == pytest.approx(reference["norms"], rel=1e-5, nan_ok=True), stage
        assert math.isnan(ours["norms"][NAN_STEP]), stage
        for step, (mine, theirs) in enumerate(zip(ours["weights"], reference["weights"])):
            assert _max_difference(mine, theirs) < 1e-6, (stage, step)
