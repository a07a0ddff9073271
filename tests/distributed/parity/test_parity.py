"""ZeRO stages 1-3 train exactly like DDP, step by step, at world sizes 1-4.

One spawn per world size runs the whole grid: stages x {SGD with momentum,
AdamW}, plus accumulation with clipping and prefetch off. The model has tied
embeddings, a frozen layer, BatchNorm buffers, a branch unused every third
step, and two param groups with their own hyperparameters.
"""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import run_distributed
from tests.workers import parity_grid

TOLERANCE = 1e-5  # relative, fp32
STAGES = (1, 2, 3)
CASES = [dict(stage=s, optimizer_name=o) for s in STAGES for o in ("sgd", "adamw")]
CASES += [dict(stage=s, optimizer_name="sgd", micro_batches=3, clip=0.05) for s in STAGES]
CASES += [dict(stage=s, optimizer_name="adamw", micro_batches=2, clip=0.5) for s in STAGES]
CASES += [dict(stage=3, optimizer_name="adamw", prefetch=0), dict(stage=3, optimizer_name="sgd", prefetch=2)]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"world{n}")
def grid(request: pytest.FixtureRequest) -> tuple[int, list[list[dict]]]:
    world_size = request.param
    return world_size, run_distributed(parity_grid, world_size, CASES)


def _case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_losses_and_parameters_match_ddp(grid: tuple[int, list], index: int) -> None:
    world_size, per_rank = grid
    for rank, results in enumerate(per_rank):
        result = results[index]
        assert len(result["param_errors"]) == 5
        for step, error in enumerate(result["param_errors"]):
            assert error <= TOLERANCE, f"rank {rank} step {step}: parameters differ by {error:.2e}"
        for ours, reference in zip(result["losses"], result["reference_losses"]):
            assert ours == pytest.approx(reference, rel=TOLERANCE)
        for ours, reference in result["norms"]:
            assert ours == pytest.approx(reference, rel=TOLERANCE)


def test_training_moves_parameters(grid: tuple[int, list]) -> None:
    """Guard against a vacuous parity: the losses must change over the steps."""
    _, per_rank = grid
    losses = per_rank[0][0]["losses"]
    assert len(set(round(x, 6) for x in losses)) > 1


@pytest.mark.parametrize("prefetch_index", [CASES.index(dict(stage=3, optimizer_name="adamw", prefetch=0))])
def test_live_gathered_units_bounded(grid: tuple[int, list], prefetch_index: int) -> None:
    """Root + the running block, plus ``prefetch`` blocks ahead (the model nests two deep)."""
    _, per_rank = grid
    for results in per_rank:
        for case, result in zip(CASES, results):
            if case["stage"] != 3:
                continue
            assert result["peak_live_units"] <= 2 + case.get("prefetch", 1)
        assert results[prefetch_index]["peak_live_units"] == 2


def test_prefetch_does_not_change_results(grid: tuple[int, list]) -> None:
    _, per_rank = grid
    with_prefetch = CASES.index(dict(stage=3, optimizer_name="adamw"))
    without = CASES.index(dict(stage=3, optimizer_name="adamw", prefetch=0))
    for results in per_rank:
        a, b = results[with_prefetch], results[without]
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["final_state"][k], b["final_state"][k]) for k in a["final_state"])
