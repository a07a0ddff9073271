"""The offload plan: the settings typed once, and where each unit's tensors rest.

The fast tests hold the plan's table (every mode, precision, device kind and stage-3 unit kind). The
distributed test builds real engines across the same grid on this machine's CPU device and checks the
plan against the tensors the units really hold: the master is a tensor of its own exactly where the plan
says so, and rests in a file exactly where the plan says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.models import TinyTransformer, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for
from zero_core import MixedPrecision, ZeroConfig, ZeroEngine
from zero_core.offload_plan import OffloadPlan, OffloadTier, Rest, units_to_offload
from zero_core.unit import FlatUnit

TIERS = list(OffloadTier)


def test_the_plan_is_read_from_the_settings_and_steps_in_backward_only_with_an_offloaded_optimizer() -> None:
    plan = ZeroConfig(offload_optimizer="nvme", offload_params="cpu", offload_fraction=0.5).offload
    assert (plan.optimizer, plan.params, plan.fraction) == (OffloadTier.NVME, OffloadTier.CPU, 0.5)
    assert plan.uses_files and not ZeroConfig(offload_optimizer="cpu").offload.uses_files
    assert ZeroConfig(offload_step_in_backward=True).offload.step_in_backward is False
    assert ZeroConfig(offload_step_in_backward=True, offload_optimizer="cpu").offload.step_in_backward is True
    assert ZeroConfig().offload.offloaded_units([5, 3]) == set()
    assert ZeroConfig(offload_optimizer="cpu", offload_fraction=0.6).offload.offloaded_units([5, 3]) == {0}


def test_units_are_offloaded_largest_first_frozen_ones_never() -> None:
    assert units_to_offload([4, 10, 0, 6], 1.0) == {0, 1, 3}
    assert units_to_offload([4, 10, 0, 6], 0.5) == {1}  # at least the largest, within the share
    assert units_to_offload([4, 10, 0, 6], 0.8) == {1, 3}
    assert units_to_offload([0, 0], 1.0) == set()


@pytest.mark.parametrize("host_is_device", [False, True], ids=["gpu", "cpu-device"])
@pytest.mark.parametrize("low_precision", [False, True], ids=["fp32", "bf16"])
def test_where_a_units_tensors_rest(host_is_device: bool, low_precision: bool) -> None:
    for optimizer, params, offloaded, sharded in itertools.product(TIERS, TIERS, (False, True), (False, True)):
        if offloaded and not optimizer.offloads:
            continue
        unit = OffloadPlan(optimizer=optimizer, params=params).for_unit(
            offloaded, sharded, low_precision, host_is_device
        )
        where = (optimizer, params, offloaded, sharded)
        # The parameter shard moves only where stage 3 shards it at rest.
        assert unit.param_shard is {OffloadTier.NONE: Rest.DEVICE, OffloadTier.CPU: Rest.HOST}.get(
            params if sharded else OffloadTier.NONE, Rest.FILE
        ), where
        state_tier = optimizer if offloaded else OffloadTier.NONE
        assert unit.state_in_file is (state_tier is OffloadTier.NVME), where
        assert (unit.optimizer_state is Rest.HOST) is (state_tier is OffloadTier.CPU), where
        assert (unit.reduced_grad is Rest.HOST) is (offloaded and not host_is_device), where
        # The master is the parameters' own memory only in fp32, where it is the compute shard (or the host
        # parameter shard itself), unless offload_params="nvme" gives the shard a file of its own. On a GPU,
        # offload_params="cpu" leaves a unit that is not offloaded its master on the device, apart from the
        # host shard (unit/storage.py: the compute shard becomes an empty staging buffer).
        shard_in_file = sharded and params is OffloadTier.NVME
        shard_on_host = sharded and params is OffloadTier.CPU
        on_a_gpu = not host_is_device
        own = low_precision or shard_in_file or (offloaded and on_a_gpu and not shard_on_host)
        own = own or (shard_on_host and not offloaded and on_a_gpu)
        assert unit.master_stands_alone is own, where
        # It rests in the optimizer's file where the optimizer state does, if it is a tensor of its own.
        assert unit.master_in_file is (unit.state_in_file and own), where
        if not unit.master_in_file:
            on_host = (offloaded and not host_is_device) or (shard_on_host and not own)
            assert unit.master is (Rest.HOST if on_host else Rest.DEVICE), where


GRID = [
    dict(stage=stage, precision=precision, offload_optimizer=optimizer, offload_params=params)
    for stage in (1, 2, 3)
    for precision in ("fp32", "bf16")
    for optimizer in ("none", "cpu", "nvme")
    for params in ("none", "cpu", "nvme")
    if stage == 3 or params == "none"
]


@contextlib.contextmanager
def _units_built() -> Iterator[list[FlatUnit]]:
    """The units built meanwhile, as the engine builds them (the test reads the tensors they hold)."""
    built: list[FlatUnit] = []
    original = FlatUnit.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        built.append(self)

    FlatUnit.__init__ = init  # type: ignore[method-assign]
    try:
        yield built
    finally:
        FlatUnit.__init__ = original  # type: ignore[method-assign]


def _memory_of(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.untyped_storage().data_ptr()


def _plans_and_tensors(rank: int, world_size: int, directory: str) -> list[dict]:
    results = []
    for case in GRID:
        case = dict(case)
        stage, precision = case.pop("stage"), case.pop("precision")
        mixed = MixedPrecision(compute_dtype=torch.bfloat16) if precision == "bf16" else None
        config = dataclasses.replace(
            config_for(stage, precision=mixed, persistence_threshold=300), offload_dir=directory, **case
        )
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        with _units_built() as units:
            engine = ZeroEngine(model, make_optimizer("adamw", model), config)
        for unit in units:
            unit.storage.master_shard  # noqa: B018 - every master in memory, to compare memory
            sharded = unit.stage_plan.params_sharded_at_rest
            planned = config.offload.for_unit(unit.offloaded, sharded, precision == "bf16", host_is_device=True)
            master = _memory_of(unit.storage.resting_master)
            params_memory = {_memory_of(unit.storage.gathered_params), _memory_of(unit.storage.compute_shard)}
            params_memory.add(_memory_of(unit.storage.host_shard))
            results.append(
                {
                    "case": (stage, precision, case["offload_optimizer"], case["offload_params"], unit.index),
                    "sharded": sharded,
                    "planned alone": planned.master_stands_alone,
                    "alone": master not in params_memory,
                    "planned in file": planned.master_in_file,
                    "in file": unit.master_rests_on_disk,
                    "planned shard": planned.param_shard,
                    "shard in file": unit.storage.params_on_disk,
                    "shard on host": unit.storage.host_shard is not None,
                }
            )
        del engine
    return results


def _a_plan_that_misplaces_the_master(rank: int, world_size: int, directory: str) -> str | None:
    """An fp32 stage-1 unit on a CPU device: its master is the parameters' own memory, and a plan that put it
    in the optimizer's file (which frees it between steps) would free the parameters."""
    original = OffloadPlan.for_unit

    def misplaced(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return dataclasses.replace(original(self, *args, **kwargs), master=Rest.FILE)

    OffloadPlan.for_unit = misplaced  # type: ignore[method-assign]
    try:
        config = dataclasses.replace(config_for(1), offload_optimizer="nvme", offload_dir=directory)
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        ZeroEngine(model, make_optimizer("adamw", model), config)
    except RuntimeError as error:
        return str(error)
    finally:
        OffloadPlan.for_unit = original  # type: ignore[method-assign]
    return None


def test_a_plan_that_disagrees_with_the_tensors_is_refused_before_any_step(tmp_path: Path) -> None:
    messages = run_distributed(_a_plan_that_misplaces_the_master, 2, str(tmp_path), timeout=300)
    assert messages[0] is not None and "internal error: the offload plan puts" in messages[0], messages
    assert messages[0] == messages[1]  # alike on every rank


def test_the_plan_says_where_real_units_keep_their_master_and_shard(tmp_path: Path) -> None:
    results = run_distributed(_plans_and_tensors, 2, str(tmp_path), timeout=600)
    kinds = set()
    for rows in results:
        for row in rows:
            kinds.add(row["sharded"])
            assert row["planned alone"] == row["alone"], row
            assert row["planned in file"] == row["in file"], row
            assert row["shard in file"] == (row["planned shard"] is Rest.FILE), row
            assert row["shard on host"] == (row["planned shard"] is not Rest.DEVICE), row
    assert kinds == {True, False}  # stage 3's units both sharded at rest and kept whole (persistence_threshold)
