"""Changes to the model after sharding: what trains exactly, and what is refused
with a clear error before it can train wrongly. Also fp16 backward safety and
buffer dtypes under mixed precision."""

from __future__ import annotations

import copy
import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.models import Block, TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import refusal, relative_difference
from zero_core import (
    MixedPrecision,
    ModelChangedError,
    ParameterAtRestError,
    UnscaledBackwardError,
    WrapPolicy,
    ZeroConfig,
    ZeroEngine,
)

STAGES = (1, 2, 3)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    ids = batch(step, rank)
    return lm_loss(model(ids), ids)


def _reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """DDP's step: every rank's gradient, averaged."""
    optimizer.zero_grad()
    _loss(model, step, dist.get_rank()).backward()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
    optimizer.step()


def _changes_worker(rank: int, world_size: int) -> list[dict]:
    results = []
    for stage in STAGES:

        def fresh() -> tuple[nn.Module, ZeroEngine]:
            torch.manual_seed(0)
            model = TinyTransformer(batchnorm=False)
            return model, ZeroEngine(model, make_optimizer("adamw", model), ZeroConfig(stage=stage))

        def forward(model: nn.Module) -> None:
            model(batch(0, rank))

        model, _ = fresh()
        model.blocks[0].mix.weight = nn.Parameter(torch.zeros(16, 16))
        replaced = refusal(lambda: forward(model), ModelChangedError)
        model, engine = fresh()
        weight = model.blocks[0].up.weight
        if stage == 3:
            reshaped = refusal(lambda: setattr(weight, "data", weight.data.view(16, 48)), ParameterAtRestError)
        else:
            weight.data = weight.data.view(16, 48)  # the same storage, another shape
            reshaped = refusal(lambda: forward(model), ModelChangedError)
        model, engine = fresh()
        if stage == 3:
            cast = refusal(lambda: model.double(), ParameterAtRestError)
        else:
            model.double()
            cast = refusal(lambda: forward(model), ModelChangedError)
        model, engine = fresh()
        new_layer = nn.Linear(4, 4)
        engine.optimizer.add_param_group({"params": new_layer.parameters()})
        engine.backward(_loss(model, 0, rank))
        added = refusal(engine.step, ValueError)
        results.append({"stage": stage, "replaced": replaced, "reshaped": reshaped, "cast": cast, "added": added})
    return results


def test_changes_after_sharding_are_refused_before_they_train_wrongly(grid: list) -> None:
    for results in by_rank(grid, "changes"):
        for result in results:
            stage = result["stage"]
            assert "'blocks.0.mix.weight' was replaced" in result["replaced"], stage
            assert "cast" in result["cast"], stage
            assert result["reshaped"] is not None, stage
            assert "add_param_group" in result["added"], stage


def _toggle_worker(rank: int, world_size: int) -> list[dict]:
    """Freeze a block for some steps, unfreeze it; unfreeze a layer frozen when the engine
    was built; add a block and a frozen-at-build layer as new param groups later
    (progressive unfreezing)."""
    results = []
    for stage in STAGES:
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        reference = copy.deepcopy(model)

        def optimizer_without_last_block(module: TinyTransformer) -> torch.optim.Optimizer:
            # ``frozen`` (requires_grad=False when the engine is built) is in the optimizer, ``branch`` is not.
            skip = {id(p) for p in [*module.blocks[2].parameters(), *module.branch.parameters()]}
            return torch.optim.AdamW([p for p in module.parameters() if id(p) not in skip], lr=1e-2)

        for module in (model, reference):
            module.branch.requires_grad_(False)
        policy = WrapPolicy(module_classes=(Block,))
        engine = ZeroEngine(model, optimizer_without_last_block(model), ZeroConfig(stage=stage, wrap_policy=policy))
        reference_optimizer = optimizer_without_last_block(reference)
        for step in range(6):
            for module in (model, reference):
                module.blocks[0].requires_grad_(step not in (1, 2))  # frozen for two steps
            if step == 2:
                for module in (model, reference):
                    module.frozen.requires_grad_(True)  # frozen when the engine was built, in the optimizer
            if step == 3:  # the last block, and the frozen-at-build branch, join with their own learning rates
                for module, optimizer in ((model, engine.optimizer), (reference, reference_optimizer)):
                    module.branch.requires_grad_(True)
                    optimizer.add_param_group({"params": list(module.blocks[2].parameters()), "lr": 5e-3})
                    optimizer.add_param_group({"params": list(module.branch.parameters()), "lr": 2e-3})
            engine.backward(_loss(model, step, rank))
            engine.step()
            _reference_step(reference, reference_optimizer, step)
        results.append({"stage": stage, "error": relative_difference(engine.full_state_dict(), reference.state_dict())})
    return results


