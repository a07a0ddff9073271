"""``skip_nonfinite_steps``: an optimizer step whose gradients hold inf or NaN on any rank is skipped on every
rank, as DeepSpeed's ZeRO skips it (in fp32 and bf16 as in fp16), and a DeepSpeed config asks for it where
DeepSpeed would skip: ``bf16.check_grad_overflow`` (default true) at stages 1 and 2, always at stage 3 and in
fp32. Off (the default), the step is taken, as torch and DDP take it. DeepSpeed's own engine on the same config
and the same injected inf: ``tests/adapters/deepspeed/test_deepspeed_config.py`` (its ``*inf`` cases)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from zero_core import MixedPrecision, ZeroConfig, ZeroEngine
from zero_core.deepspeed import from_deepspeed

STEPS = 4
POISONED_STEP = 1  # its second micro-batch's loss is inf on rank 1 only


def _skips(config: dict) -> bool | None:
    return from_deepspeed(config).settings.get("skip_nonfinite_steps")


# (stage, the bf16 section or None for fp32) -> whether DeepSpeed 0.19.8 skipped the step with an inf gradient on
# one of two ranks (measured with DeepSpeed's engine on the CPU: was_step_applied() and the weights after it).
DEEPSPEED_SKIPS = {
    (stage, "fp32"): True for stage in (1, 2, 3)
} | {
    (stage, "bf16"): True for stage in (1, 2, 3)  # check_grad_overflow left out: DeepSpeed's default, true
} | {
    (stage, "bf16 check true"): True for stage in (1, 2, 3)
} | {
    (1, "bf16 check false"): False, (2, "bf16 check false"): False,
    (3, "bf16 check false"): True,  # stage 3 does not read the key: a step with an invalid norm is skipped
}  # fmt: skip
_SECTIONS = {
    "fp32": None,
    "bf16": {"enabled": True},
    "bf16 check true": {"enabled": True, "check_grad_overflow": True},
    "bf16 check false": {"enabled": True, "check_grad_overflow": False},
}


@pytest.mark.parametrize(("stage", "precision"), sorted(DEEPSPEED_SKIPS))
def test_a_deepspeed_config_skips_the_steps_deepspeed_skips(stage: int, precision: str) -> None:
    zero = {"zero_optimization": {"stage": stage}}
    section = _SECTIONS[precision]
    precision_first = zero if section is None else {"bf16": section, **zero}
    zero_first = zero if section is None else {**zero, "bf16": section}
    # Whichever order the sections come in (Hugging Face's files put zero_optimization last).
    assert _skips(precision_first) == _skips(zero_first) == DEEPSPEED_SKIPS[stage, precision]
    if section is not None:  # DeepSpeed reads the older section name where there is no "bf16"
        assert _skips({"bfloat16": section, **zero}) == DEEPSPEED_SKIPS[stage, precision]


def test_the_setting_is_off_unless_asked_for_and_refused_where_it_cannot_hold() -> None:
    assert ZeroConfig().skip_nonfinite_steps is False  # torch's and DDP's behaviour
    # A bf16 section that is off is not read (DeepSpeed trains in fp32 then, and skips as fp32 does).
    assert _skips({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False, "check_grad_overflow": False}})
    with pytest.raises(ValueError, match=r"bf16.check_grad_overflow='yes' \(true or false\)"):
        from_deepspeed({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "check_grad_overflow": "yes"}})
    with pytest.raises(ValueError, match="ZeroConfig.skip_nonfinite_steps must be True or False"):
        ZeroConfig(skip_nonfinite_steps=1)
    # A unit stepped during backward cannot be taken back once another rank's gradient turns out inf.
    with pytest.raises(ValueError, match="offload_step_in_backward=True cannot run with skip_nonfinite_steps=True"):
        ZeroConfig(stage=2, offload_optimizer="cpu", offload_step_in_backward=True, skip_nonfinite_steps=True)


def _run(rank: int, stage: int, bf16: bool, skip: bool, poison: bool, shard_group_size: int | None = None) -> dict:
    """Two micro-batches a step (the first under no_sync); ``poison``: the second micro-batch of POISONED_STEP
    has an inf loss on rank 1. Without poison, the user drops POISONED_STEP's gradients and takes no step (the
    run a skip must equal)."""
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    precision = MixedPrecision(compute_dtype=torch.bfloat16) if bf16 else MixedPrecision()
    config = ZeroConfig(
        stage=stage, mixed_precision=precision, skip_nonfinite_steps=skip, shard_group_size=shard_group_size
    )
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)
    skipped, traffic = [], []
    for step in range(STEPS):
        with engine.no_sync():
            ids = batch(2 * step, rank)
            engine.backward(lm_loss(model(ids), ids))
        ids = batch(2 * step + 1, rank)
        factor = math.inf if poison and step == POISONED_STEP and rank == 1 else 1.0
        engine.backward(lm_loss(model(ids), ids) * factor)
        if step == POISONED_STEP and not poison:
            engine.optimizer.zero_grad()
            skipped.append(None)
            traffic.append(None)
            continue
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        skipped.append(engine.last_step_skipped)
        traffic.append({kind: vars(count) for kind, count in engine.last_step_traffic.items()})
    weights = {name: value.float().clone() for name, value in engine.full_state_dict().items()}
    engine.unshard()
    return {"skipped": skipped, "steps": engine.steps_taken, "weights": weights, "traffic": traffic}


CASES = [(stage, bf16, None) for stage in (1, 2, 3) for bf16 in (False, True)] + [(2, True, 1)]  # last: hybrid


def _worker(rank: int, world_size: int) -> list[dict]:
    results = []
    for stage, bf16, shard_group_size in CASES:
        runs = {
            name: _run(rank, stage, bf16, skip, poison, shard_group_size)
            for name, skip, poison in (("skips", True, True), ("user skips", False, False), ("off", False, True))
        }
        results.append({"case": (stage, bf16, shard_group_size), **runs})
    return results


@pytest.fixture(scope="module")
def grid() -> list[list[dict]]:
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{s}-{'bf16' if b else 'fp32'}{'-hybrid' if g else ''}"
                                                          for s, b, g in CASES])  # fmt: skip
def test_a_step_with_an_inf_gradient_on_one_rank_is_skipped_on_every_rank(grid: list, index: int) -> None:
    """Every rank skips the step (only rank 1 saw the inf), the weights are bit for bit those of a run that
    took no step there, and the other steps move the same collectives as that run: the decision rides on the
    step's agreement, which runs every step whether the setting is on or off."""
    for results in grid:
        runs = results[index]
        skips, user = runs["skips"], runs["user skips"]
        assert skips["skipped"] == [step == POISONED_STEP for step in range(STEPS)], runs["case"]
        assert skips["steps"] == user["steps"] == STEPS - 1
        for name, value in user["weights"].items():
            assert torch.equal(skips["weights"][name], value), (runs["case"], name)
        # A step's traffic counts from the last step on: the user's run has none at POISONED_STEP.
        for step in range(STEPS):
            if step not in (POISONED_STEP, POISONED_STEP + 1):
                assert skips["traffic"][step] == user["traffic"][step], (runs["case"], step)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_off_the_step_is_taken_as_torch_takes_it(grid: list, index: int) -> None:
    for results in grid:
        off, user = results[index]["off"], results[index]["user skips"]
        assert off["skipped"] == [False] * STEPS and off["steps"] == STEPS
        assert not all(torch.isfinite(value).all() for value in off["weights"].values())  # the inf reached them
        # The same collectives as with the setting on (and as the run without poison), step by step.
        on = results[index]["skips"]
        assert off["traffic"][0] == on["traffic"][0] == user["traffic"][0]
        assert off["traffic"][POISONED_STEP + 1] == on["traffic"][POISONED_STEP + 1]
