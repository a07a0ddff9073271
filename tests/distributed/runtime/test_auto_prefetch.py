"""``ZeroConfig(prefetch="auto")``: the stage-3 prefetch depth is chosen from the
gather and compute times measured in the first steps, agreed across ranks,
kept within the memory cap, and changes no result: training is bitwise the
same as with a fixed depth."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any
from unittest import mock

import pytest
import torch

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import config_for
from zero_core import ZeroConfig
from zero_core.collectives import CommContext
from zero_core.passes.prefetch_tuning import MEASURED_STEPS, UNTUNED_DEPTH, AutoPrefetch, PrefetchTuning

STEPS = 6


class _Raised(Exception):
    pass


def _raise(*_: Any) -> None:
    raise _Raised("a forward that fails midway")


def _train(
    prefetch: int | str, cap_mb: float = 256.0, forced_choice: int | None = None, raise_at: int | None = None
) -> dict[str, Any]:
    from dataclasses import replace

    from zero_core import ZeroEngine

    torch.manual_seed(0)
    model = TinyTransformer(blocks=4)
    config = replace(config_for(3), prefetch=prefetch, prefetch_cap_mb=cap_mb)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)
    # As if this rank had measured other times: every tuner in this process chooses forced_choice.
    forced = contextlib.nullcontext()
    if forced_choice is not None:
        forced = mock.patch.object(AutoPrefetch, "local_choice", lambda _: forced_choice)
    rank = torch.distributed.get_rank()
    losses, peaks, depths = [], [], []
    for step in range(STEPS):
        engine.reset_peak_live_units()
        if step == raise_at:  # a forward that raises midway, caught on every rank: the batch is skipped
            handle = model.blocks[2].register_forward_hook(_raise)
            try:
                model(batch(step, rank))
            except _Raised:
                pass
            handle.remove()
        ids = batch(step, rank)
        loss = lm_loss(model(ids), ids)
        engine.backward(loss)
        with forced:
            engine.step()
        losses.append(loss.item())
        peaks.append(engine.peak_live_units)
        depths.append(engine.prefetch_depth)
    return {
        "losses": losses,
        "final": engine.full_state_dict(),
        "peaks": peaks,
        "depths": depths,
        "report": engine.prefetch_report(),
    }


def _inference(rank: int) -> dict[str, Any]:
    """An engine that never steps (inference) keeps the default depth."""
    from dataclasses import replace

    from zero_core import ZeroEngine

    torch.manual_seed(0)
    model = TinyTransformer(blocks=4)
    engine = ZeroEngine(model, None, replace(config_for(3), prefetch="auto"))
    with torch.no_grad():
        for step in range(3):
            model(batch(step, rank))
    return {"depth": engine.prefetch_depth, "peak": engine.peak_live_units, "state": engine.prefetch_report().state}


def _runs(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "inference": _inference(rank),
        "fixed": _train(1),
        "auto": _train("auto"),
        "capped": _train("auto", cap_mb=1e-6),
        "disagreeing": _train("auto", forced_choice=1 + 2 * rank),  # rank 0 wants 1, rank 1 wants 3
        "raising": _train("auto", raise_at=1),  # while measuring
    }


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return run_distributed(run_each, 2, {"runs": _runs})


def test_auto_prefetch_trains_exactly_like_a_fixed_depth(grid: list) -> None:
    for results in by_rank(grid, "runs"):
        fixed, auto = results["fixed"], results["auto"]
        assert auto["losses"] == fixed["losses"]
        assert all(torch.equal(auto["final"][k], fixed["final"][k]) for k in fixed["final"])


def test_the_depth_is_measured_then_chosen_alike_on_every_rank(grid: list) -> None:
    reports = [results["auto"]["report"] for results in by_rank(grid, "runs")]
    for results, report in zip(by_rank(grid, "runs"), reports):
        assert report.state is PrefetchTuning.CHOSEN
        assert report.gathers > 0 and report.gather_seconds > 0 and report.compute_seconds > 0
        assert 0 <= report.depth <= report.cap_units == 4  # 5 units: at most the other 4 ahead
        # The default depth for the first step, off while measuring (root + the running block),
        # then the chosen depth (each recorded after its step: the depth the next step uses).
        depths, peaks = results["auto"]["depths"], results["auto"]["peaks"]
        assert depths[: 1 + MEASURED_STEPS] == [0] * MEASURED_STEPS + [report.depth]
        assert all(depth == report.depth for depth in depths[MEASURED_STEPS:])
        assert peaks[0] <= 2 + UNTUNED_DEPTH and max(peaks[1 : 1 + MEASURED_STEPS]) <= 2
        assert max(peaks[1 + MEASURED_STEPS :]) <= 2 + report.depth
    assert len({report.depth for report in reports}) == 1


def test_ranks_that_measured_differently_take_the_largest_depth(grid: list) -> None:
    for results in by_rank(grid, "runs"):
        assert results["disagreeing"]["report"].depth == 3
        assert results["disagreeing"]["losses"] == results["fixed"]["losses"]


def test_a_forward_that_raises_while_measuring_counts_for_nothing(grid: list) -> None:
    for results in by_rank(grid, "runs"):
        clean, raising = results["auto"]["report"], results["raising"]["report"]
        assert raising.gathers == clean.gathers  # the failed forward's gathers are not counted
        assert raising.state is PrefetchTuning.CHOSEN
        assert results["raising"]["losses"] == results["fixed"]["losses"]


def test_an_engine_that_never_steps_prefetches_at_the_default_depth(grid: list) -> None:
    for results in by_rank(grid, "runs"):
        inference = results["inference"]
        assert inference["state"] is PrefetchTuning.WARMING_UP
        assert inference["depth"] == UNTUNED_DEPTH and inference["peak"] == 2 + UNTUNED_DEPTH


def test_the_memory_cap_bounds_the_depth(grid: list) -> None:
    for results in by_rank(grid, "runs"):
        report = results["capped"]["report"]
        assert report.cap_units == 0 and report.depth == 0
        assert max(results["capped"]["peaks"][1:]) <= 2


def test_the_depth_hides_the_measured_gather() -> None:
    """k* = ceil(T_gather / T_compute), at most the cap; no gather time: no prefetch."""
    comm = CommContext.create(None, torch.device("cpu"))
    for gather, forward, cap_bytes, expected in [
        (0.3, 0.4, 10**9, 3),
        (0.3, 0.5, 10**9, 2),
        (0.0, 1.0, 10**9, 0),
        (0.9, 1.0, 10**9, 4),
        (0.3, 0.4, 250, 2),
    ]:
        tuner = AutoPrefetch([100, 100, 100, 100, 100], cap_bytes)
        assert tuner.on_optimizer_step(comm) == 0  # warmed up: prefetch off while measuring
        for _ in range(MEASURED_STEPS - 1):
            assert tuner.on_optimizer_step(comm) is None
            tuner._forward_time, tuner._gather_time = forward, gather  # as measured
        assert tuner.on_optimizer_step(comm) == expected, (gather, forward, cap_bytes)
        if gather and forward > gather:
            assert expected == min(tuner.cap_units, math.ceil(gather / (forward - gather)))


def test_only_forwards_that_complete_are_timed() -> None:
    comm = CommContext.create(None, torch.device("cpu"))
    tuner = AutoPrefetch([100] * 5, float("inf"))
    assert tuner.cap_units == 4  # no cap: every other unit
    tuner.forward_started()
    tuner.wait_timed(lambda: time.sleep(0.01))  # warming up: not timed
    tuner.forward_ended()
    tuner.on_optimizer_step(comm)
    tuner.forward_started()
    tuner.wait_timed(lambda: time.sleep(0.01))
    tuner.forward_abandoned()  # raised
    tuner.wait_timed(lambda: time.sleep(0.01))  # a backward's gather, outside any forward
    assert tuner.report().gathers == 0
    tuner.forward_started()
    tuner.wait_timed(lambda: time.sleep(0.01))
    time.sleep(0.005)
    tuner.forward_ended()
    report = tuner.report()
    assert report.gathers == 1 and report.gather_seconds >= 0.01 and report.compute_seconds >= 0.005


def test_bad_prefetch_values_are_refused() -> None:
    for value in ("fast", -1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch"):
            ZeroConfig(prefetch=value)
    for cap in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="prefetch_cap_mb"):
            ZeroConfig(prefetch="auto", prefetch_cap_mb=cap)
