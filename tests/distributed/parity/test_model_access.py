"""The sharded model as users touch it: parameters at rest, state dicts, and
modules called directly (below the root), at every stage, against DDP."""

from __future__ import annotations

import copy
import importlib.util
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import refusal, relative_difference
from zero_core import ParameterAtRestError, WrapPolicy, ZeroConfig, ZeroEngine

STAGES = (1, 2, 3)


def _train(engine: ZeroEngine, model: nn.Module, steps: int, rank: int) -> None:
    for step in range(steps):
        ids = batch(step, rank)
        engine.backward(lm_loss(model(ids), ids))
        engine.step()


def _reference_train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, world_size: int) -> None:
    """What DDP computes: the gradient averaged over every rank's batch."""
    for step in range(steps):
        optimizer.zero_grad()
        for rank in range(world_size):
            ids = batch(step, rank)
            (lm_loss(model(ids), ids) / world_size).backward()
        optimizer.step()


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and relative_difference(a, b) < 1e-5


# ------------------------------------------------------------------ at rest
def _at_rest_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    reference = copy.deepcopy(model)
    engine = ZeroEngine(model, make_optimizer("adamw", model), ZeroConfig(stage=3))
    _train(engine, model, 2, rank)
    _reference_train(reference, make_optimizer("adamw", reference), 2, world_size)
    param = model.blocks[0].up.weight
    attempts = {
        "norm": lambda: param.norm(),
        "clone": lambda: param.clone(),
        "data": lambda: param.data + 0,
        "index": lambda: param[0],
        "inside a list argument": lambda: torch.cat([torch.zeros(1), param.view(-1)]),
        "double()": lambda: model.double(),
        "deepcopy": lambda: copy.deepcopy(model),
        "torch.save(param)": lambda: torch.save(param, io.BytesIO()),
    }
    refused = {name: refusal(attempt, ParameterAtRestError) for name, attempt in attempts.items()}
    model.to(param.device)  # changes nothing: allowed, as Lightning does before each stage
    model.float()
    with engine.gathered_parameters():
        gathered_norm = param.norm().item()
    _train(engine, model, 1, rank)  # still trains after all of the above
    from tests.models import Block

    torch.manual_seed(0)
    blocky = TinyTransformer(batchnorm=False)
    block_reference = copy.deepcopy(blocky.blocks[0])
    ZeroEngine(blocky, None, ZeroConfig(stage=3, wrap_policy=WrapPolicy(module_classes=(Block,))))
    hidden = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(rank))
    inner_call = refusal(lambda: blocky.blocks[0].up(hidden), ParameterAtRestError)
    block_call_error = (blocky.blocks[0](hidden) - block_reference(hidden)).abs().max().item()
    return {
        "inner_call": inner_call,
        "block_call_error": block_call_error,
        "repr": repr(param),
        "metadata": (tuple(param.shape), param.dtype, param.requires_grad, param.numel(), param.grad),
        "refused": refused,
        "gathered_norm": gathered_norm,
        "reference_norm": reference.blocks[0].up.weight.norm().item(),
    }


def test_stage3_parameters_at_rest_are_described_or_refused_never_read_from_freed_memory(grid: list) -> None:
    for result in by_rank(grid, "at rest"):
        assert "sharded at rest by ZeRO-3" in result["repr"] and "blocks.0.up.weight" in result["repr"]
        assert result["metadata"] == ((48, 16), torch.float32, True, 768, None)
        for name, message in result["refused"].items():
            assert message is not None, f"{name} was not refused"
            assert "gathered_parameters()" in message, name
            if name not in ("double()", "deepcopy"):  # those stop at the model's first parameter
                assert "'blocks.0.up.weight'" in message, name
        assert result["gathered_norm"] == pytest.approx(result["reference_norm"], rel=1e-5)
        # A layer inside a unit, called on its own: refused, naming the unit to call instead.
        assert "'blocks.0.up.weight' of unit 'blocks.0'" in result["inner_call"]
        assert result["block_call_error"] < 1e-6  # the unit's own module, called directly, works