def test_toggling_requires_grad_and_adding_param_groups_train_like_ddp(grid: list) -> None:
    for results in by_rank(grid, "toggle"):
        for result in results:
            assert result["error"] < 1e-5, result


def _fp16_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyTransformer()
    config = ZeroConfig(
        stage=2, mixed_precision=MixedPrecision(compute_dtype=torch.float16), initial_loss_scale=2.0**10
    )
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)
    plain = refusal(lambda: _loss(model, 0, rank).backward(), UnscaledBackwardError)
    engine.backward(_loss(model, 0, rank))  # the engine's backward still works after the refusal
    engine.step()
    return {"plain": plain, "steps": engine.steps_taken}


def test_fp16_backward_not_scaled_by_the_engine_is_refused(grid: list) -> None:
    for result in by_rank(grid, "fp16"):
        assert "engine.backward(loss)" in result["plain"]
        assert result["steps"] == 1


def _llama(dtype_config: MixedPrecision | None, stage: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if dtype_config is not None:
        policy = WrapPolicy(module_classes=(LlamaDecoderLayer,))
        ZeroEngine(model, None, ZeroConfig(stage=stage, mixed_precision=dtype_config, wrap_policy=policy))
    return model


def _buffers_worker(rank: int, world_size: int) -> dict:
    bf16 = MixedPrecision(compute_dtype=torch.bfloat16)
    reference = _llama(None)
    model = _llama(bf16)
    cast_all = _llama(MixedPrecision(compute_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    positions = torch.arange(0, 4096, 97).unsqueeze(0)
    probe = torch.zeros(1, 1, dtype=torch.bfloat16)
    cos, sin = model.model.rotary_emb(probe, positions)
    expected_cos, expected_sin = reference.model.rotary_emb(probe, positions)
    cast_cos, _ = cast_all.model.rotary_emb(probe, positions)
    torch.manual_seed(0)
    tiny = TinyTransformer()
    ZeroEngine(tiny, None, ZeroConfig(stage=3, mixed_precision=bf16))
    ids = batch(0, rank)
    tiny(ids)  # BatchNorm trains with its statistics in its weight's dtype
    return {
        "inv_freq": model.model.rotary_emb.inv_freq.dtype,
        "cast_inv_freq": cast_all.model.rotary_emb.inv_freq.dtype,
        "rotary_equal": torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin),
        "cast_rotary_error": (cast_cos.float() - expected_cos.float()).abs().max().item(),
        "batchnorm_buffers": tiny.norm.running_mean.dtype,
        "loss_finite": bool(torch.isfinite(lm_loss(model(ids).logits, ids))),
    }


def test_buffers_keep_their_dtype_so_rotary_positions_match_fp32(grid: list) -> None:
    pytest.importorskip("transformers")
    for result in by_rank(grid, "buffers"):
        assert result["inv_freq"] == torch.float32
        assert result["rotary_equal"]
        assert result["cast_inv_freq"] == torch.bfloat16 and result["cast_rotary_error"] > 0.05  # what fp32 avoids
        assert result["batchnorm_buffers"] == torch.bfloat16
        assert result["loss_finite"]


def _more_changes_worker(rank: int, world_size: int) -> list[dict]:
    results = []
    for stage in STAGES:
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        clean = copy.deepcopy(model)
        config = ZeroConfig(
            stage=stage, mixed_precision=MixedPrecision(compute_dtype=torch.float16), initial_loss_scale=2.0**10
        )
        engine = ZeroEngine(model, make_optimizer("adamw", model), config)
        clean_engine = ZeroEngine(clean, make_optimizer("adamw", clean), config)
        refusal(lambda: _loss(model, 0, rank).backward(), UnscaledBackwardError)
        for each_model, each_engine in ((model, engine), (clean, clean_engine)):
            each_engine.backward(_loss(each_model, 1, rank))
            each_engine.step()
        # The refused backward left nothing behind: the step equals one that never saw it.
        stale = relative_difference(engine.full_state_dict(), clean_engine.full_state_dict())
        # The groups list the model's parameters, so torch's own check refuses one listed twice, as under DDP.
        twice = refusal(lambda: engine.optimizer.add_param_group({"params": [model.blocks[0].up.weight]}), ValueError)
        engine.backward(_loss(model, 2, rank))
        engine.step()
        torch.manual_seed(0)
        other = TinyTransformer(batchnorm=False)
        ZeroEngine(other, make_optimizer("adamw", other), ZeroConfig(stage=stage))
        other.branch = nn.Linear(16, 16)
        submodule = refusal(lambda: other(batch(0, rank)), ModelChangedError)
        results.append({"stage": stage, "stale": stale, "twice": twice, "submodule": submodule})
    return results


def test_refused_backward_leaves_nothing_and_other_changes_are_refused(grid: list) -> None:
    for results in by_rank(grid, "more changes"):
        for result in results:
            assert result["stale"] == 0.0, result
            assert "appear in more than one parameter group" in result["twice"], result
            assert "submodule 'branch' was replaced" in result["submodule"], result


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * scale


class _CheckpointedModel(nn.Module):
    """fp32 values computed from an fp32 buffer reach checkpointed blocks (rotary cos/sin do)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([_ScaledBlock(), _ScaledBlock()])
        self.reentrant = reentrant
        self.register_buffer("inv", torch.tensor([1.0, 2.0, 3.0, 4.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        hidden, scale = self.embed(x), self.inv.sin()
        for block in self.blocks:
            hidden = checkpoint(block, hidden, scale, use_reentrant=self.reentrant)
        return hidden.float().sum()


def _recompute_cast_worker(rank: int, world_size: int) -> list[tuple]:
    done = []
    for stage in STAGES:
        for reentrant in (False, True):
            torch.manual_seed(0)
            model = _CheckpointedModel(reentrant)
            config = ZeroConfig(
                stage=stage, mixed_precision=MixedPrecision(compute_dtype=torch.bfloat16),
                wrap_policy=WrapPolicy(module_classes=(_ScaledBlock,)),
            )  # fmt: skip
            engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
            engine.backward(model(torch.ones(2, 4)))
            engine.step()
            done.append((stage, reentrant, model.inv.dtype))
    return done


def test_checkpoint_recompute_casts_inputs_as_the_forward_did(grid: list) -> None:
    for done in by_rank(grid, "recompute cast"):
        assert done == [(s, r, torch.float32) for s in STAGES for r in (False, True)]


def _checkpoint_after_added_group_worker(rank: int, world_size: int, directory: str) -> list[dict]:
    """A save right after add_param_group (before any step with it) keeps the group, and
    a fresh run that re-adds the group resumes from it."""
    results = []
    for stage in STAGES:
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        skip = {id(p) for p in model.blocks[2].parameters()}
        engine = ZeroEngine(
            model,
            torch.optim.AdamW([p for p in model.parameters() if id(p) not in skip], lr=1e-2),
            ZeroConfig(stage=stage),
        )
        engine.backward(_loss(model, 0, rank))
        engine.step()
        engine.optimizer.add_param_group({"params": list(model.blocks[2].parameters()), "lr": 5e-3})
        path = f"{directory}/stage{stage}"
        engine.save_checkpoint(path)
        torch.manual_seed(1)
        resumed = TinyTransformer(batchnorm=False)
        skip = {id(p) for p in resumed.blocks[2].parameters()}
        other = ZeroEngine(
            resumed,
            torch.optim.AdamW([p for p in resumed.parameters() if id(p) not in skip], lr=1e-2),
            ZeroConfig(stage=stage),
        )
        other.optimizer.add_param_group({"params": list(resumed.blocks[2].parameters()), "lr": 5e-3})
        other.load_checkpoint(path)
        for each_model, each_engine in ((model, engine), (resumed, other)):
            each_engine.backward(_loss(each_model, 1, rank))
            each_engine.step()
        results.append(
            {
                "stage": stage,
                "error": relative_difference(other.full_state_dict(), engine.full_state_dict()),
                "groups": len(other.param_group_names),
            }
        )
    return results


def test_checkpoints_keep_param_groups_added_since_the_last_step(grid: list) -> None:
    for results in by_rank(grid, "checkpoint after added group"):
        for result in results:
            assert result["groups"] == 2 and result["error"] == 0.0, result


def _adagrad_worker(rank: int, world_size: int) -> list[float]:
    errors = []
    for stage in STAGES:
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        reference = copy.deepcopy(model)

        # A group's own initial_accumulator_value, which torch's constructor ignores (it uses its argument).
        def adagrad(module: nn.Module) -> torch.optim.Optimizer:
            groups = [
                {"params": list(module.blocks.parameters()), "initial_accumulator_value": 5.0},
                {"params": [p for n, p in module.named_parameters() if not n.startswith("blocks.")]},
            ]
            return torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1)

        engine = ZeroEngine(model, adagrad(model), ZeroConfig(stage=stage))
        reference_optimizer = adagrad(reference)
        for step in range(3):
            engine.backward(_loss(model, step, rank))
            engine.step()
            _reference_step(reference, reference_optimizer, step)
        errors.append(relative_difference(engine.full_state_dict(), reference.state_dict()))
    return errors


def test_adagrad_state_made_at_construction_is_rebuilt_over_the_shards(grid: list) -> None:
    for errors in by_rank(grid, "adagrad"):
        assert max(errors) < 1e-5, errors


def _frozen_differently_worker(rank: int, world_size: int) -> dict:
    """Stage 3: a rank that froze a unit the other did not is named before any reduce-scatter
    (they would pair different units' collectives); once they agree again, training goes on."""
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    engine = ZeroEngine(
        model, make_optimizer("adamw", model), ZeroConfig(stage=3, wrap_policy=WrapPolicy(module_classes=(Block,)))
    )
    model.blocks[0].requires_grad_(rank == 0)
    refused = refusal(lambda: engine.backward(_loss(model, 0, rank)), RuntimeError)
    model.blocks[0].requires_grad_(True)
    engine.backward(_loss(model, 1, rank))
    engine.step()
    return {"refused": refused, "steps": engine.steps_taken}


def test_ranks_that_froze_different_units_are_named_before_the_backward(grid: list) -> None:
    results = by_rank(grid, "frozen differently")
    assert results[0]["refused"] == results[1]["refused"]
    assert (
        "which units have trainable parameters (every rank must freeze the same ones; a checksum)"
        in results[0]["refused"]
    )
    assert all(result["steps"] == 1 for result in results)


def _group_view_worker(rank: int, world_size: int) -> list[dict]:
    """Between steps the groups list the model's parameters (as under DDP); a step that raised
    midway, and torch's state_dict/load_state_dict, leave them so too."""
    results = []
    for stage in STAGES:
        torch.manual_seed(0)
        model = TinyTransformer(batchnorm=False)
        engine = ZeroEngine(model, make_optimizer("adamw", model), ZeroConfig(stage=stage))
        optimizer = engine.optimizer
        parameters = {id(p) for p in model.parameters()}

        def lists_model_parameters() -> bool:
            return all(id(p) in parameters for group in optimizer.param_groups for p in group["params"])

        seen_by_step: list[bool] = []
        optimizer.register_step_pre_hook(lambda *_: seen_by_step.append(lists_model_parameters()))
        built = lists_model_parameters()
        engine.backward(_loss(model, 0, rank))
        engine.step()
        after_step = lists_model_parameters()
        name_of = {p: n for n, p in model.named_parameters()}  # how BaseFinetuning names the groups' tensors
        names = [[name_of[p] for p in group["params"]] for group in optimizer.param_groups]
        saved = optimizer.state_dict()  # this rank's pieces' state
        optimizer.load_state_dict(copy.deepcopy(saved))
        after_state_dict = lists_model_parameters()
        closure = refusal(lambda: optimizer.step(lambda: _loss(model, 1, rank)), ValueError)
        misfit = refusal(
            lambda: optimizer.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]}), ValueError
        )
        after_misfit = lists_model_parameters()
        failing = optimizer.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("a hook failed")))
        engine.backward(_loss(model, 1, rank))
        failed = refusal(engine.step, RuntimeError)
        failing.remove()
        engine.zero_grad()
        with torch.no_grad():
            model(batch(0, rank))  # the next forward puts the model's parameters back
        after_forward = lists_model_parameters()
        engine.backward(_loss(model, 2, rank))
        engine.step()  # puts the model's parameters back first, and trains
        results.append(
            {
                "stage": stage,
                "built": built,
                "after step": after_step,
                "in step": seen_by_step,
                "names": names,
                "state entries": len(saved["state"]),
                "after state_dict": after_state_dict,
                "failed": failed,
                "after failed step": lists_model_parameters(),
                "steps": engine.steps_taken,
                "misfit": misfit,
                "after misfit": after_misfit,
                "after forward": after_forward,
                "closure": closure,
            }
        )
    return results


