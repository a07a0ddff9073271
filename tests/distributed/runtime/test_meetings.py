"""Operations every rank must enter together (a stage-3 model read on one rank only): every rank that
reached one fails within milliseconds with the same message, instead of waiting out the timeout;
ranks that are merely slow are waited for."""

from __future__ import annotations

import time

import pytest
import torch

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for
from zero_core import RanksDivergedError, ZeroEngine
from zero_core.collectives.meetings import meetings_waited


def _attempt(action) -> tuple[str | None, float]:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        action()
        return None, time.monotonic() - start
    except RanksDivergedError as error:
        return str(error), time.monotonic() - start


def _read_on_one_rank(rank: int, world_size: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3))
    ids = batch(0, rank)
    engine.backward(lm_loss(model(ids), ids))
    engine.step()
    results: dict[str, object] = {}
    # Rank 0 reads the model alone while rank 1 goes on to gather for a save of its own.
    results["diverged"] = _attempt(model.state_dict if rank == 0 else engine.full_state_dict)
    with pytest.raises(RanksDivergedError):  # and the same for the other on-demand gathers
        with engine.gathered_parameters() if rank == 0 else engine.gathered_parameters(model.blocks[0]):
            pass
    full = engine.full_state_dict()  # after both, every rank together works
    results["recovered"] = {k: v.sum().item() for k, v in full.items()}
    time.sleep(3 if rank == 1 else 0)  # merely slow: waited for, no error
    results["slow"] = _attempt(model.state_dict)
    results["waited"] = meetings_waited()[-1]
    return results


def test_a_read_on_one_rank_fails_at_once_on_every_rank_and_slow_ranks_are_waited_for() -> None:
    results = run_distributed(_read_on_one_rank, 2)
    (message, seconds), (other, other_seconds) = results[0]["diverged"], results[1]["diverged"]
    assert message == other and message is not None
    assert "rank 0: state_dict() of the root unit, unit 'blocks.0'" in message
    assert "rank 1: full_state_dict() (called at" in message and "test_meetings.py" in message
    assert "accelerator.get_state_dict(model)" in message and "engine.full_state_dict(rank0_only=True)" in message
    assert seconds < 10 and other_seconds < 10  # not the process group's timeout
    assert results[0]["recovered"] == results[1]["recovered"]
    assert results[0]["slow"][0] is None and results[1]["slow"][0] is None
    assert results[0]["waited"] >= 2.5  # rank 0 waited for the slow rank rather than failing
