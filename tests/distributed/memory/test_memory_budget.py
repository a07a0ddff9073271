"""``ZeroConfig(memory_budget=...)``: the engine chooses its settings with ``fit()`` at setup, on every rank alike,
from the model's ``example_input_array``; trains what it chose exactly as the same settings given by hand; its
checkpoints load where checkpointing was not chosen; a bad budget is refused on every rank with the same words.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from tests.models import SEQ, VOCAB, Block, TinyTransformer, lm_loss
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import refusal
from zero_core import MemoryBudget, WrapPolicy, ZeroConfig, ZeroEngine, fit, setup_summary
from zero_core.memory.fit import DEFAULT_MARGIN, checkpoint_blocks

POLICY = WrapPolicy(module_classes=(Block,))
MICRO_BATCH = 4


def _model(example: bool = True) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(blocks=2, batchnorm=False)
    if example:
        model.example_input_array = torch.zeros(MICRO_BATCH, SEQ, dtype=torch.long)
    return model


def _squeezed_budget() -> int:
    """A device budget every configuration without activation checkpointing is over and one with it is under,
    from fit()'s own predictions (on this CPU only the in-memory tiers are searched: no offload_dir)."""
    model = _model()
    result = fit(model, model.example_input_array, world_size=2, budget="1TiB", wrap_policy=POLICY, device="cpu")
    plain = min(c.predicted.device for c in result.candidates if not c.activation_checkpointing)
    checkpointed = min(c.predicted.device for c in result.candidates if c.activation_checkpointing)
    assert checkpointed < plain
    return math.floor(plain / (1 - DEFAULT_MARGIN)) - 1


def _train(engine: ZeroEngine, rank: int, steps: int = 3) -> list[float]:
    losses = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = lm_loss(engine.model(ids), ids)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def _chosen_and_by_hand(rank: int, world_size: int, directory: str) -> dict[str, object]:
    """The budget's engine against the same settings given by hand (checkpointing applied the same way), then
    its checkpoint loaded by an engine of the chosen stage without checkpointing."""
    budget = _squeezed_budget()
    model = _model()
    requested = ZeroConfig(memory_budget=MemoryBudget(device=budget), wrap_policy=POLICY)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), requested)
    example = _model().example_input_array
    expected = fit(_model(), example, world_size=world_size, budget=budget, wrap_policy=POLICY, device="cpu")
    by_hand_model = _model()
    checkpoint_blocks(by_hand_model, expected.checkpointed_blocks)
    by_hand = ZeroEngine(by_hand_model, torch.optim.AdamW(by_hand_model.parameters(), lr=1e-2), expected.config)
    result = {
        "config is fit's": engine.config == expected.config,
        "requested kept": engine.requested_config == requested,
        "checkpointing": expected.activation_checkpointing,
        "wrapped": sorted(n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)),
        "blocks": sorted(expected.checkpointed_blocks),
        "summary": setup_summary(engine),
        "fit summary": expected.summary(),
        "losses": _train(engine, rank),
        "by hand": _train(by_hand, rank),
    }
    engine.save_checkpoint(f"{directory}/chosen")
    plain_model = _model(example=False)
    plain = ZeroEngine(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-2), expected.config)
    plain.load_checkpoint(f"{directory}/chosen")
    saved, loaded = engine.full_state_dict(), plain.full_state_dict()
    result["loaded equal"] = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    result["resumed"] = _train(engine, rank, 1) == _train(plain, rank, 1)
    return result


def _roomy(rank: int, world_size: int) -> dict[str, object]:
    """A budget everything fits: the cheapest by the cost order, stage 1 without checkpointing."""
    engine = _engine(ZeroConfig(memory_budget="64GiB"))
    return {"stage": engine.config.stage, "checkpointing": engine.fit.activation_checkpointing}


def _expected_auto_share() -> int:
    """This host's memory (from /proc/meminfo) over its two ranks, or the control group's limit over them."""
    total = next(
        int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in line
    )
    from zero_core.memory.machine_memory import cgroup_memory_limit

    _, limit = cgroup_memory_limit()
    return min(total, limit if limit is not None else total) // 2


