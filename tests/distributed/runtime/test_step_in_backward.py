"""offload_step_in_backward: the offloaded units step on the host during backward, and train exactly as
when they step in optimizer.step(); what may not run between that backward and the step is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for, relative_difference
from zero_core import MixedPrecision, ZeroConfig, ZeroEngine
from zero_core.passes import step_in_backward
from zero_core.passes.step_in_backward import StepInBackward

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


def test_units_stepped_during_backward_train_exactly_as_stepped_in_the_step(tmp_path: Path) -> None:
    for rank_results in run_distributed(_parity, 2, str(tmp_path)):
        for result in rank_results:
            case = result["case"]
            assert result["same losses"] and result["weights difference"] == 0.0, case
            # Without hybrid sharding the first unit's step is handed over before the backward ends.
            assert result["handed over during backward"] == ("shard_group_size" not in case), case
            assert (result["state on disk"] > 0) == (case["offload_optimizer"] == "nvme"), case


def _error_of(attempt: Callable[[], object]) -> str | None:
    try:
        attempt()
        return None
    except (RuntimeError, ValueError) as error:
        return str(error)


def _refusals(rank: int, world_size: int, directory: str) -> dict:
    case = {"stage": 3, "offload_optimizer": "nvme"}
    reference, ours = _engine(case, directory, early=False), _engine(case, directory, early=True)
    expected = _train(reference, rank, case, range(2))
    losses_so_far = _train(ours, rank, case, range(1))
    ids = batch(10, rank)  # the second step's batch, as _train takes it
    loss = lm_loss(ours.model(ids), ids)
    ours.backward(loss, retain_graph=True)  # so that a second backward can be tried
    attempts = {
        "forward": lambda: ours.model(ids),
        "backward": lambda: ours.backward(loss),
        "clip": lambda: ours.clip_grad_norm_(1.0),
        "zero_grad": ours.zero_grad,
        "optimizer state": ours.optimizer.state_dict,
        "checkpoint": lambda: ours.save_checkpoint(Path(directory) / f"refused{rank}"),
        "full state dict": ours.full_state_dict,
        "gathered parameters": lambda: ours.gathered_parameters().__enter__(),
    }
    refused = {name: _error_of(attempt) for name, attempt in attempts.items()}
    ours.step()  # nothing above changed what this step applies
    losses_so_far.append(loss.item())
    results = {
        "refused": refused,
        "same after refusals": losses_so_far == expected,
        "weights after refusals": relative_difference(ours.full_state_dict(), reference.full_state_dict()),
    }

    # Accumulating without no_sync: the second micro-batch's forward is refused.
    ours.backward(lm_loss(ours.model(ids), ids))
    results["accumulation"] = _error_of(lambda: ours.model(ids))
    ours.step()

    # What leaves the model partly updated, every rank alike, until a checkpoint is loaded.
    checkpoint = Path(directory) / "good"
    ours.save_checkpoint(checkpoint)
    original_step_of_pieces = step_in_backward.step_of_pieces

    def failing_on_rank_1(*args):  # type: ignore[no-untyped-def]
        step = original_step_of_pieces(*args)
        return step if rank == 0 else lambda: (_ for _ in ()).throw(RuntimeError("no host memory"))

    def changed_lr() -> Callable[[], None]:
        ours.optimizer.param_groups[0]["lr"] *= 2
        return lambda: None  # the checkpoint's learning rate comes back with it

    def changed_group() -> Callable[[], None]:
        removed = ours.optimizer.param_groups[0]["params"].pop()
        return lambda: ours.optimizer.param_groups[0]["params"].append(removed)  # the groups the checkpoint has

    def foreign_tensor_on_rank_1() -> Callable[[], None]:
        # Added before the backward on one rank only: that rank steps nothing early, the other does; the
        # step's agreement refuses it on both, and both count the model partly updated.
        group = ours.optimizer.param_groups[0]["params"]
        if rank == 1:
            group.append(torch.zeros(1, requires_grad=True))
        return lambda: group.pop() if rank == 1 else None

    cases = [("changed lr", changed_lr), ("changed group", changed_group), ("worker", None)]
    for name, between in [*cases, ("foreign tensor", foreign_tensor_on_rank_1)]:
        step_in_backward.step_of_pieces = failing_on_rank_1 if between is None else original_step_of_pieces
        undo = between() if name == "foreign tensor" else lambda: None
        ours.backward(lm_loss(ours.model(ids), ids))
        if between is not None and name != "foreign tensor":
            undo = between()
        results[name] = _error_of(ours.step)
        step_in_backward.step_of_pieces = original_step_of_pieces
        results[f"after {name}"] = _error_of(lambda: ours.model(ids))
        undo()
        # Only a load of both the model and the optimizer's state ends it (each half holds part of the step).
        results[f"weights only after {name}"] = _error_of(
            lambda: ours.load_checkpoint(checkpoint, load_optimizer=False)
        )
        ours.load_checkpoint(checkpoint)

    # A backward that raises once the last block's reduce was issued, maybe before its step began on some
    # rank (in the middle block's backward): every rank counts the model partly updated, whatever the timing.
    hook = ours.model.blocks[1].register_forward_pre_hook(lambda module, args: (_RaisesInBackward.apply(args[0]),))
    results["raised in backward"] = _error_of(lambda: ours.backward(lm_loss(ours.model(ids), ids)))
    hook.remove()
    results["broken by backward"] = _error_of(lambda: ours.model(ids))
    ours.load_checkpoint(checkpoint)
    ours.backward(lm_loss(ours.model(ids), ids))
    ours.step()  # trains again after the load
    return results


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("a failure in backward")


def test_what_would_see_or_change_a_half_applied_step_is_refused_alike_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_refusals, 2, str(tmp_path))
    for key in ("refused", "accumulation", "changed lr", "changed group", "after worker", "broken by backward"):
        assert results[0][key] == results[1][key], key
    assert results[0]["foreign tensor"] == results[1]["foreign tensor"]  # the step's agreement, on both ranks
    assert "refused add_param_group calls" in results[0]["foreign tensor"]
    for result in results:
        for name, message in result["refused"].items():
            assert message is not None and "call optimizer.step() first" in message, name
        assert result["same after refusals"] and result["weights after refusals"] == 0.0
        assert result["accumulation"] is not None and "a forward is refused" in result["accumulation"]
        for name in ("changed lr", "changed group"):
            assert result[name] is not None and "param groups or hyperparameters changed" in result[name]
        # A host step that raised on rank 1 only: the step's agreement raises it on both.
        assert result["worker"] is not None and "host steps during backward that raised" in result["worker"]
        for name in ("changed lr", "changed group", "worker", "foreign tensor", "broken by backward"):
            after = result[f"after {name}"] if name != "broken by backward" else result[name]
            assert after is not None and "partly updated" in after and "Load the last checkpoint" in after, name
            if name != "broken by backward":
                partial = result[f"weights only after {name}"]
                assert partial is not None and "(load both)" in partial, name
        assert result["raised in backward"] == "a failure in backward"


def test_fp16_is_refused_and_without_an_offloaded_optimizer_nothing_changes() -> None:
    with pytest.raises(ValueError, match="fp16 loss scaling"):
        ZeroConfig(
            offload_optimizer="cpu",
            offload_step_in_backward=True,
            mixed_precision=MixedPrecision(compute_dtype=torch.float16),
        )
    assert not ZeroConfig(offload_step_in_backward=True).steps_in_backward  # no host step to overlap
