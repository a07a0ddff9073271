"""``torch.compile`` with ZeRO: blocks compiled before the engine (in place or
wrapped), or the whole sharded model compiled after it, train exactly as eager.

The ``aot_eager`` backend runs Dynamo and AOTAutograd (graph capture, graph
breaks, guards: everything that interacts with the engine's hooks) without
generating kernels, so the test stays fast on CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_core import WrapPolicy, ZeroConfig, ZeroEngine

from .distributed import run_distributed
from .models import Block, TinyTransformer, batch, lm_loss, make_optimizer

pytestmark = pytest.mark.distributed

BACKEND = "aot_eager"


def _compile_blocks_in_place(model: TinyTransformer) -> nn.Module:
    for block in model.blocks:
        block.compile(backend=BACKEND)
    return model


def _compile_blocks_wrapped(model: TinyTransformer) -> nn.Module:
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block, backend=BACKEND)
    return model


PREPARE = {
    "eager": lambda model: model,
    "blocks.compile()": _compile_blocks_in_place,
    "torch.compile(block)": _compile_blocks_wrapped,
}


def _losses(stage: int, how: str, rank: int) -> tuple[list[float], int]:
    torch.manual_seed(0)
    model = PREPARE.get(how, lambda m: m)(TinyTransformer(batchnorm=False))
    engine = ZeroEngine(
        model, make_optimizer("adamw", model), ZeroConfig(stage=stage, wrap_policy=WrapPolicy(module_classes=(Block,)))
    )
    run = torch.compile(model, backend=BACKEND) if how == "whole model, after the engine" else model
    losses = []
    for step in range(3):
        ids = batch(step, rank)
        loss = lm_loss(run(ids), ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, len(engine.unit_reports())


def _compile_worker(rank: int, world_size: int) -> list[dict]:
    torch._dynamo.reset()
    results = []
    for stage in (1, 2, 3):
        eager, _ = _losses(stage, "eager", rank)
        for how in ("blocks.compile()", "torch.compile(block)", "whole model, after the engine"):
            losses, units = _losses(stage, how, rank)
            results.append({"case": (stage, how), "eager": eager, "compiled": losses, "units": units})
    return results


def test_compiled_blocks_and_models_train_like_eager() -> None:
    for results in run_distributed(_compile_worker, 2, timeout=600):
        for result in results:
            assert result["units"] == 4, result["case"]  # the wrap policy finds the compiled blocks
            assert result["compiled"] == pytest.approx(result["eager"], rel=1e-5, abs=1e-6), result["case"]