def _equal_worker(rank: int, world_size: int) -> dict:
    """torch.equal between stage-3 parameters at rest: from metadata, or exactly inside
    comparable_parameters() (what Lightning's BaseFinetuning asks), else refused."""
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False, blocks=4)
    engine = ZeroEngine(
        model, make_optimizer("adamw", model), ZeroConfig(stage=3, wrap_policy=WrapPolicy(min_unit_numel=1))
    )
    _train(engine, model, 1, rank)
    up = [block.up.weight for block in model.blocks]
    with (
        engine.gathered_parameters(),
        torch.no_grad(),
    ):  # block 1 = block 0 but one 0.0 as -0.0; blocks 2 and 3 alike with a NaN
        up[0][0, 0] = 0.0
        up[1].copy_(up[0])
        up[1][0, 0] = -0.0
        up[2].copy_(up[0])
        up[2][1, 1] = float("nan")
        up[3].copy_(up[2])
    full = engine.full_state_dict()
    pairs = [(0, 1), (0, 2), (2, 3), (2, 2), (0, 0), (1, 0)]
    expected = [torch.equal(full[f"blocks.{i}.up.weight"], full[f"blocks.{j}.up.weight"]) for i, j in pairs]
    outside = {
        "other shape": torch.equal(up[0], model.blocks[0].down.weight),
        "itself": torch.equal(up[0], up[0]),
        "same shape": refusal(lambda: torch.equal(up[0], up[1]), ParameterAtRestError),
    }
    traffic_before = engine.comm_stats.snapshot()
    with engine.comparable_parameters():
        inside = [torch.equal(up[i], up[j]) for i, j in pairs] + [up[0].equal(up[1])]
        with engine.gathered_parameters(), torch.no_grad():  # values change inside the stretch (every rank alike)
            up[1].add_(1.0)
        inside.append(torch.equal(up[0], up[1]))  # no longer equal: the digests are taken again
    gathers = engine.comm_stats.snapshot()["all_gather"].calls - traffic_before["all_gather"].calls
    after = refusal(lambda: torch.equal(up[0], up[1]), ParameterAtRestError)
    return {
        "expected": expected,
        "inside": inside,
        "outside": outside,
        "after": after,
        "gathers": gathers,
        "units": len(engine.unit_reports()),
    }


def test_torch_equal_between_resting_parameters_is_exact_inside_comparable_parameters(grid: list) -> None:
    for result in by_rank(grid, "equal"):
        # Under plain torch: -0.0 == 0.0, and NaN equals nothing, itself included.
        assert result["expected"] == [True, False, False, False, True, True]
        assert result["inside"] == result["expected"] + [True, False]
        # One pass over the model for all comparisons, one more after the change, one for gathered_parameters.
        assert result["gathers"] == 3 * result["units"]
        assert result["outside"]["other shape"] is False and result["outside"]["itself"] is True
        for refused in (result["outside"]["same shape"], result["after"]):
            assert refused is not None and "comparable_parameters()" in refused


# ------------------------------------------------------------- state dicts
def _state_dict_worker(rank: int, world_size: int) -> list[dict]:
    results = []
    for stage in STAGES:
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        reference = copy.deepcopy(model)
        initial = copy.deepcopy(model.state_dict())
        engine = ZeroEngine(model, make_optimizer("adamw", model), ZeroConfig(stage=stage))
        reference_optimizer = make_optimizer("adamw", reference)
        _train(engine, model, 2, rank)
        _reference_train(reference, reference_optimizer, 2, world_size)
        state = model.state_dict()
        trained_error = relative_difference(state, reference.state_dict())
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        fresh = TinyTransformer(batchnorm=False)
        fresh.load_state_dict(saved)
        block_state = model.blocks[1].state_dict()
        # Loading the initial weights back into the sharded model, then
        # training on, must follow a reference that did the same.
        model.load_state_dict(initial)
        reference.load_state_dict(initial)
        after_load = {k: v.clone() for k, v in model.state_dict().items()}  # stages 1/2 give live views
        _train(engine, model, 2, rank)
        _reference_train(reference, reference_optimizer, 2, world_size)
        try:
            model.load_state_dict(initial, assign=True)
            assign_error = None
        except ValueError as error:
            assign_error = str(error)
        results.append(
            {
                "stage": stage,
                "trained_error": trained_error,
                "fresh_equals_saved": _close(fresh.state_dict(), saved),
                "block_keys": sorted(block_state),
                "block_matches": _close(
                    block_state, {k[len("blocks.1.") :]: v for k, v in state.items() if k.startswith("blocks.1.")}
                ),
                "after_load_is_initial": _close(after_load, initial),
                "resumed_error": relative_difference(model.state_dict(), reference.state_dict()),
                "assign_error": assign_error,
            }
        )
    return results


