"""offload_step_in_backward: the offloaded units step on the host during backward, and train exactly as
when they step in optimizer.step(); what may not run between that backward and the step is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from pathlib import Path

import pytest
import torch

from zero_core import MixedPrecision, ZeroConfig, ZeroEngine
from zero_core.step.step_in_backward import StepInBackward

from .distributed import run_distributed
from .models import TinyTransformer, batch, lm_loss, make_optimizer
from .workers import config_for, relative_difference

CASES = [
    {"stage": 1, "offload_optimizer": "cpu"},
    {"stage": 2, "offload_optimizer": "cpu", "accumulate": 2},
    {"stage": 3, "offload_optimizer": "cpu", "precision": "bf16"},
    {"stage": 3, "offload_optimizer": "nvme", "offload_units_in_memory": 1},
    {"stage": 1, "offload_optimizer": "nvme", "accumulate": 2, "offload_fraction": 0.5},
    {"stage": 3, "offload_optimizer": "nvme", "shard_group_size": 1},  # hybrid: after the reduce across groups
    {"stage": 3, "offload_optimizer": "cpu", "optimizer": "sgd", "one_rank_skips_branch": True},
]


def _engine(case: dict, directory: str, early: bool) -> ZeroEngine:
    case = dict(case)
    stage, optimizer = case.pop("stage"), case.pop("optimizer", "adamw")
    precision = MixedPrecision(compute_dtype=torch.bfloat16) if case.pop("precision", None) else None
    for key in ("accumulate", "one_rank_skips_branch"):
        case.pop(key, None)
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    config = config_for(stage, precision=precision, shard_group_size=case.pop("shard_group_size", None))
    config = dataclasses.replace(config, offload_dir=directory, offload_step_in_backward=early, **case)
    return ZeroEngine(model, make_optimizer(optimizer, model), config)


def _train(engine: ZeroEngine, rank: int, case: dict, steps: range, events: list | None = None) -> list[float]:
    """Accumulation inside no_sync (the setting's rule); the branch unused on rank 1 in some steps."""
    accumulate, losses = case.get("accumulate", 1), []
    for step in steps:
        for micro in range(accumulate):
            ids = batch(10 * step + micro, rank)
            branch = not (case.get("one_rank_skips_branch") and rank == 1 and step % 2 == 0)
            with engine.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                loss = lm_loss(engine.model(ids, use_branch=branch), ids)
                engine.backward(loss / accumulate)
            losses.append(loss.item())
        engine.step()
        if events is not None:
            events.append(("optimizer step", -1))
    return losses


def _parity(rank: int, world_size: int, directory: str) -> list[dict]:
    events: list[tuple[str, int]] = []
    original_hand_over, original_end = StepInBackward._hand_over, StepInBackward.backward_reduced

    def hand_over(self, unit):  # type: ignore[no-untyped-def]
        events.append(("handed to the worker", unit.index))
        return original_hand_over(self, unit)

    def backward_reduced(self):  # type: ignore[no-untyped-def]
        events.append(("end of backward", -1))
        return original_end(self)

    StepInBackward._hand_over, StepInBackward.backward_reduced = hand_over, backward_reduced
    results = []
    try:
        for case in CASES:
            reference = _engine(case, directory, early=False)
            expected = _train(reference, rank, case, range(3))
            ours = _engine(case, directory, early=True)
            events.clear()
            losses = _train(ours, rank, case, range(3), events)
            first_step = events[: events.index(("optimizer step", -1))]
            first_handed = next(i for i, e in enumerate(first_step) if e[0] == "handed to the worker")
            end_of_backward = max(i for i, e in enumerate(first_step) if e[0] == "end of backward")  # the last
            results.append(
                {
                    "case": case,
                    "same losses": losses == expected,
                    "weights difference": relative_difference(ours.full_state_dict(), reference.full_state_dict()),
                    "handed over during backward": first_handed < end_of_backward,
                    "state on disk": ours.memory_report().nvme_bytes,
                }
            )
            del ours, reference
            gc.collect()
    finally:
        StepInBackward._hand_over, StepInBackward.backward_reduced = original_hand_over, original_end
    return results


@pytest.mark.distributed
def test_units_stepped_during_backward_train_exactly_as_stepped_in_the_step(tmp_path: Path) -> None:
    for rank_results in run_distributed(_parity, 2, str(tmp_path)):
        for result in rank_results:
            case = result["case"]
            assert result["same losses"] and result["weights difference"] == 0.0, case
            # Without hybrid sharding the first unit's step is handed over before the backward ends.
            assert result["handed over during backward"] == ("shard_group_size" not in case), case
            assert (result["state on disk"] > 0) == (case["offload_optimizer"] == "nvme"), case


def _refusals(rank: int, world_size: int, directory: str) -> dict:
    case = {"stage": 3, "offload_optimizer": "nvme"}
    reference, ours = _engine(case, directory, early=False), _engine(case, directory, early=True)
    expected = _train(reference, rank, case, range(2))
    engine_losses = _train(ours, rank, case, range(1))
    ids = batch(10, rank)  # the second step's batch, as _train takes it
    loss = lm_loss(ours.model(ids), ids)
    ours.backward(loss)
    refused = {}
    attempts = {
        "forward": lambda: ours.model(ids),
        "clip": lambda: ours.clip_grad_norm_(1.0),
        "zero_grad": ours.zero_grad,
        "optimizer state": ours.optimizer.state_dict,
        "checkpoint": lambda: ours.save_checkpoint(Path(directory) / f"refused{rank}"),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            refused[name] = None
        except RuntimeError as error:
            refused[name] = str(error)
    ours.step()  # nothing above changed what this step applies
    engine_losses.append(loss.item())
    same_after_refusals = engine_losses == expected
    weights_after_refusals = relative_difference(ours.full_state_dict(), reference.full_state_dict())

    # Accumulating without no_sync: the second micro-batch's forward is refused.
    loss = lm_loss(ours.model(ids), ids)
    ours.backward(loss)
    try:
        ours.model(ids)
        accumulation = None
    except RuntimeError as error:
        accumulation = str(error)
    ours.step()

    # A learning rate changed between backward and step: refused, and the model counts as partly updated
    # until a checkpoint is loaded.
    checkpoint = Path(directory) / "good"
    ours.save_checkpoint(checkpoint)
    ours.backward(lm_loss(ours.model(ids), ids))
    ours.optimizer.param_groups[0]["lr"] *= 2
    try:
        ours.step()
        changed_lr = None
    except ValueError as error:
        changed_lr = str(error)
    try:
        ours.model(ids)
        broken = None
    except RuntimeError as error:
        broken = str(error)
    ours.load_checkpoint(checkpoint)

    # A backward that raises after units stepped (here at the embeddings, after every block was reduced).
    hook = ours.model.embed.register_forward_hook(lambda module, args, output: _RaisesInBackward.apply(output))
    try:
        ours.backward(lm_loss(ours.model(ids), ids))
        raised_in_backward = False
    except RuntimeError:
        raised_in_backward = True
    hook.remove()
    try:
        ours.model(ids)
        broken_by_backward = None
    except RuntimeError as error:
        broken_by_backward = str(error)
    ours.load_checkpoint(checkpoint)
    ours.backward(lm_loss(ours.model(ids), ids))
    ours.step()  # trains again after the load
    return {
        "raised in backward": raised_in_backward,
        "broken by backward": broken_by_backward,
        "refused": refused,
        "same after refusals": same_after_refusals,
        "weights after refusals": weights_after_refusals,
        "accumulation": accumulation,
        "changed lr": changed_lr,
        "broken": broken,
    }


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("a failure in backward")


@pytest.mark.distributed
def test_what_would_see_or_change_a_half_applied_step_is_refused_alike_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_refusals, 2, str(tmp_path))
    assert results[0]["refused"] == results[1]["refused"]
    for result in results:
        for name, message in result["refused"].items():
            assert message is not None and "call optimizer.step() first" in message, name
        assert result["same after refusals"] and result["weights after refusals"] == 0.0
        assert result["accumulation"] is not None and "a forward is refused" in result["accumulation"]
        assert result["changed lr"] is not None and "hyperparameters changed" in result["changed lr"]
        assert result["broken"] is not None and "Load the last checkpoint" in result["broken"]
        assert result["raised in backward"]
        assert result["broken by backward"] is not None and "partly updated" in result["broken by backward"]


def test_fp16_is_refused_and_without_an_offloaded_optimizer_nothing_changes() -> None:
    with pytest.raises(ValueError, match="fp16 loss scaling"):
        ZeroConfig(
            offload_optimizer="cpu",
            offload_step_in_backward=True,
            mixed_precision=MixedPrecision(compute_dtype=torch.float16),
        )
    assert not ZeroConfig(offload_step_in_backward=True).steps_in_backward  # no host step to overlap
