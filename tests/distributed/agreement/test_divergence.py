"""Ranks that stop running the same forwards, backwards and steps get an error
that says so, on every rank, within the process group's timeout: never a
silent hang, never a silent mix of collectives of different steps."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import run_distributed
from tests.workers import config_for
from zero_core import CollectiveFailed, ZeroEngine

PG_TIMEOUT = 4.0  # seconds; the process group's own timeout
SLACK = 8.0  # how much longer than the timeout a rank may take to give up
ZERO_PLUS_PLUS = {"quantize_weights": True, "quantize_gradients": True}


def _train_step(model: TinyTransformer, engine: ZeroEngine, step: int) -> None:
    ids = batch(step, engine.rank)
    engine.backward(lm_loss(model(ids), ids))
    engine.step()


def _outcome(run, *also: type[Exception]) -> dict:  # type: ignore[no-untyped-def]
    """Run the diverging part; report what was raised (``CollectiveFailed``, or one of ``also``) and how long
    it took."""
    start = time.monotonic()
    try:
        run()
    except (CollectiveFailed, *also) as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _extra_forward_on_rank0(rank: int, world_size: int, settings: dict | None = None) -> dict:
    """Stage 3: rank 0 alone runs an evaluation forward (predict on rank 0 only). ``settings``: more of
    ZeroConfig's (ZeRO++'s quantized weights and gradients: one rank's quantized gradient all-to-all then
    meets the other's quantized parameter gathers)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    config = dataclasses.replace(config_for(3), **(settings or {}))
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)
    _train_step(model, engine, 0)

    def diverge() -> None:
        if rank == 0:
            with torch.no_grad():
                model(batch(50, rank))
        for step in range(1, 4):
            _train_step(model, engine, step)

    return _outcome(diverge)


def _rank0_fails_mid_backward(rank: int, world_size: int, quantized: bool) -> dict:
    """Stage 3: rank 0's backward raises halfway (its own error, say a check on a gradient), while rank 1
    goes on to the next unit's gradient reduce: quantized, an all-to-all; exact, on gloo over two ranks, an
    exchange of slices whose receive never completes."""
    torch.manual_seed(0)
    model = TinyTransformer()
    config = dataclasses.replace(config_for(3), quantize_gradients=quantized)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config)
    _train_step(model, engine, 0)

    def fail_in_backward(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        def fail(grad: torch.Tensor) -> None:
            raise ValueError("rank 0's own check failed")

        output.register_hook(fail)

    if rank == 0:
        model.blocks[1].register_forward_hook(fail_in_backward)
    return _outcome(lambda: _train_step(model, engine, 1), ValueError)


def _skipped_micro_batch_on_rank1(rank: int, world_size: int) -> dict:
    """Stage 1, accumulation: rank 1 skips a micro-batch. The collectives still
    line up, so only the step counters can tell: the same error on every rank."""
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=False)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(1))

    def diverge() -> None:
        for step in range(3):
            for micro in range(2):
                if step == 1 and micro == 0 and rank == 1:
                    continue  # e.g. a bad batch caught on this rank only
                ids = batch(10 * step + micro, rank)
                with engine.no_sync() if micro == 0 else torch.enable_grad():
                    engine.backward(lm_loss(model(ids), ids) / 2)
            engine.step()

    return _outcome(diverge)


def _rank1_stops_early(rank: int, world_size: int) -> dict:
    """Stage 2: rank 1 leaves the loop one step early; rank 0 must not wait forever."""
    torch.manual_seed(0)
    model = TinyTransformer()
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(2))

    def diverge() -> None:
        for step in range(3 if rank == 0 else 2):
            _train_step(model, engine, step)

    return _outcome(diverge)


def _assert_names_the_rule(message: str) -> None:
    assert message.startswith("ZeRO: ")
    assert "Every rank must run the same forwards, backwards and optimizer steps" in message
    assert "gathered_parameters()" in message and "init_process_group(timeout=...)" in message


