"""Ranks that built different models, configs or optimizers get the same
ValueError on every rank, naming the first differing field and each rank's
value, before anything is sharded and without hanging."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import nn

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer, param_groups
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import config_for, refusal
from zero_core import MixedPrecision, ZeroConfig, ZeroEngine, engine_of
from zero_core.agreement.setup import ADVICE

Build = Callable[[int], ZeroEngine]


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(blocks=2)


def _engine(rank: int, config: ZeroConfig | None = None, optimizer: str = "adamw", lr: float = 1e-2) -> ZeroEngine:
    model = _model()
    return ZeroEngine(model, make_optimizer(optimizer, model, lr), config or config_for(3))


def _transposed(rank: int) -> ZeroEngine:
    model = _model()
    if rank == 1:  # the same size, another shape
        model.blocks[0].up.weight = nn.Parameter(model.blocks[0].up.weight.detach().t().contiguous())
    return ZeroEngine(model, make_optimizer("adamw", model), config_for(3))


def _param_dtype(rank: int) -> ZeroEngine:
    model = _model()
    if rank == 1:
        model.blocks[0].mix.double()
    return ZeroEngine(model, make_optimizer("adamw", model), config_for(3))


def _compute_dtype(rank: int) -> ZeroEngine:
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    return _engine(rank, config_for(3, precision=MixedPrecision(compute_dtype=dtype)))


def _prefetch(rank: int) -> ZeroEngine:
    return _engine(rank, config_for(3, prefetch=1 + rank))


def _broadcast_buffers(rank: int) -> ZeroEngine:
    return _engine(rank, ZeroConfig(stage=3, broadcast_buffers=rank == 0))


def _stage(rank: int) -> ZeroEngine:
    return _engine(rank, config_for(3 - rank))


def _lr(rank: int) -> ZeroEngine:
    return _engine(rank, lr=1e-2 * (1 + rank))


def _optimizer_type(rank: int) -> ZeroEngine:
    model = _model()
    kind = torch.optim.AdamW if rank == 1 else torch.optim.Adam
    return ZeroEngine(model, kind(param_groups(model, 1e-2), lr=1e-2), config_for(3))


def _group_count(rank: int) -> ZeroEngine:
    model = _model()
    groups = param_groups(model, 1e-2)
    if rank == 1:
        groups = [{"params": [p for group in groups for p in group["params"]]}]
    return ZeroEngine(model, torch.optim.AdamW(groups, lr=1e-2), config_for(3))


def _group_weight_decay(rank: int) -> ZeroEngine:
    model = _model()
    groups = param_groups(model, 1e-2)
    if rank == 1:
        groups[1]["weight_decay"] = 0.1
    return ZeroEngine(model, torch.optim.AdamW(groups, lr=1e-2), config_for(3))


def _param_name(rank: int) -> ZeroEngine:
    model = nn.ModuleDict({"a" if rank == 0 else "b": nn.Linear(4, 4)})
    return ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))


def _defaults(rank: int) -> ZeroEngine:
    """Groups alike, defaults not: a group added later would train at another lr per rank."""
    model = _model()
    groups = [dict(group, lr=1e-2) for group in param_groups(model, 1e-2)]
    return ZeroEngine(model, torch.optim.AdamW(groups, lr=0.1 * (1 + rank)), config_for(3))


class Case(NamedTuple):
    build: Build
    field: str
    rank0: str
    rank1: str


CASES: dict[str, Case] = {
    "transposed": Case(_transposed, "parameter 7 'blocks.0.up.weight' shape", "(48, 16)", "(16, 48)"),
    "param dtype": Case(_param_dtype, "parameter 5 'blocks.0.mix.weight' dtype", "torch.float32", "torch.float64"),
    "compute dtype": Case(_compute_dtype, "config.mixed_precision.compute_dtype", "torch.float32", "torch.bfloat16"),
    "prefetch": Case(_prefetch, "config.prefetch", "1", "2"),
    "broadcast buffers": Case(_broadcast_buffers, "config.broadcast_buffers", "True", "False"),
    "stage": Case(_stage, "config.stage", "3", "2"),
    "lr": Case(_lr, "optimizer param group 0 lr", "0.01", "0.02"),
    "optimizer type": Case(_optimizer_type, "optimizer type", "torch.optim.adam.Adam", "torch.optim.adamw.AdamW"),
    "group count": Case(_group_count, "optimizer param group count", "2", "1"),
    "group weight decay": Case(_group_weight_decay, "optimizer param group 1 weight_decay", "0", "0.1"),
    "param name": Case(_param_name, "parameter 0 name", "'a.weight'", "'b.weight'"),
    "optimizer defaults": Case(_defaults, "optimizer default lr", "0.1", "0.2"),
}


def _refused(rank: int, world_size: int, build: Build) -> str | None:
    return refusal(lambda: build(rank), ValueError)


def _agreeing_after_refusal(rank: int, world_size: int) -> dict[str, object]:
    """A refused build leaves the model unsharded; ranks that agree then build and train."""
    model = _model()
    refused = refusal(lambda: ZeroEngine(model, make_optimizer("adamw", model), config_for(3 - rank)), ValueError)
    left_unsharded = engine_of(model) is None
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3))
    ids = batch(0, rank)
    engine.backward(lm_loss(model(ids), ids))
    engine.step()
    return {"refused": refused is not None, "left_unsharded": left_unsharded, "steps": engine.steps_taken}


def _attach(rank: int, world_size: int) -> dict[str, object]:
    """A user's attach_optimizer with disagreeing optimizers; then agreeing ones attach."""
    model = _model()
    engine = ZeroEngine(model, None, config_for(2))
    refused = refusal(lambda: engine.attach_optimizer(make_optimizer("adamw", model, lr=1e-2 * (1 + rank))), ValueError)
    engine.attach_optimizer(make_optimizer("adamw", model))
    ids = batch(0, rank)
    engine.backward(lm_loss(model(ids), ids))
    engine.step()
    return {"refused": refused, "steps": engine.steps_taken}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class _OtherBlock(_Block):
    pass


