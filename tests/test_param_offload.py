"""offload_params="cpu" (stage 3): each sharded unit's parameter shard rests in host memory and is staged
to the device for each gather. Training equals the in-memory run bit for bit, the shards really rest on the
host (the device's staging buffers are empty between gathers and bounded by the gathers in flight during
forward and backward), the report and the estimate count them, checkpoints cross modes, and every setting
that cannot mean anything is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import zero_core.unit.storage as storage
from zero_core import MixedPrecision, UnitReport, ZeroConfig, ZeroEngine, estimate
from zero_core.estimate import EstimateSettings, UnitCount, estimate_units

from .distributed import run_distributed
from .models import TinyTransformer, batch, make_optimizer
from .workers import config_for, relative_difference, train_accumulated

PRECISIONS = {
    "fp32": None,
    "bf16": MixedPrecision(compute_dtype=torch.bfloat16),
    # A first scale that overflows: the first step is skipped, as the in-memory run skips it.
    "fp16": MixedPrecision(compute_dtype=torch.float16, initial_loss_scale=2.0**16),
}


def _engine(offload_params: str, directory: str, optimizer: str = "adamw", **settings) -> ZeroEngine:
    precision = PRECISIONS[settings.pop("precision", "fp32")]
    prefetch = settings.pop("prefetch", 1)
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    config = dataclasses.replace(
        config_for(3, prefetch=prefetch, precision=precision),
        offload_params=offload_params,
        offload_dir=directory,
        **settings,
    )
    return ZeroEngine(model, make_optimizer(optimizer, model), config)


CASES = [
    {},
    {"precision": "bf16"},
    {"precision": "fp16"},
    {"optimizer": "sgd", "accumulate": 2},
    {"prefetch": 2},
    {"offload_optimizer": "cpu"},
    {"offload_optimizer": "nvme", "precision": "bf16"},
    {"offload_optimizer": "cpu", "offload_fraction": 0.3},
    {"shard_group_size": 1},  # hybrid sharding at 2 ranks: groups of one
    {"persistence_threshold": 1500},  # the root unit (1,168 parameters) stays gathered, on the device
]


def _shard_bytes(engine: ZeroEngine, report: UnitReport) -> int:
    """One rank's parameter shard of a unit, in the compute dtype."""
    return report.shard_numel * torch.empty(0, dtype=engine.config.mixed_precision.compute_dtype).element_size()


def _parity(rank: int, world_size: int, directory: str) -> list[dict]:
    """Each case beside the in-memory run; the parameter bytes really alive (``memory_report``: every
    storage the units keep, staging buffers included) recorded in both, in forward and backward: the
    gathers follow the same schedule, so the difference is what the staging buffers hold."""
    results = []
    original_wait, original_start = storage.ParamStorage.wait_gathered, storage.ParamStorage.start_gather
    for case in CASES:
        case = dict(case)
        accumulate = case.pop("accumulate", 1)
        # An offloaded optimizer steps with torch's fused CPU kernel: the reference uses it too.
        fused = {"optimizer": "adamw-fused"} if "offload_optimizer" in case else {}
        alive: dict[str, list[int]] = {"reference": [], "ours": []}
        engines: dict[str, ZeroEngine] = {}
        training: list[str] = []  # the engine training now

        def recorded(original):  # type: ignore[no-untyped-def]
            def method(self):  # type: ignore[no-untyped-def]
                original(self)
                if training:  # not while an engine is being built
                    alive[training[-1]].append(engines[training[-1]].memory_report().parameter_bytes)

            return method

        storage.ParamStorage.wait_gathered = recorded(original_wait)  # type: ignore[method-assign]
        storage.ParamStorage.start_gather = recorded(original_start)  # type: ignore[method-assign]
        try:
            engines["reference"] = reference = _engine("none", directory, **dict(case, **fused))
            training.append("reference")
            expected = train_accumulated(reference, rank, range(4), accumulate)
            training.clear()
            engines["ours"] = ours = _engine("cpu", directory, **case)
            training.append("ours")
            losses = train_accumulated(ours, rank, range(4), accumulate)
        finally:
            storage.ParamStorage.wait_gathered = original_wait  # type: ignore[method-assign]
            storage.ParamStorage.start_gather = original_start  # type: ignore[method-assign]
        reports = ours.unit_reports()
        offloaded = [r for r in reports if r.params_offloaded]
        fp32 = ours.config.mixed_precision.compute_dtype == torch.float32
        report, reference_report = ours.memory_report(), reference.memory_report()
        staged = [a - b for a, b in zip(alive["ours"], alive["reference"])]
        results.append(
            {
                "case": {"accumulate": accumulate, **case},
                "same losses": losses == expected,
                "weights difference": relative_difference(ours.full_state_dict(), reference.full_state_dict()),
                "units": len(reports),
                "persistent": sum(r.persistent for r in reports),
                "offloaded": len(offloaded),
                "same gathers": len(alive["ours"]) == len(alive["reference"]) > 0,
                "most staged in a pass": max(staged),
                "least staged in a pass": min(staged),
                "largest shard bytes": max(_shard_bytes(ours, r) for r in offloaded),
                "prefetch": case.get("prefetch", 1),
                "parameter bytes": report.parameter_bytes,
                "reference parameter bytes": reference_report.parameter_bytes,
                "host bytes": report.host_bytes,
                "reference host bytes": reference_report.host_bytes,
                # In fp32 an offloaded master (offload_optimizer) is the host shard itself: counted once.
                "shard bytes moved": sum(_shard_bytes(ours, r) for r in offloaded if not (fp32 and r.offloaded)),
            }
        )
    return results


