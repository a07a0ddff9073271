"""offload_activations: each unit's forward runs under saved-tensor hooks (what it saves for backward waits in
host memory; on a CPU device the saved tensor is kept as it is). Training is unchanged, every saved tensor of
a unit's forward goes through the hooks, a forward that raises leaves no hook active, and activation
checkpoints around the blocks keep checkpointing them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zero_core.passes.activation_offload as activation_offload
from tests.distributed.runtime.test_activation_checkpointing import _apply as apply_checkpoints
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for
from zero_core import ZeroConfig, ZeroEngine


class Counting(activation_offload.SavedOnHost):
    """The hooks each unit's forward runs under, counting what they pack and how often they are entered and left."""

    packed = entered = left = 0

    def __init__(self, keep) -> None:  # type: ignore[no-untyped-def]
        super().__init__(keep)
        pack = self.pack_hook

        def counted(tensor: torch.Tensor):  # type: ignore[no-untyped-def]
            Counting.packed += 1
            return pack(tensor)

        self.pack_hook = counted

    def __enter__(self):  # type: ignore[no-untyped-def]
        Counting.entered += 1
        return super().__enter__()

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        Counting.left += 1
        return super().__exit__(*exc)


def _train(engine: ZeroEngine, rank: int) -> list[float]:
    losses = []
    for step in range(3):
        ids = batch(step, rank)
        loss = lm_loss(engine.model(ids), ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _run(rank: int, world_size: int) -> dict:
    activation_offload.SavedOnHost = Counting  # looked up when each unit's forward starts
    results = {}
    for stage in (2, 3):
        Counting.packed = Counting.entered = Counting.left = 0
        engines = {}
        for offload in (False, True):
            torch.manual_seed(0)
            model = TinyTransformer(batchnorm=False)
            config = dataclasses.replace(config_for(stage), offload_activations=offload)
            engines[offload] = ZeroEngine(model, make_optimizer("adamw", model), config)
        reference = _train(engines[False], rank)
        packed_without = Counting.packed
        losses = _train(engines[True], rank)
        results[f"stage {stage}"] = {
            "same losses": losses == reference,
            "packed without": packed_without,
            "packed with": Counting.packed - packed_without,
            "balanced": Counting.entered == Counting.left > 0,
        }
        # A forward that raises inside a block: every context it entered is left, none stays active.
        model = engines[True].model
        original = type(model.blocks[1]).forward
        model.blocks[1].forward = lambda x: (_ for _ in ()).throw(RuntimeError("a block failed"))
        try:
            model(batch(9, rank))
        except RuntimeError:
            pass
        del model.blocks[1].forward
        assert type(model.blocks[1]).forward is original
        before = Counting.packed
        x = torch.ones(3, requires_grad=True)
        (x * x).sum().backward()  # outside the model: no context of ours may pack this
        results[f"stage {stage}"]["after a failed forward"] = (
            Counting.entered == Counting.left and Counting.packed == before
        )
        results[f"stage {stage}"]["trains after it"] = len(_train(engines[True], rank)) == 3
    # Activation checkpointing around the blocks keeps checkpointing them: only what runs outside the blocks
    # goes through our hooks (fewer packs than without checkpoints), and training is unchanged.
    packs_per_run = {}
    for form in ("none", "wrapper", "wrapper-reentrant"):
        losses = {}
        for offload in (False, True):
            torch.manual_seed(0)
            model = TinyTransformer(batchnorm=False)
            if form != "none":
                apply_checkpoints(form, model)
            config = dataclasses.replace(config_for(3), offload_activations=offload)
            before = Counting.packed
            losses[offload] = _train(ZeroEngine(model, make_optimizer("adamw", model), config), rank)
            packs_per_run[form] = Counting.packed - before
        results[f"checkpoints {form}"] = {"same losses": losses[True] == losses[False]}
    results["fewer packs with checkpoints"] = all(
        0 < packs_per_run[form] < packs_per_run["none"] for form in ("wrapper", "wrapper-reentrant")
    )
    return results


def test_activation_offload_trains_the_same_and_leaves_no_hook_behind() -> None:
    for results in run_distributed(_run, 2):
        assert results.pop("fewer packs with checkpoints")
        for case, result in results.items():
            assert result["same losses"], case
            if case.startswith("checkpoints"):
                continue
            assert result["packed without"] == 0 and result["packed with"] > 0, case
            assert result["balanced"] and result["after a failed forward"] and result["trains after it"], case


def test_the_setting_is_a_boolean() -> None:
    assert ZeroConfig(offload_activations=True).offload_activations
    with pytest.raises(ValueError, match="offload_activations must be True or False"):
        ZeroConfig(offload_activations="yes")  # type: ignore[arg-type]
