"""Ways users drive backward that plain PyTorch allows, at stages 1-3, against
a plain-module reference whose gradients are averaged over ranks (DDP itself
refuses some of these): a reused block under a reentrant checkpoint, two
forwards then the backward of their sum, two disjoint losses back-propagated
one after the other, a retained graph back-propagated twice, a forward that
raised between two good ones, a root output used on one rank only, a chain
of units no loss uses, a model returning its own output class, and logged
losses kept alive on one rank only."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from tests.models import Block, TinyTransformer, batch, lm_loss
from tests.rank_pool import run_distributed
from tests.workers import config_for, relative_difference
from zero_core import ZeroEngine

STAGES = (1, 2, 3)


def average_grads(module: nn.Module) -> None:
    """What DDP's find_unused_parameters does: average, None where no rank has a gradient."""
    for param in module.parameters():
        if not param.requires_grad:
            continue
        has = torch.tensor([float(param.grad is not None)])
        dist.all_reduce(has)
        if has.item() == 0:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()


class TwoHeads(nn.Module):
    """Units: two towers and an unused chain; the LM head in the root."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 16)
        self.tower_a, self.tower_b = Block(16), Block(16)
        self.aux1, self.aux2 = Block(16), Block(16)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.aux2(self.aux1(self.embed(ids)))  # no loss ever uses it: no update, like plain PyTorch
        # Separate lookups: the two towers' graphs share nothing, so their losses
        # may be back-propagated one after the other.
        return self.tower_a(self.embed(ids)), self.tower_b(self.embed(ids))


class Logits:
    """A model's own output class, which pytree cannot look into."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class ObjectOutput(TinyTransformer):
    def __init__(self) -> None:
        super().__init__(batchnorm=False)

    def forward(self, ids: torch.Tensor) -> Logits:  # type: ignore[override]
        return Logits(super().forward(ids))


KEPT: list[torch.Tensor] = []  # losses a logging loop keeps, on rank 0 only


def _losses(pattern: str, model: nn.Module, ids: torch.Tensor, backward) -> None:  # type: ignore[no-untyped-def]
    rank = dist.get_rank()
    if pattern == "output-object-accumulated":
        for micro in (ids, ids.flip(0)):
            backward(lm_loss(model(micro).logits, micro) / 2)
    elif pattern == "losses-kept-on-one-rank":
        for micro in (ids, ids.flip(0)):
            loss = lm_loss(model(micro), micro) / 2
            if rank == 0:
                KEPT.append(loss)
            backward(loss)
    elif pattern == "two-forwards-sum":
        backward(lm_loss(model(ids), ids) + lm_loss(model(ids.flip(0)), ids.flip(0)))
    elif pattern == "disjoint-losses":
        a, b = model(ids)
        backward(a.square().mean())
        backward(b.abs().mean())
    elif pattern == "retain-graph-twice":
        a, b = model(ids)
        backward(a.square().mean() + b.mean(), retain_graph=True)
        backward(b.abs().mean())
    elif pattern == "root-output-per-rank":
        a, b = model(ids)
        backward(a.square().mean() if rank == 0 else (a.mean() + b.square().mean()))
    elif pattern == "failed-forward-between":
        first = lm_loss(model(ids), ids)
        try:
            model(ids[:, :0].float())  # a bad batch: raises inside the forward
        except (RuntimeError, IndexError):
            pass
        backward(first + lm_loss(model(ids.flip(0)), ids.flip(0)))


def _factory(pattern: str):  # type: ignore[no-untyped-def]
    if pattern in ("disjoint-losses", "retain-graph-twice", "root-output-per-rank"):
        return TwoHeads, (Block,)
    if pattern == "output-object-accumulated":
        return ObjectOutput, (Block,)
    # No BatchNorm: the plain-module reference does not broadcast buffers as DDP and ZeRO do.
    return functools.partial(TinyTransformer, batchnorm=False), (Block,)


def _prepare(pattern: str, model: nn.Module) -> None:
    if pattern == "two-forwards-sum":
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
            check_fn=lambda module: isinstance(module, Block),
        )


def _run(stage: int, pattern: str) -> float:
    factory, _ = _factory(pattern)
    torch.manual_seed(0)
    reference = factory()
    model = copy.deepcopy(reference)
    _prepare(pattern, model)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config_for(stage))
    worst = 0.0
    for step in range(2):
        ids = batch(step, dist.get_rank())
        _losses(pattern, reference, ids, lambda loss, **kw: loss.backward(**kw))
        average_grads(reference)
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        _losses(pattern, model, ids, engine.backward)
        engine.step()
        reference_state = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in reference.state_dict().items()}
        ours = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in engine.full_state_dict().items()}
        worst = max(worst, relative_difference(ours, reference_state))
    return worst


PATTERNS = [
    "two-forwards-sum",
    "disjoint-losses",
    "retain-graph-twice",
    "root-output-per-rank",
    "failed-forward-between",
    "output-object-accumulated",
    "losses-kept-on-one-rank",
]
CASES = [(stage, pattern) for pattern in PATTERNS for stage in STAGES]


def _grid(rank: int, world_size: int) -> list[float]:
    return [_run(stage, pattern) for stage, pattern in CASES]


@pytest.fixture(scope="module")
def errors() -> list[list[float]]:
    return run_distributed(_grid, 2)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{s}-{p}" for s, p in CASES])
def test_backward_pattern_matches_plain_pytorch(errors: list[list[float]], index: int) -> None:
    for rank, per_case in enumerate(errors):
        assert per_case[index] <= 1e-5, f"rank {rank}: {per_case[index]}"
