"""Shared pieces of the step-runtime tests: a ZeRO model beside a DDP reference,
and what one training step really sent and kept alive."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_core import CollectiveKind, CommStats, ZeroEngine

from .models import TinyTransformer, make_optimizer
from .workers import config_for, rank0_state_dict, relative_difference


class Pair(NamedTuple):
    ddp: DistributedDataParallel
    reference: nn.Module
    reference_optimizer: torch.optim.Optimizer
    model: nn.Module
    engine: ZeroEngine


def make_pair(
    stage: int,
    *,
    prefetch: int = 1,
    optimizer_name: str = "adamw",
    model_factory: Callable[[], nn.Module] = TinyTransformer,
    prepare: Callable[[nn.Module], None] | None = None,
    config: Any = None,
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
) -> Pair:
    """The same initial model twice: under DDP, and (after ``prepare``) under ZeRO."""
    torch.manual_seed(0)
    reference = model_factory()
    model = copy.deepcopy(reference)
    if prepare is not None:
        prepare(model)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    optimizer_factory = optimizer_factory or (lambda module: make_optimizer(optimizer_name, module))
    reference_optimizer = optimizer_factory(reference)
    engine = ZeroEngine(model, optimizer_factory(model), config or config_for(stage, prefetch))
    return Pair(ddp, reference, reference_optimizer, model, engine)


def reference_step(pair: Pair) -> None:
    pair.reference_optimizer.step()
    pair.reference_optimizer.zero_grad()


def parameter_error(pair: Pair) -> float:
    return relative_difference(pair.engine.full_state_dict(), rank0_state_dict(pair.reference))


def traffic_of(engine: ZeroEngine, run: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``run()``'s result and what it really sent, per collective kind (calls, elements, bytes)."""
    before = engine.comm_stats.snapshot()
    result = run()
    return result, CommStats.difference(engine.comm_stats.snapshot(), before)


def train_step(
    engine: ZeroEngine, model: nn.Module, ids: torch.Tensor, loss_fn: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """Forward, backward and optimizer step; returns the loss."""
    loss = loss_fn(model, ids)
    engine.backward(loss)
    engine.step()
    return loss


def calls(engine: ZeroEngine, kind: CollectiveKind) -> int:
    return engine.comm_stats.counts[kind].calls


def padded_numel(engine: ZeroEngine) -> int:
    return sum(unit.padded_numel for unit in engine.unit_reports())


class ReduceProbe:
    """Counts the reduce-scatters issued when backward reaches ``module``'s output.

    Hooked on a module in front of every block: when the gradient reaches
    it, every block's backward is over, so a runtime that reduces during
    backward has already issued one reduce-scatter per block.
    """

    def __init__(self, engine: ZeroEngine, module: nn.Module):
        self.engine = engine
        self.seen: list[int] = []
        self._at_step_start = 0
        module.register_forward_hook(self._hook_output)

    def start_step(self) -> None:
        self._at_step_start = calls(self.engine, CollectiveKind.REDUCE_SCATTER)

    def _hook_output(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(self._record)

    def _record(self, grad: torch.Tensor) -> None:
        self.seen.append(calls(self.engine, CollectiveKind.REDUCE_SCATTER) - self._at_step_start)