def _auto(rank: int, world_size: int) -> dict[str, object]:
    engine = _engine(ZeroConfig(memory_budget="auto"))
    return {"device": engine.fit.budget.device, "expected": _expected_auto_share()}


def _engine(config: ZeroConfig, example: bool = True) -> ZeroEngine:
    model = _model(example)
    return ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


def _build(config: ZeroConfig, example: bool = True) -> None:
    _engine(config, example)


def _checkpointed_by_hand() -> None:
    model = _model()
    checkpoint_blocks(model, ("blocks.0",))
    ZeroEngine(model, None, ZeroConfig(memory_budget="64GiB"))


def _refusals(rank: int, world_size: int) -> dict[str, object]:
    budgets = {0: "device=1GiB", 1: "device=2GiB"}
    return {
        "checkpointed by hand": refusal(_checkpointed_by_hand, ValueError),
        "disagreeing": refusal(lambda: _build(ZeroConfig(memory_budget=budgets[rank])), ValueError),
        "no sample": refusal(lambda: _build(ZeroConfig(memory_budget="1GiB"), example=False), ValueError),
        "too small": refusal(lambda: _build(ZeroConfig(memory_budget="1MiB")), ValueError),
        # After the refusals the ranks still train together.
        "then trains": len(_train(_engine(ZeroConfig(memory_budget="64GiB")), rank, 1)) == 1,
    }


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("budget"))
    workers = {
        "chosen": functools.partial(_chosen_and_by_hand, directory=directory),
        "roomy": _roomy,
        "auto": _auto,
        "refusals": _refusals,
    }
    return run_distributed(run_each, 2, workers, timeout=240)


def test_the_engine_runs_fits_choice_and_trains_it_exactly_as_by_hand(grid: list) -> None:
    for result in by_rank(grid, "chosen"):
        assert result["config is fit's"] and result["requested kept"]
        assert result["checkpointing"], "the squeezed budget leaves only checkpointed configurations"
        assert result["wrapped"] == result["blocks"] and result["blocks"]
        assert result["losses"] == result["by hand"]
        assert "memory_budget: " + result["fit summary"] in result["summary"]


def test_a_checkpoint_of_the_chosen_settings_loads_without_checkpointing(grid: list) -> None:
    for result in by_rank(grid, "chosen"):
        assert result["loaded equal"] and result["resumed"]


def test_a_roomy_budget_gets_the_cheapest_settings(grid: list) -> None:
    for result in by_rank(grid, "roomy"):
        assert result == {"stage": 1, "checkpointing": False}


def test_auto_is_each_ranks_share_of_the_host(grid: list) -> None:
    for result in by_rank(grid, "auto"):
        assert result["device"] == result["expected"]


def test_bad_budgets_are_refused_on_every_rank_alike(grid: list) -> None:
    results = by_rank(grid, "refusals")
    assert results[0] == results[1]
    refused = results[0]
    disagreeing = "ZeRO: ranks disagree on config.memory_budget: device=1GiB on rank 0; device=2GiB on rank 1."
    assert refused["disagreeing"].startswith(disagreeing)
    assert "set model.example_input_array to one batch" in refused["no sample"]
    assert "memory_budget chooses activation checkpointing itself" in refused["checkpointed by hand"]
    assert "no configuration fits memory_budget (device 1.00 MiB per rank" in refused["too small"]
    assert "The smallest that fits is device" in refused["too small"]
    assert refused["then trains"]


def test_bad_budgets_are_refused_where_the_config_is_made() -> None:
    with pytest.raises(ValueError, match="memory_budget chooses stage, prefetch.*stage set beside it"):
        ZeroConfig(memory_budget="20GiB", stage=2)
    with pytest.raises(ValueError, match="does not count quantize_gradients"):
        ZeroConfig(memory_budget="20GiB", quantize_gradients=True)
    with pytest.raises(ValueError, match="unknown part"):
        ZeroConfig(memory_budget=MemoryBudget.of("gpu=20GiB"))
    with pytest.raises(ValueError, match="has no device part"):
        ZeroConfig(memory_budget=MemoryBudget.of("host=20GiB"))
