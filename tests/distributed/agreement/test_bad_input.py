"""Bad input fails fast with a message that says what to do, on every rank,
before any model state is touched; meta-device models are initialised."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tests.models import Block, TinyTransformer, batch, lm_loss, make_optimizer
from tests.paths import ROOT
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import config_for
from zero_core import MixedPrecision, WrapPolicy, ZeroConfig, ZeroEngine


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ZeroConfig(stage=4), "use 1 (optimizer state), 2 (+ gradients) or 3"),
        (lambda: ZeroConfig(stage=0), "ZeroConfig.stage=0 is invalid"),
        (lambda: ZeroConfig(prefetch=-1), "use an integer >= 0 (0 turns prefetch off)"),
        (lambda: ZeroConfig(bucket_size_mb=0), "bucket_size_mb must be > 0"),
        (lambda: ZeroConfig(broadcast_buffers=-1), "broadcast_buffers must be True or False"),
        (lambda: MixedPrecision(compute_dtype=torch.float64), "use torch.float32, torch.bfloat16 or torch.float16"),
        (lambda: WrapPolicy(module_classes=[Block]), "must be a tuple of nn.Module subclasses"),
        (lambda: WrapPolicy(module_classes=(int,)), "must be a tuple of nn.Module subclasses"),
    ],
)
def test_invalid_options_are_refused_with_advice(make, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        make()


class _NoInit(nn.Module):
    """A module with its own parameter and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.body = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def _error_of(build) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "no error"


def _bad_inputs(rank: int, world_size: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TinyTransformer()
    storage_before = sum(p.untyped_storage().nbytes() for p in model.parameters())
    errors = {
        "lbfgs": _error_of(lambda: ZeroEngine(model, torch.optim.LBFGS(model.parameters()), config_for(3))),
        "stepped": _error_of(lambda: ZeroEngine(model, _stepped_optimizer(model), config_for(3))),
        "meta": _error_of(lambda: _meta_engine(_NoInit)),
        "mismatch": _error_of(lambda: _mismatched_engine(rank)),
        "wrap class": _error_of(lambda: _engine_wrapping(model, nn.TransformerEncoderLayer)),
    }
    untouched = sum(p.untyped_storage().nbytes() for p in model.parameters()) == storage_before
    return {"errors": errors, "untouched": untouched}


def _stepped_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    ids = batch(0, 0)
    lm_loss(model(ids), ids).backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def _meta_engine(factory) -> ZeroEngine:
    with torch.device("meta"):
        model = factory()
    return ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))


def _engine_wrapping(model: nn.Module, block: type[nn.Module]) -> ZeroEngine:
    config = dataclasses.replace(config_for(3), wrap_policy=WrapPolicy(module_classes=(block,)))
    return ZeroEngine(model, make_optimizer("sgd", model), config)


def _mismatched_engine(rank: int) -> ZeroEngine:
    model = TinyTransformer(blocks=2 + rank)  # every rank builds a different model
    return ZeroEngine(model, make_optimizer("sgd", model), config_for(3))


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    """One spawn for the file's two-rank cases: the refusals leave the process group usable."""
    return run_distributed(
        run_each, 2, {"bad inputs": _bad_inputs, "meta": _meta_training, "meta like ddp": _meta_like_ddp}
    )


def test_bad_input_fails_on_every_rank_before_any_work(grid: list[dict]) -> None:
    results = by_rank(grid, "bad inputs")
    assert results[0]["errors"] == results[1]["errors"], "every rank must fail with the same message"
    errors = results[0]["errors"]
    assert "LBFGS does not run under ZeRO: its step takes a closure" in errors["lbfgs"] and "AdamW" in errors["lbfgs"]
    assert "already has state" in errors["stepped"]
    assert "no reset_parameters()" in errors["meta"] and "param_init_fn" in errors["meta"]
    assert "ranks disagree on parameter count: 23 on rank 0; 31 on rank 1" in errors["mismatch"]
    assert "no module of the model is a torch.nn.modules.transformer.TransformerEncoderLayer" in errors["wrap class"]
    assert "Name the class of the model's repeated block" in errors["wrap class"]
    assert all(r["untouched"] for r in results)


def _meta_training(rank: int, world_size: int) -> dict[str, object]:
    torch.manual_seed(rank)  # ranks seeded differently: rank 0's initial values must win
    with torch.device("meta"):
        model = TinyTransformer()
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3))
    initial = engine.full_state_dict()
    ids = batch(0, rank)
    loss = lm_loss(model(ids), ids)
    engine.backward(loss)
    engine.step()
    return {
        "initial": initial,
        "loss": loss.item(),
        "not_meta": not any(t.is_meta for t in list(model.parameters()) + list(model.buffers())),
    }


def test_meta_device_model_is_materialised_one_unit_at_a_time(grid: list[dict]) -> None:
    results = by_rank(grid, "meta")
    first, second = results
    assert first["not_meta"] and second["not_meta"]
    assert all(torch.equal(first["initial"][k], second["initial"][k]) for k in first["initial"])
    assert first["initial"]["norm.running_var"].eq(1).all()  # BatchNorm.reset_parameters ran
    assert torch.isfinite(torch.tensor([first["loss"], second["loss"]])).all()


def _examples_gpt():  # type: ignore[no-untyped-def]
    """The examples' GPT: tied embeddings, a root reset_parameters() that re-initialises the tie."""
    import os
    import sys

    sys.path.insert(0, os.path.join(str(ROOT), "examples"))
    import gpt

    config = gpt.GPTConfig(vocab_size=64, seq_len=8, width=16, depth=3, heads=2)
    return (lambda: gpt.GPT(config)), gpt.GPTBlock


def _built(make, seed: int, meta: bool) -> nn.Module:  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return make()


def _reset_parameters(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _meta_like_ddp(rank: int, world_size: int) -> dict[str, object]:
    """The same seed on the meta path (materialised by the engine) and eagerly under DDP:
    the initial weights, and the random numbers drawn after, per model and stage."""
    gpt, gpt_block = _examples_gpt()
    out: dict[str, object] = {}
    for name, make, block in [("tiny", TinyTransformer, Block), ("gpt", gpt, gpt_block)]:
        reference = _built(make, seed=7, meta=False)
        ddp = nn.parallel.DistributedDataParallel(reference)
        after_eager = torch.rand(4)
        expected = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
        # A param_init_fn is called in the same order, with the same tied tensors, as reset_parameters().
        for stage, init_fn in [(1, None), (2, None), (3, None), (3, _reset_parameters)]:
            model = _built(make, seed=7, meta=True)
            config = ZeroConfig(stage=stage, wrap_policy=WrapPolicy(module_classes=(block,)))
            engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), config, param_init_fn=init_fn)
            after_meta = torch.rand(4)
            weights = engine.full_state_dict()
            out[f"{name} stage {stage}{' param_init_fn' if init_fn else ''}"] = {
                "keys equal": sorted(weights) == sorted(expected),
                "different": [k for k in expected if not torch.equal(weights[k], expected[k])],
                "same random numbers after": torch.equal(after_meta, after_eager),
            }
    return out


def test_meta_device_model_gets_ddps_initial_weights_from_the_same_seed(grid: list[dict]) -> None:
    """Materialised in construction order, bitwise what eager construction under DDP gives, at every
    stage, for tied weights kept from the first module and re-initialised by the root; the random
    numbers drawn afterwards (dropout) are the same too."""
    for results in by_rank(grid, "meta like ddp"):
        for case, result in results.items():
            assert result == {"keys equal": True, "different": [], "same random numbers after": True}, case
