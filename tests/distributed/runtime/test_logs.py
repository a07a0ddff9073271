"""What the logs say: one setup line that names what ZeRO does (the adapters log it through their
framework), and each fp16 step skipped on overflow with the new loss scale (rank 0), as DeepSpeed
prints them."""

from __future__ import annotations

import logging

import torch

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for
from zero_core import MixedPrecision, ZeroEngine, expected_model_state_bytes, setup_summary


def _logged_run(rank: int, world_size: int) -> dict:
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zero_core").addHandler(handler)
    logging.getLogger("zero_core").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = TinyTransformer()
    # A first scale that overflows: the first step is skipped and the scale halves.
    precision = MixedPrecision(compute_dtype=torch.float16)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3, precision=precision))
    for step in range(2):
        ids = batch(step, rank)
        engine.backward(lm_loss(model(ids), ids))
        engine.step()
    return {
        "summary": setup_summary(engine),
        "logged": logged,
        "steps taken": engine.steps_taken,
        "units": len(engine.unit_reports()),
        "numel": engine.num_parameters,
    }


def test_setup_line_and_skipped_fp16_steps_are_logged() -> None:
    results = run_distributed(_logged_run, 2)
    first, second = results
    precision = MixedPrecision(compute_dtype=torch.float16)
    ours = expected_model_state_bytes(3, first["numel"], 2, precision, 8).model_state_bytes
    ddp = expected_model_state_bytes(0, first["numel"], 2, precision, 8).model_state_bytes
    summary = first["summary"]
    assert summary.startswith(f"ZeRO stage 3: {first['units']} units (largest ")
    assert "sharded over 2 of 2 ranks; compute float16, reduce float32; prefetch 1; offload_optimizer none" in summary
    assert f"about {ours / 2**20:,.1f} MiB (DDP: {ddp / 2**20:,.1f} MiB;" in summary
    skipped = 2 - first["steps taken"]
    assert skipped >= 1
    overflow = [line for line in first["logged"] if "gradient overflow" in line]
    assert len(overflow) == skipped and "loss scale 65536 -> 32768" in overflow[0], first["logged"]
    assert not [line for line in second["logged"] if "gradient overflow" in line]  # rank 0 only