def test_param_groups_list_the_model_parameters_between_steps(grid: list) -> None:
    for results in by_rank(grid, "group view"):
        for result in results:
            assert result["built"] and result["after step"] and result["after state_dict"], result
            assert result["in step"][0] is False  # the optimizer's own step runs on this rank's pieces
            assert result["names"][0][0] == "blocks.0.ln.weight"
            assert result["state entries"] > 0
            assert "a hook failed" in result["failed"] and result["after failed step"] and result["steps"] == 2, result
            assert result["after forward"], result
            assert "optimizer.step(closure) is not supported" in result["closure"], result
            assert "does not fit this rank's shards" in result["misfit"] and result["after misfit"], result


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every case of this file in one spawn of two ranks."""
    workers = {
        "changes": _changes_worker,
        "toggle": _toggle_worker,
        "fp16": _fp16_worker,
        "more changes": _more_changes_worker,
        "recompute cast": _recompute_cast_worker,
        "checkpoint after added group": functools.partial(
            _checkpoint_after_added_group_worker, directory=str(tmp_path_factory.mktemp("groups"))
        ),
        "adagrad": _adagrad_worker,
        "group view": _group_view_worker,
        "frozen differently": _frozen_differently_worker,
    }
    if importlib.util.find_spec("transformers") is not None:
        workers["buffers"] = _buffers_worker
    return run_distributed(run_each, 2, workers, timeout=600)