def test_extra_forward_on_one_rank_fails_on_every_rank_within_the_timeout() -> None:
    outcomes = run_distributed(_extra_forward_on_rank0, 2, pg_timeout=PG_TIMEOUT, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None, f"rank {rank} went on as if nothing happened"
        _assert_names_the_rule(outcome["error"])
        assert "optimizer step" in outcome["error"]
        assert outcome["seconds"] <= PG_TIMEOUT + SLACK, outcome
    # At least one rank names the unit whose all-gather it waited for.
    assert any("unit '" in outcome["error"] or "root unit" in outcome["error"] for outcome in outcomes)


def test_quantized_collectives_of_diverged_ranks_fail_on_every_rank_within_the_timeout() -> None:
    """ZeRO++'s quantized all-to-alls and gathers end in the same clear error as the exact ones: no rank
    hangs or goes on alone with a sum of mismatched pieces."""
    outcomes = run_distributed(_extra_forward_on_rank0, 2, ZERO_PLUS_PLUS, pg_timeout=PG_TIMEOUT, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None, f"rank {rank} went on as if nothing happened"
        _assert_names_the_rule(outcome["error"])
        assert outcome["seconds"] <= PG_TIMEOUT + SLACK, outcome


@pytest.mark.parametrize("quantized", [False, True], ids=["exchange", "quantized"])
def test_a_rank_leaving_mid_backward_fails_the_others_next_gradient_reduce(quantized: bool) -> None:
    """When one rank's backward stops halfway, the other's next gradient reduce (exact: the two-rank
    exchange; qgZ: an all-to-all) ends in the clear error naming it, within the timeout, instead of waiting
    forever or summing without it."""
    outcomes = run_distributed(_rank0_fails_mid_backward, 2, quantized, pg_timeout=PG_TIMEOUT, timeout=120)
    assert outcomes[0]["error"] == "rank 0's own check failed"
    error = outcomes[1]["error"]
    assert error is not None and error.startswith("ZeRO: reduce_scatter of unit 'blocks."), error
    assert "(rank 1, backward" in error, error
    _assert_names_the_rule(error)
    assert outcomes[1]["seconds"] <= PG_TIMEOUT + SLACK


def test_skipped_micro_batch_on_one_rank_is_caught_at_the_next_step_on_every_rank() -> None:
    outcomes = run_distributed(_skipped_micro_batch_on_rank1, 2, pg_timeout=PG_TIMEOUT, timeout=120)
    messages = [outcome["error"] for outcome in outcomes]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "forwards with grad: 3 on some ranks, 4 on others" in messages[0]
    _assert_names_the_rule(messages[0])
    assert all(outcome["seconds"] <= PG_TIMEOUT for outcome in outcomes)


def test_rank_that_stops_early_does_not_leave_the_other_hanging() -> None:
    outcomes = run_distributed(_rank1_stops_early, 2, pg_timeout=PG_TIMEOUT, timeout=120)
    assert outcomes[1]["error"] is None  # it finished its own loop
    assert outcomes[0]["error"] is not None
    _assert_names_the_rule(outcomes[0]["error"])
    assert outcomes[0]["seconds"] <= PG_TIMEOUT + SLACK


def test_a_failed_call_of_a_collective_waits_for_its_other_calls() -> None:
    """Gloo's rooted all-gather and reduce-scatter are one call per rank: when one fails, the
    others must have ended before the error reaches code that frees their buffers."""
    from zero_core.collectives import Handle

    class Work:
        def __init__(self, fails: bool):
            self.fails, self.waited = fails, False

        def wait(self) -> None:
            self.waited = True
            if self.fails:
                raise RuntimeError("Timed out waiting 5000ms for recv operation")

    works = [Work(fails=True), Work(fails=False), Work(fails=True)]
    copied = []
    handle = Handle(works, after_wait=lambda: copied.append(True))
    with pytest.raises(CollectiveFailed, match="Timed out waiting"):
        handle.wait()
    assert [work.waited for work in works] == [True, True, True]
    assert copied == []  # the output is incomplete: nothing copied out of it
