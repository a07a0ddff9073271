"""The step runtime off the happy path, at stages 1-3 against DDP:

- an exception in forward or in backward, caught on every rank, leaves the
  engine exactly as if that batch had been skipped;
- the execution order may change (an eval forward first, layerdrop, blocks
  reordered): results stay exact and the live-unit bound holds;
- collectives never depend on data: a unit whose output is unused on one
  rank, an expert that gets no tokens on one rank.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from tests.models import Block, TinyTransformer, batch, lm_loss
from tests.rank_pool import run_distributed
from tests.runtime_workers import make_pair, padded_numel, parameter_error, reference_step, traffic_of, train_step
from tests.workers import config_for, refusal, relative_difference
from zero_core import CollectiveKind, ModelChangedError

STAGES = (1, 2, 3)


def _lm(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(ids), ids)


class InjectedFailure(RuntimeError):
    pass


class _ExplodeInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        raise InjectedFailure("injected failure in backward")


class FaultyTransformer(TinyTransformer):
    """Raises inside block 1 (gathered, with block 2 prefetched) when ``fail`` says so."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: str | None = None
        self.blocks[1].register_forward_pre_hook(self._maybe_fail_forward)
        self.blocks[1].register_forward_hook(self._maybe_fail_backward)

    def _maybe_fail_forward(self, module: nn.Module, args: tuple) -> None:
        if self.fail == "forward":
            raise InjectedFailure("injected failure in forward")

    def _maybe_fail_backward(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return _ExplodeInBackward.apply(output) if self.fail == "backward" else output


def _fail_once(pair, where: str, ids: torch.Tensor, micro_batches: int) -> tuple[int, list[str]]:  # type: ignore[no-untyped-def]
    """Run a failing micro-batch on both models, as far as it gets; returns (caught, warnings)."""
    # The reference module (not its DDP wrapper, which cannot survive a
    # failed step) runs the same forward, so BatchNorm statistics move alike.
    pair.reference.fail = where
    try:
        with torch.no_grad():
            pair.reference(ids)
    except InjectedFailure:
        pass
    pair.reference.fail = None
    caught = 0
    pair.model.fail = where
    try:
        pair.engine.backward(lm_loss(pair.model(ids), ids) / micro_batches)
    except InjectedFailure:
        caught = 1
    pair.model.fail = None
    if micro_batches == 1:
        return caught, []  # the next forward cleans up by itself
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        pair.engine.discard_failed_pass()  # what the next forward does first, here to catch its warning
    return caught, [str(r.message) for r in records]


def _exceptions(stage: int, where: str, micro_batches: int) -> dict:
    """Step 1's micro-batch 1 (or only batch) fails on every rank and is caught; DDP skips it."""
    pair = make_pair(stage, model_factory=FaultyTransformer)
    rank = torch.distributed.get_rank()
    errors, caught, warned = [], 0, []
    for step in range(4):
        for micro in range(micro_batches):
            ids = batch(10 * step + micro, rank)
            if step == 1 and micro == min(1, micro_batches - 1):
                failed, messages = _fail_once(pair, where, ids, micro_batches)
                caught, warned = caught + failed, warned + messages
                if messages:
                    pair.reference_optimizer.zero_grad()  # the engine said it dropped the window
                continue
            lm_loss(pair.ddp(ids), ids).div(micro_batches).backward()
            pair.engine.backward(lm_loss(pair.model(ids), ids) / micro_batches)
        reference_step(pair)
        pair.engine.step()
        errors.append(parameter_error(pair))
    pair.engine.reset_peak_live_units()
    ids = batch(99, rank)
    _, traffic = traffic_of(pair.engine, lambda: train_step(pair.engine, pair.model, ids, _lm))
    return {
        "errors": errors,
        "caught": caught,
        "warnings": warned,
        "state": pair.engine.training_state.name,
        "all_gather_bytes": traffic[CollectiveKind.ALL_GATHER.value].bytes,
        "reduce_calls": traffic[CollectiveKind.REDUCE_SCATTER.value].calls,
        "padded_numel": padded_numel(pair.engine),
        "units": len(pair.engine.unit_reports()),
        "peak_live_units": pair.engine.peak_live_units,
    }


EXCEPTION_CASES = [(stage, where, micro) for stage in STAGES for where in ("forward", "backward") for micro in (1, 3)]


def _check_exception_case(result: dict, stage: int, where: str, micro_batches: int) -> None:
    assert result["caught"] == 1
    assert max(result["errors"]) <= 1e-5, result["errors"]
    assert result["state"] == "IDLE"
    gathers = 2 if stage == 3 else 1
    assert result["all_gather_bytes"] == gathers * result["padded_numel"] * 4
    assert result["reduce_calls"] == result["units"]
    if stage == 3:
        assert result["peak_live_units"] <= 3
    dropped_window = stage == 1 and where == "backward" and micro_batches > 1
    assert bool(result["warnings"]) == dropped_window, result["warnings"]
    if dropped_window:
        assert "discarded" in result["warnings"][0]


class ReorderingTransformer(TinyTransformer):
    """Changes which blocks run, and in which order, from step to step (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__(blocks=4)
        self.plan: list[int] = [0, 1, 2, 3]

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        x = self.embed(ids)
        x = self.norm((x + 0.5 * self.frozen(x)).transpose(1, 2)).transpose(1, 2)
        for index in self.plan:
            x = self.blocks[index](x)
        return self.head(x)


ORDER_PLANS = {
    "eval-first": [[0, 1, 2, 3]] * 4,
    "layerdrop": [[0, 1, 2, 3], [0, 2, 3], [1, 2], [0, 1, 3], [0, 1, 2, 3]],
    "reorder": [[0, 1, 2, 3], [0, 2, 1, 3], [3, 2, 1, 0], [0, 1, 2, 3]],
}


def _execution_order(stage: int, scenario: str, prefetch: int) -> dict:
    pair = make_pair(stage, prefetch=prefetch, model_factory=ReorderingTransformer)
    rank = torch.distributed.get_rank()
    if scenario == "eval-first":
        for net in (pair.model, pair.ddp):
            net.eval()
            with torch.no_grad():
                net(batch(50, rank))
            net.train()
    errors, peaks = [], []
    for step, plan in enumerate(ORDER_PLANS[scenario]):
        pair.model.plan = pair.reference.plan = plan
        ids = batch(step, rank)
        lm_loss(pair.ddp(ids), ids).backward()
        reference_step(pair)
        pair.engine.reset_peak_live_units()
        pair.engine.backward(lm_loss(pair.model(ids), ids))
        pair.engine.step()
        peaks.append(pair.engine.peak_live_units)
        errors.append(parameter_error(pair))
    return {"errors": errors, "peaks": peaks, "order_changes": pair.engine.execution_order_changes}


ORDER_CASES = [(stage, scenario, 1) for stage in STAGES for scenario in ORDER_PLANS]
ORDER_CASES += [(3, scenario, 2) for scenario in ORDER_PLANS]


class PerRankHeads(TinyTransformer):
    """Two task heads (units) run on every rank; rank 0's loss uses one, rank 1's the other.
    An expert (a unit) gets no tokens on rank 1; an auxiliary head runs but no loss uses it."""

    def __init__(self) -> None:
        super().__init__(blocks=2)
        self.head_a, self.head_b, self.expert, self.aux = Block(16), Block(16), Block(16), Block(16)

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        rank = torch.distributed.get_rank()
        x = self.embed(ids)
        x = self.norm((x + 0.5 * self.frozen(x)).transpose(1, 2)).transpose(1, 2)
        routed = (ids % 2 == 0) if rank == 0 else torch.zeros_like(ids, dtype=torch.bool)
        expert_out = torch.zeros_like(x)
        expert_out[routed] = self.expert(x[routed])
        x = x + expert_out
        for block in self.blocks:
            x = block(x)
        a, b = self.head_a(x), self.head_b(x)
        self.aux(x)  # unused everywhere: like DDP, its parameters get no update (AdamW decays nothing)
        return self.head(a if rank == 0 else b)


def _data_dependent(stage: int) -> dict:
    pair = make_pair(stage, model_factory=PerRankHeads)
    rank = torch.distributed.get_rank()
    errors, reduce_calls = [], []
    for step in range(3):
        ids = batch(step, rank)
        lm_loss(pair.ddp(ids), ids).backward()
        reference_step(pair)
        _, traffic = traffic_of(pair.engine, lambda: train_step(pair.engine, pair.model, ids, _lm))
        reduce_calls.append(traffic[CollectiveKind.REDUCE_SCATTER.value].calls)
        errors.append(parameter_error(pair))
    return {"errors": errors, "reduce_calls": reduce_calls, "units": len(pair.engine.unit_reports())}


def _after_the_step(stage: int) -> dict:
    """Stages 1/2 issue the post-step all-gather and let each unit's next forward wait for it;
    whatever touches a parameter before (a read, a step with no forward, a load) waits first."""
    config = dataclasses.replace(config_for(stage), overlap_param_refresh=True)
    pair = make_pair(stage, config=config)
    rank = torch.distributed.get_rank()

    def step(index: int) -> None:
        ids = batch(index, rank)
        lm_loss(pair.ddp(ids), ids).backward()
        reference_step(pair)
        train_step(pair.engine, pair.model, ids, _lm)

    def compute_error() -> float:  # the model's own parameters, not the master shards
        ours = {name: p.detach().clone() for name, p in pair.model.named_parameters()}
        return relative_difference(ours, {name: p.detach() for name, p in pair.reference.named_parameters()})

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        # Under a torch profiler the step waits: a collective issued under it and waited for after
        # it stopped crashes the process (torch 2.13, gloo).
        step(0)
        profiled = [unit.refreshing for unit in pair.engine.unit_reports()]
    step(0)
    deferred = [unit.refreshing for unit in pair.engine.unit_reports()]
    read_error = compute_error()  # each parameter's first touch waits for its unit
    waited = [unit.refreshing for unit in pair.engine.unit_reports()]
    step(1)
    ids = batch(2, rank)
    forward_error = abs(lm_loss(pair.model(ids), ids).item() - lm_loss(pair.reference(ids), ids).item())
    after_forward = [unit.refreshing for unit in pair.engine.unit_reports()]
    pair.engine.zero_grad()
    step(3)
    pair.engine.step()  # no forward since the last step: its all-gathers are waited for first
    double_step_error = compute_error()
    step(4)
    loaded = {name: torch.full_like(p, 0.5) for name, p in pair.reference.state_dict().items()}
    pair.engine.load_full_state_dict(loaded)  # over all-gathers still in flight
    pair.reference.load_state_dict(loaded)
    load_error = max((p.detach() - 0.5).abs().max().item() for p in pair.model.parameters())
    step(5)
    copied = copy.deepcopy(pair.model.blocks[0])  # a deep copy waits too, and is an ordinary module
    copy_error = relative_difference(copied.state_dict(), pair.reference.blocks[0].state_dict())
    ids = batch(6, rank)
    pair.engine.backward(lm_loss(pair.model(ids), ids))
    weight = pair.model.blocks[0].mix.weight
    weight.data = torch.zeros_like(weight)  # replaced before the step: found at the next forward, all-gather or not
    pair.engine.step()
    swapped = refusal(lambda: pair.model(batch(7, rank)), ModelChangedError)
    return {
        "copy": copy_error,
        "swapped": swapped,
        "deferred": deferred,
        "profiled": profiled,
        "read": read_error,
        "waited": waited,
        "forward": forward_error,
        "after forward": after_forward,
        "double step": double_step_error,
        "load": load_error,
    }


def _grid(rank: int, world_size: int) -> dict:
    return {
        "exceptions": [_exceptions(*case) for case in EXCEPTION_CASES],
        "order": [_execution_order(*case) for case in ORDER_CASES],
        "data": [_data_dependent(stage) for stage in STAGES],
        "after the step": [_after_the_step(stage) for stage in (1, 2)],
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_grid, 2)


@pytest.mark.parametrize(
    "index", range(len(EXCEPTION_CASES)), ids=[f"stage{s}-{w}-micro{m}" for s, w, m in EXCEPTION_CASES]
)
def test_exception_caught_on_every_rank_skips_the_batch(results: list[dict], index: int) -> None:
    for per_rank in results:
        _check_exception_case(per_rank["exceptions"][index], *EXCEPTION_CASES[index])


@pytest.mark.parametrize("index", range(len(ORDER_CASES)), ids=[f"stage{s}-{n}-prefetch{p}" for s, n, p in ORDER_CASES])
def test_changing_execution_order_stays_exact_and_bounded(results: list[dict], index: int) -> None:
    stage, scenario, prefetch = ORDER_CASES[index]
    for per_rank in results:
        result = per_rank["order"][index]
        assert max(result["errors"]) <= 1e-5, result["errors"]
        if stage == 3:
            # Root + the running block + the prefetched ones, whatever the order did.
            assert max(result["peaks"]) <= 2 + prefetch, result["peaks"]
            if scenario != "eval-first":
                assert result["order_changes"] > 0


@pytest.mark.parametrize("stage", STAGES)
def test_collectives_do_not_depend_on_which_units_got_gradients(results: list[dict], stage: int) -> None:
    for per_rank in results:
        result = per_rank["data"][STAGES.index(stage)]
        assert max(result["errors"]) <= 1e-5, result["errors"]
        assert result["reduce_calls"] == [result["units"]] * 3


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_after_the_step_wait_for_their_all_gather_when_touched(results: list[dict], stage: int) -> None:
    for per_rank in results:
        result = per_rank["after the step"][stage - 1]
        assert all(result["deferred"]), result  # the step returned before its all-gathers finished
        assert not any(result["profiled"]), result  # except under a profiler
        assert result["read"] <= 1e-6 and not any(result["waited"]), result
        assert result["forward"] <= 1e-5 and not any(result["after forward"]), result
        assert result["double step"] <= 1e-6 and result["load"] == 0.0, result
        assert result["copy"] <= 1e-6, result
        assert result["swapped"] is not None and "was replaced after sharding" in result["swapped"], result
