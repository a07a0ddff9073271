"""Stage 3 with small units kept gathered (``ZeroConfig(persistence_threshold=...)``,
the hybrid of stages 2 and 3): exact against DDP, and its traffic and memory
follow the formulas with Ψ split into the large (sharded) units Ψ_L and the
small (persistent) ones Ψ_S: ``3Ψ_L + 2Ψ_S`` elements moved per step, and
``16Ψ_L/N + 4Ψ_S + 12Ψ_S/N`` bytes held (fp32, Adam). Checkpoints do not
depend on which units persist. One spawn at 2 ranks."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import GptRun, relative_difference, train_against_ddp
from zero_core import MixedPrecision

WORLD = 2
TOLERANCE = 1e-5
# The test model's root unit (1168 parameters) persists, its blocks (1904 each) stay sharded.
TINY_THRESHOLD = 1500
PARITY = [
    dict(stage=3, optimizer_name="adamw"),
    dict(stage=3, optimizer_name="sgd", micro_batches=3, clip=0.05),
    dict(stage=3, optimizer_name="adamw", prefetch=2),
]
# The GPT example's root unit (embeddings, final norm: 4672 parameters) persists, its blocks (12704) do not.
GPT_THRESHOLD = 5000


def _parity(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [train_against_ddp(**case, persistence_threshold=TINY_THRESHOLD) for case in PARITY]


def _accounting(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    run = GptRun(3, persistence_threshold=GPT_THRESHOLD)
    engine = run.engine
    run.train_step(0)
    run.train_step(1)
    traffic = engine.last_step_traffic
    resting = {name: p.untyped_storage().nbytes() for name, p in run.model.named_parameters()}
    run.backward(2)
    report = engine.memory_report()
    engine.zero_grad()
    units = engine.unit_reports()
    persistent = [u for u in units if u.name in engine.persistent_units]
    result = {
        "persistent_units": engine.persistent_units,
        "small_padded": sum(u.padded_numel for u in persistent),
        "large_padded": sum(u.padded_numel for u in units if u not in persistent),
        **run.sizes(),
        "all_gather_bytes": traffic["all_gather"].bytes,
        "reduce_scatter_bytes": traffic["reduce_scatter"].bytes,
        "resting": resting,
        "report": report,
    }
    # model.state_dict() exports every unit alike: fp32 CPU snapshots of the master values,
    # also under bf16 compute, where the persistent units' own parameters are bf16.
    bf16 = GptRun(3, persistence_threshold=GPT_THRESHOLD, mixed_precision=MixedPrecision(compute_dtype=torch.bfloat16))
    bf16.train_step(0)
    exported = bf16.model.state_dict()
    full = bf16.engine.full_state_dict()
    result["state_dict_kinds"] = sorted(
        {(str(v.dtype), v.device.type) for v in exported.values() if v.is_floating_point()}
    )
    result["state_dict_equal"] = exported.keys() == full.keys() and all(torch.equal(exported[k], full[k]) for k in full)
    bf16.train_step(1)
    result["state_dict_kept"] = all(torch.equal(exported[k], full[k]) for k in full)  # a snapshot, not live views
    # Which units persist is no part of a checkpoint: saved with, loaded without, and back.
    engine.save_checkpoint(Path(directory) / "persistent")
    state = engine.full_state_dict()
    sharded = GptRun(3).engine
    sharded.load_checkpoint(Path(directory) / "persistent")
    result["loaded_without"] = relative_difference(sharded.full_state_dict(), state)
    sharded.save_checkpoint(Path(directory) / "sharded")
    again = GptRun(3, persistence_threshold=GPT_THRESHOLD).engine
    again.load_checkpoint(Path(directory) / "sharded")
    result["loaded_back"] = relative_difference(again.full_state_dict(), state)
    return result


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("persistence"))
    workers = {"parity": _parity, "accounting": functools.partial(_accounting, directory=directory)}
    return run_distributed(run_each, WORLD, workers, timeout=600)


@pytest.mark.parametrize("index", range(len(PARITY)), ids=["-".join(f"{k}={v}" for k, v in c.items()) for c in PARITY])
def test_persistent_small_units_train_like_ddp(grid: list, index: int) -> None:
    for rank, results in enumerate(by_rank(grid, "parity")):
        result = results[index]
        for step, error in enumerate(result["param_errors"]):
            assert error <= TOLERANCE, f"rank {rank} step {step}: parameters differ from DDP by {error:.2e}"
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE)
        for ours, reference in result["norms"]:
            assert ours == pytest.approx(reference, rel=TOLERANCE)


def test_traffic_is_three_large_plus_two_small(grid: list) -> None:
    """Large units: all-gathered in forward and backward, reduce-scattered; small ones:
    reduce-scattered and all-gathered once after the step."""
    for result in by_rank(grid, "accounting"):
        assert result["persistent_units"] == [""]  # the root unit only
        small, large = result["small_padded"], result["large_padded"]
        assert result["all_gather_bytes"] == (2 * large + small) * 4
        assert result["reduce_scatter_bytes"] == (large + small) * 4


def test_memory_holds_the_small_units_in_full(grid: list) -> None:
    for rank, result in enumerate(by_rank(grid, "accounting")):
        small, large = result["small_padded"], result["large_padded"]
        report = result["report"]
        slack = 4 * WORLD * result["units"] + 8 * result["param_tensors"]
        assert report.parameter_bytes == 4 * large // WORLD + 4 * small
        assert abs(report.gradient_bytes - 4 * (large + small) // WORLD) <= slack
        assert abs(report.optimizer_state_bytes - 8 * (large + small) // WORLD) <= slack
        resting = result["resting"]
        assert all(
            nbytes > 0 for name, nbytes in resting.items() if name.startswith(("embed", "position", "ln_final"))
        ), resting
        assert all(nbytes == 0 for name, nbytes in resting.items() if name.startswith("blocks."))


def test_state_dict_exports_persistent_units_like_sharded_ones(grid: list) -> None:
    for result in by_rank(grid, "accounting"):
        assert result["state_dict_kinds"] == [("torch.float32", "cpu")]
        assert result["state_dict_equal"] and result["state_dict_kept"]


def test_checkpoints_do_not_depend_on_which_units_persist(grid: list) -> None:
    for result in by_rank(grid, "accounting"):
        assert result["loaded_without"] == 0.0
        assert result["loaded_back"] == 0.0