def _legitimately_different(rank: int, world_size: int) -> dict[str, object]:
    """Not refused: wrap classes in another order (a set has none), a hyperparameter whose repr
    holds an address (functools.partial); an added group with another lr is refused at the step."""
    from zero_core import WrapPolicy

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _OtherBlock(), nn.Linear(4, 1))
    classes = (_Block, _OtherBlock) if rank == 0 else (_OtherBlock, _Block)
    groups = [
        {"params": list(model[0].parameters()) + list(model[1].parameters()), "schedule": functools.partial(max, 1)}
    ]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, wrap_policy=WrapPolicy(module_classes=classes)))
    optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 0.1 * (1 + rank)})

    def step() -> None:
        engine.backward(model(torch.ones(2, 4)).sum())
        engine.step()

    return {"built": True, "added group": refusal(step, ValueError)}


def _added_on_one_rank(rank: int, world_size: int) -> dict[str, object]:
    """A group added (or refused) on one rank only is named at the step agreement: no hang."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3))

    def step() -> None:
        engine.backward(model(torch.ones(2, 4)).sum())
        engine.step()

    if rank == 0:
        optimizer.add_param_group({"params": list(model[1].parameters())})
    added = refusal(step, RuntimeError)
    if rank == 1:
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})  # not the model's: refused
    refused = refusal(step, RuntimeError)
    return {"added": added, "refused": refused}


def _save_after_adding_groups(rank: int, world_size: int, directory: str) -> dict[str, object]:
    """A save between add_param_group and the next step compares the new groups first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3))
    optimizer.add_param_group({"params": list(model[1].parameters()), "lr": 0.1 * (1 + rank)})
    differing = refusal(lambda: engine.save_checkpoint(f"{directory}/differing"), ValueError)
    if rank == 1:
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})  # refused on this rank only
    refused = refusal(lambda: engine.save_checkpoint(f"{directory}/refused"), ValueError)
    return {"differing": differing, "refused": refused}


def _message(case: Case) -> str:
    return f"ZeRO: ranks disagree on {case.field}: {case.rank0} on rank 0; {case.rank1} on rank 1. {ADVICE}"