def test_state_dict_and_load_state_dict_give_full_values_at_every_stage(grid: list) -> None:
    for results in by_rank(grid, "state dict"):
        for result in results:
            stage = result["stage"]
            assert result["trained_error"] < 1e-5, stage
            assert result["fresh_equals_saved"], stage
            assert result["block_keys"] == [f"{m}.{p}" for m in ("down", "ln", "mix", "up") for p in ("bias", "weight")]
            assert result["block_matches"], stage
            assert result["after_load_is_initial"], stage
            assert result["resumed_error"] < 1e-5, stage
            assert "assign=False" in result["assign_error"], stage


# ------------------------------------------------------ calls below the root
class GAN(nn.Module):
    """Trained by calling its two halves directly; ``forward`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.discriminator(self.generator(z))


def _gan_optimizer(model: GAN) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": model.generator.parameters(), "lr": 1e-2}, {"params": model.discriminator.parameters(), "lr": 2e-2}]
    )


def _gan_loss(model: GAN, step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    z, real = torch.randn(6, 8, generator=generator), torch.randn(6, 16, generator=generator) + 1
    fake = model.generator(z)
    ones, zeros = torch.ones(6, 1), torch.zeros(6, 1)
    bce = F.binary_cross_entropy_with_logits
    d_loss = bce(model.discriminator(real), ones) + bce(model.discriminator(fake.detach()), zeros)
    return d_loss + bce(model.discriminator(fake), ones)


GAN_POLICIES = {
    "default": WrapPolicy(),
    "per layer": WrapPolicy(module_classes=(nn.Linear,)),
    "per half": WrapPolicy(min_unit_numel=500),
}


def _gan_worker(rank: int, world_size: int) -> list[dict]:
    results = []
    for stage in STAGES:
        for policy_name, policy in GAN_POLICIES.items():
            torch.manual_seed(0)
            model = GAN()
            reference = copy.deepcopy(model)
            engine = ZeroEngine(model, _gan_optimizer(model), ZeroConfig(stage=stage, wrap_policy=policy))
            reference_optimizer = _gan_optimizer(reference)
            for step in range(3):
                engine.backward(_gan_loss(model, step, rank))
                engine.step()
                reference_optimizer.zero_grad()
                _gan_loss(reference, step, rank).backward()
                for param in reference.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= world_size
                reference_optimizer.step()
            with torch.no_grad():
                sample = model.generator(torch.ones(2, 8))  # a direct call under no_grad
            results.append(
                {
                    "case": (stage, policy_name, len(engine.unit_reports())),
                    "error": relative_difference(engine.full_state_dict(), reference.state_dict()),
                    "sample_error": (sample - reference.generator(torch.ones(2, 8))).abs().max().item(),
                }
            )
    return results


def test_gan_halves_called_directly_train_like_ddp_at_every_stage_and_wrap_policy(grid: list) -> None:
    for results in by_rank(grid, "gan"):
        for result in results:
            assert result["error"] < 1e-5, result
            assert result["sample_error"] < 1e-5, result
        assert {r["case"][2] for r in results} == {1, 3, 5}  # the three policies give different units


def _generate_worker(rank: int, world_size: int) -> list[dict]:
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    results = []
    for stage, policy in ((3, WrapPolicy()), (3, WrapPolicy(module_classes=(T5Block,))), (2, WrapPolicy())):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(config).eval()
        reference = copy.deepcopy(model)
        ZeroEngine(model, None, ZeroConfig(stage=stage, wrap_policy=policy))
        inputs = torch.randint(2, 64, (2, 7), generator=torch.Generator().manual_seed(rank))
        # Ranks may finish at different lengths: synced_gpus keeps every rank
        # stepping until all are done, as with DeepSpeed ZeRO-3.
        tokens = model.generate(inputs, max_new_tokens=6, do_sample=False, synced_gpus=True)
        expected = reference.generate(inputs, max_new_tokens=6, do_sample=False)
        results.append({"case": (stage, policy), "equal": torch.equal(tokens, expected)})
    return results


def test_hugging_face_encoder_decoder_generate_on_the_sharded_model(grid: list) -> None:
    pytest.importorskip("transformers")
    for results in by_rank(grid, "generate"):
        for result in results:
            assert result["equal"], result["case"]


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    """Every case of this file in one spawn of two ranks."""
    workers = {"at rest": _at_rest_worker, "equal": _equal_worker, "state dict": _state_dict_worker, "gan": _gan_worker}
    if importlib.util.find_spec("transformers") is not None:
        workers["generate"] = _generate_worker
    return run_distributed(run_each, 2, workers, timeout=600)
