"""Activation checkpointing in every form users use, at every stage: exact
(DDP parity), with the memory and traffic ZeRO promises. The counts are
asserted, not only the losses: live gathered units within the prefetch
bound, all-gather bytes of 2Ψ per step in stage 3 (the recompute reuses the
backward gather), and every block's reduce-scatter issued during backward.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from tests.models import Block, batch, lm_loss
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.runtime_workers import (
    ReduceProbe,
    make_pair,
    padded_numel,
    parameter_error,
    reference_step,
    traffic_of,
    train_step,
)
from zero_core import CollectiveKind, MixedPrecision, WrapPolicy, ZeroConfig

FORMS = [
    "none",
    "inside-reentrant",  # torch.utils.checkpoint inside the unit's forward
    "inside-nonreentrant",
    "wrapper-reentrant",  # checkpoint_wrapper / apply_activation_checkpointing around the units
    "wrapper-nonreentrant",
    "wrapper-nonreentrant-no-early-stop",
]
STAGES = (1, 2, 3)
BLOCKS = 3


class _InsideCheckpointBlock(Block):
    use_reentrant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=self.use_reentrant)


class _InsideReentrantBlock(_InsideCheckpointBlock):
    use_reentrant = True


def _apply(form: str, model: torch.nn.Module) -> None:
    if form.startswith("inside"):
        for block in model.blocks:
            block.__class__ = _InsideReentrantBlock if form == "inside-reentrant" else _InsideCheckpointBlock
    elif form.startswith("wrapper"):
        impl = CheckpointImpl.REENTRANT if form == "wrapper-reentrant" else CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda module: isinstance(module, Block),
        )


def _lm(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(ids), ids)


def _hf_lm(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _train(stage: int, form: str, steps: int = 3) -> dict:
    pair = make_pair(stage, prepare=functools.partial(_apply, form))
    probe = ReduceProbe(pair.engine, pair.model.norm)
    rank = torch.distributed.get_rank()
    errors, gathered, reduced, peaks = [], [], [], []
    early_stop = set_checkpoint_early_stop(not form.endswith("no-early-stop"))
    with early_stop:
        for step in range(steps):
            ids = batch(step, rank)
            reference_loss = lm_loss(pair.ddp(ids), ids)
            reference_loss.backward()
            reference_step(pair)
            pair.engine.reset_peak_live_units()
            probe.start_step()
            loss, traffic = traffic_of(pair.engine, lambda: train_step(pair.engine, pair.model, ids, _lm))
            errors.append(
                max(abs(loss.item() - reference_loss.item()) / abs(reference_loss.item()), parameter_error(pair))
            )
            gathered.append(traffic[CollectiveKind.ALL_GATHER.value].bytes)
            reduced.append(traffic[CollectiveKind.REDUCE_SCATTER.value].calls)
            peaks.append(pair.engine.peak_live_units)
    return {
        "errors": errors,
        "all_gather_bytes": gathered,
        "reduce_calls": reduced,
        "reduces_before_blocks_done": probe.seen,
        "peak_live_units": peaks,
        "padded_numel": padded_numel(pair.engine),
        "units": len(pair.engine.unit_reports()),
    }


def _grid(rank: int, world_size: int) -> list[dict]:
    return [_train(stage, form) for stage in STAGES for form in FORMS]


CASES = [(stage, form) for stage in STAGES for form in FORMS]


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    """One spawn for the file: the block model's cases, then Hugging Face's (where installed)."""
    workers = {"blocks": _grid}
    if importlib.util.find_spec("transformers") is not None:
        workers["hugging face"] = _hf_grid
    return run_distributed(run_each, 2, workers)


@pytest.fixture
def results(grid: list[dict]) -> list[list[dict]]:
    return by_rank(grid, "blocks")


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{s}-{f}" for s, f in CASES])
def test_checkpointing_matches_ddp_with_zero_memory_and_traffic(results: list[list[dict]], index: int) -> None:
    stage, form = CASES[index]
    for rank, per_case in enumerate(results):
        result = per_case[index]
        assert max(result["errors"]) <= 1e-5, f"rank {rank}: {result['errors']}"
        # Stage 3 gathers every unit once for forward and once for backward; stages 1/2 once after the step.
        gathers = 2 if stage == 3 else 1
        assert result["all_gather_bytes"] == [gathers * result["padded_numel"] * 4] * 3
        assert result["reduce_calls"] == [result["units"]] * 3  # each unit exactly once
        # When backward reaches the layer in front of the blocks, every block has been reduced.
        assert result["reduces_before_blocks_done"] == [BLOCKS] * 3
        if stage == 3:
            # Root + the running block + one prefetched.
            assert max(result["peak_live_units"]) <= 3, result["peak_live_units"]


def _hf_llama(stage: int, checkpointing: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )

    def factory() -> torch.nn.Module:
        return LlamaForCausalLM(config)

    def prepare(model: torch.nn.Module) -> None:
        if checkpointing != "none":
            model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        model.train()

    zero = ZeroConfig(
        stage=stage, wrap_policy=WrapPolicy(module_classes=(LlamaDecoderLayer,)), mixed_precision=MixedPrecision()
    )
    pair = make_pair(
        stage,
        model_factory=factory,
        prepare=prepare,
        config=zero,
        optimizer_factory=lambda module: torch.optim.AdamW(module.parameters(), lr=1e-2),
    )
    rank = torch.distributed.get_rank()
    errors, peaks, gathered = [], [], []
    for step in range(3):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(10 * step + rank))
        reference_loss = pair.ddp(input_ids=ids, labels=ids).loss
        reference_loss.backward()
        reference_step(pair)
        pair.engine.reset_peak_live_units()
        loss, traffic = traffic_of(pair.engine, lambda: train_step(pair.engine, pair.model, ids, _hf_lm))
        errors.append(max(abs(loss.item() - reference_loss.item()) / abs(reference_loss.item()), parameter_error(pair)))
        peaks.append(pair.engine.peak_live_units)
        gathered.append(traffic[CollectiveKind.ALL_GATHER.value].bytes)
    return {"errors": errors, "peaks": peaks, "all_gather_bytes": gathered, "padded_numel": padded_numel(pair.engine)}


HF_CASES = [(stage, form) for stage in (2, 3) for form in ("none", "nonreentrant", "reentrant")]


def _hf_grid(rank: int, world_size: int) -> list[dict]:
    return [_hf_llama(stage, form) for stage, form in HF_CASES]


def test_hugging_face_gradient_checkpointing_matches_ddp(grid: list[dict]) -> None:
    pytest.importorskip("transformers")
    for rank, per_case in enumerate(by_rank(grid, "hugging face")):
        for (stage, form), result in zip(HF_CASES, per_case):
            assert max(result["errors"]) <= 1e-5, f"rank {rank} stage {stage} {form}: {result['errors']}"
            gathers = 2 if stage == 3 else 1
            assert result["all_gather_bytes"] == [gathers * result["padded_numel"] * 4] * 3, (stage, form)
            if stage == 3:
                assert max(result["peaks"]) <= 3, (form, result["peaks"])