@pytest.mark.parametrize("name", CASES)
def test_disagreeing_ranks_get_the_same_error_naming_the_field(grid: list, name: str) -> None:
    messages = by_rank(grid, name)
    assert messages[0] == messages[1], "every rank must fail with the same message"
    assert messages[0] == _message(CASES[name])


def test_agreeing_ranks_build_and_train_after_a_refused_build(grid: list) -> None:
    for result in by_rank(grid, "agree"):
        assert result == {"refused": True, "left_unsharded": True, "steps": 1}


def _edited_on_one_rank(rank: int, world_size: int) -> dict[str, object]:
    """A hyperparameter edited, or the groups replaced with the same parameters at another lr,
    on one rank only: named on every rank at the next step, never trained apart."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2))

    def step() -> None:
        engine.backward(model(torch.ones(2, 4)).sum())
        engine.step()

    step()
    if rank == 1:
        optimizer.param_groups[0]["lr"] = 0.5
    edited = refusal(step, ValueError)
    optimizer.param_groups[0]["lr"] = 0.1
    engine.zero_grad()
    if rank == 1:
        optimizer.param_groups = [dict(optimizer.param_groups[0], lr=0.25)]
    replaced = refusal(step, ValueError)
    return {"edited": edited, "replaced": replaced}


def test_legitimate_differences_are_not_refused_and_added_groups_are_compared(grid: list) -> None:
    results = by_rank(grid, "legitimate")
    assert all(result["built"] for result in results)
    assert results[0]["added group"] == results[1]["added group"]
    assert "ranks disagree on optimizer param group 1 lr: 0.1 on rank 0; 0.2 on rank 1" in results[0]["added group"]
    one = by_rank(grid, "added on one rank")
    assert one[0]["added"] == one[1]["added"]
    assert (
        "optimizer param groups (add_param_group on some ranks only?): 1 on some ranks, 2 on others" in one[0]["added"]
    )
    assert (
        one[0]["refused"] == one[1]["refused"]
        and "refused add_param_group calls: 0 on some ranks, 1 on others" in one[0]["refused"]
    )


def test_hyperparameters_edited_on_one_rank_are_named_at_the_next_step(grid: list) -> None:
    results = by_rank(grid, "edited on one rank")
    assert results[0] == results[1]
    assert "ranks disagree on optimizer param group 0 lr: 0.1 on rank 0; 0.5 on rank 1" in results[0]["edited"]
    assert "ranks disagree on optimizer param group 0 lr: 0.1 on rank 0; 0.25 on rank 1" in results[0]["replaced"]


def test_a_save_compares_groups_added_since_the_last_step(grid: list) -> None:
    results = by_rank(grid, "save after adding")
    assert results[0] == results[1]
    assert "ranks disagree on optimizer param group 1 lr: 0.1 on rank 0; 0.2 on rank 1" in results[0]["differing"]
    assert (
        "did not shard" in results[0]["refused"]
        and "reading the optimizer's param groups, on rank 1" in results[0]["refused"]
    )


def test_attach_optimizer_with_disagreeing_optimizers_is_refused_on_every_rank(grid: list) -> None:
    results = by_rank(grid, "attach")
    assert results[0]["refused"] == results[1]["refused"]
    assert results[0]["refused"] == _message(Case(_lr, "optimizer param group 0 lr", "0.01", "0.02"))
    assert all(result["steps"] == 1 for result in results)


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every case of this file in one spawn of two ranks; a collective that
    waits (a hang) fails after the process group's short timeout."""
    workers: dict[str, Callable] = {name: functools.partial(_refused, build=case.build) for name, case in CASES.items()}
    workers["agree"] = _agreeing_after_refusal
    workers["attach"] = _attach
    workers["legitimate"] = _legitimately_different
    workers["added on one rank"] = _added_on_one_rank
    workers["edited on one rank"] = _edited_on_one_rank
    workers["save after adding"] = functools.partial(
        _save_after_adding_groups, directory=str(tmp_path_factory.mktemp("saves"))
    )
    return run_distributed(run_each, 2, workers, timeout=180, pg_timeout=30)
