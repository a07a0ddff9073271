"""``torch.compile`` with ZeRO: blocks compiled before the engine (in place or
wrapped), or the whole sharded model compiled after it, train exactly as eager,
with the graph breaks docs/guides/torchrun.md names and no others.

The ``aot_eager`` backend runs Dynamo and AOTAutograd (graph capture, graph
breaks, guards: everything that interacts with the engine's hooks) without
generating kernels, so the test stays fast on CPU.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

from tests.models import Block, TinyTransformer, batch, lm_loss, make_optimizer
from tests.paths import ROOT
from tests.rank_pool import run_distributed
from zero_core import WrapPolicy, ZeroConfig, ZeroEngine

GUIDE = ROOT / "docs" / "guides" / "torchrun.md"
WHOLE = "whole model, after the engine"


class _CountingBackend:
    """``aot_eager``, counting the graphs Dynamo hands it."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return aot_eager(gm, example_inputs)


# One backend for every case: Dynamo then reuses what an earlier case compiled for the same code and shapes
# (a block's forward), where a backend of its own per case would compile everything again.
BACKEND = _CountingBackend()


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


def _losses(stage: int, how: str, rank: int, counted: bool = False) -> dict:
    if counted:  # a fresh Dynamo: its counters and the graphs compiled from here on are this case's alone
        torch._dynamo.reset()
        counters.clear()
        BACKEND.graphs = 0
    torch.manual_seed(0)
    model = PREPARE.get(how, lambda m: m)(TinyTransformer(batchnorm=False))
    engine = ZeroEngine(
        model, make_optimizer("adamw", model), ZeroConfig(stage=stage, wrap_policy=WrapPolicy(module_classes=(Block,)))
    )
    run = torch.compile(model, backend=BACKEND) if how == WHOLE else model
    losses = []
    for step in range(3):
        ids = batch(step, rank)
        loss = lm_loss(run(ids), ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # Dynamo's own count of graph breaks, kept per reason (a break after which it gives up a frame and runs the
    # rest of it eagerly is not in it: the torchrun guide says which).
    breaks = sum(counters["graph_break"].values())
    counts = {"breaks": breaks, "graphs": BACKEND.graphs} if counted else {}
    return {"losses": losses, "units": len(engine.unit_reports()), **counts}


def _compile_worker(rank: int, world_size: int) -> list[dict]:
    results = []
    for stage in (3, 2, 1):  # stage 3's compiled cases are counted, each from a fresh Dynamo
        eager = _losses(stage, "eager", rank)["losses"]
        for how in ("blocks.compile()", "torch.compile(block)", WHOLE):
            results.append({"case": (stage, how), "eager": eager, **_losses(stage, how, rank, counted=stage == 3)})
    return results


def _guide_counts() -> tuple[int, int]:
    """The graph breaks and graphs the torchrun guide names for the whole test model compiled after the engine."""
    text = " ".join(GUIDE.read_text().split())
    found = re.search(r"the 3-block test model Dynamo counts (\d+) graph breaks and compiles (\d+) graphs", text)
    assert found, "docs/guides/torchrun.md's torch.compile section no longer names the test model's graph breaks"
    return int(found[1]), int(found[2])


def test_compiled_blocks_and_models_train_like_eager_with_the_graph_breaks_the_guide_names() -> None:
    breaks, graphs = _guide_counts()
    for results in run_distributed(_compile_worker, 2, timeout=600):
        for result in results:
            case = result["case"]
            assert result["units"] == 4, case  # the wrap policy finds the compiled blocks
            assert result["losses"] == pytest.approx(result["eager"], rel=1e-5, abs=1e-6), case
            if "breaks" not in result:
                continue
            if case[1] == WHOLE:
                assert (result["breaks"], result["graphs"]) == (breaks, graphs), case
            else:  # the engine's hooks run outside a compiled block: it captures whole, one graph for the three
                assert (result["breaks"], result["graphs"]) == (0, 1), case