@pytest.mark.distributed
def test_parameter_shards_rest_on_the_host_and_training_is_bit_for_bit_the_same(tmp_path: Path) -> None:
    for rank_results in run_distributed(_parity, 2, str(tmp_path)):
        for result in rank_results:
            case = result["case"]
            assert result["same losses"] and result["weights difference"] == 0.0, case
            assert result["offloaded"] == result["units"] - result["persistent"] > 0, case
            assert (result["persistent"] > 0) == ("persistence_threshold" in case), case
            # Between gathers the device holds no parameter shard (the same parameter bytes as in memory, now on
            # the host); during forward and backward only the gathers in flight (prefetched) hold a staged copy.
            assert result["parameter bytes"] == result["reference parameter bytes"], case
            assert result["host bytes"] == result["reference host bytes"] + result["shard bytes moved"], case
            assert result["same gathers"], case
            assert 0 <= result["least staged in a pass"], case
            assert 0 < result["most staged in a pass"] <= result["prefetch"] * result["largest shard bytes"], case


def _round_trips(rank: int, world_size: int, directory: str) -> dict:
    results = {}
    uninterrupted = _engine("none", directory)
    train_accumulated(uninterrupted, rank, range(4))
    expected = uninterrupted.full_state_dict()
    for saved_with, loaded_with, stage in (("cpu", "none", 3), ("none", "cpu", 3), ("cpu", "none", 2)):
        first = _engine(saved_with, directory)
        train_accumulated(first, rank, range(2))
        path = Path(directory) / f"ckpt-{saved_with}-{loaded_with}-{stage}"
        first.save_checkpoint(path)
        second = _engine(loaded_with, directory, stage=stage)
        second.load_checkpoint(path)
        train_accumulated(second, rank, range(2, 4))
        results[f"{saved_with} -> {loaded_with} at stage {stage}"] = relative_difference(
            second.full_state_dict(), expected
        )
    # Writing a full parameter value (load_state_dict) reaches the host shard the next gather stages.
    engine = _engine("cpu", directory)
    new_values = {k: torch.full_like(v, 0.25) for k, v in engine.full_state_dict().items()}
    engine.model.load_state_dict(new_values)
    ids = batch(0, rank)
    with torch.no_grad():
        results["forward after a load"] = engine.model(ids).tolist() == _forward_with(new_values, ids)
    return results


def _forward_with(values: dict[str, torch.Tensor], ids: torch.Tensor) -> list:
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    model.load_state_dict(values)
    with torch.no_grad():
        return model(ids).tolist()


@pytest.mark.distributed
def test_checkpoints_cross_parameter_offload_modes_and_stages(tmp_path: Path) -> None:
    for results in run_distributed(_round_trips, 2, str(tmp_path)):
        assert results.pop("forward after a load")
        assert all(difference == 0.0 for difference in results.values()), results


def test_what_cannot_mean_anything_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="offload_params='cpu' needs stage=3: at stage 1 every rank keeps"):
        ZeroConfig(stage=1, offload_params="cpu")
    with pytest.raises(ValueError, match="offload_params='nvme' is not supported yet: use offload_params='cpu'"):
        ZeroConfig(stage=3, offload_params="nvme")
    with pytest.raises(ValueError, match="offload_params='gpu' is invalid: use 'none' or 'cpu' or 'nvme'"):
        ZeroConfig(stage=3, offload_params="gpu")


def test_the_estimate_moves_the_shards_to_the_host() -> None:
    """Stage 3 with offload_params: the parameter shards' bytes move from the device to the host; in fp32 on
    a GPU the master then stays on the device as a tensor of its own (it was the shard)."""
    numel, world = 1_000_000, 4
    shard = numel / world
    for precision, compute in ((MixedPrecision(compute_dtype=torch.bfloat16), 2), (MixedPrecision(), 4)):
        plain = estimate(numel, world, precision=precision)[3]
        moved = estimate(numel, world, precision=precision, offload_params="cpu")[3]
        assert moved.parameter_bytes == plain.parameter_bytes == shard * compute
        assert moved.host_bytes == shard * compute
        master_of_its_own = 4 * shard if compute == 4 else 0
        assert moved.device_bytes == plain.device_bytes - shard * compute + master_of_its_own
    # Both offloads, fp32: the host master is the shard itself, and the device holds the gradient shard only.
    both = estimate(numel, world, offload_params="cpu", offload_optimizer="cpu")[3]
    assert both.device_bytes == 4 * shard
    units = [UnitCount(numel, numel)]
    on_cpu = estimate_units(units, EstimateSettings(world, offload_params="cpu", host_is_device=True))[3]
    assert on_cpu.host_bytes == 4 * shard and on_cpu.optimizer_state_bytes == 8 * shard  # the master is the shard
