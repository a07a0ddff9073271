"""Hybrid sharding at 4 ranks, 2 shard groups of 2 (``ZeroConfig(shard_group_size=2)``).

Every stage trains like DDP; model states per rank follow the formulas with
the group size in place of the world size; and the collectives really sent
to the backend, counted by wrapping ``torch.distributed`` (not from our own
statistics), stay inside the group except the gradient shards' all-reduce
across groups and the small agreements. One spawn runs the whole grid.
Checkpoints saved under hybrid sharding and loaded flat (and back) are in
``test_checkpoint_roundtrip.py``; the two-node launch in ``test_multinode.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer
from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import (
    GptRun,
    SentCollectives,
    config_for,
    rank0_state_dict,
    refusal,
    relative_difference,
    train_against_ddp,
)
from zero_core import MixedPrecision, ZeroConfig, ZeroEngine, expected_model_state_bytes

WORLD, GROUP = 4, 2
TOLERANCE = 1e-5
PARITY = [dict(stage=s, optimizer_name="adamw") for s in (1, 2, 3)]
PARITY += [dict(stage=s, optimizer_name="sgd", micro_batches=3, clip=0.05) for s in (1, 2, 3)]
# Stage 1 reduces twice before one step: the second reduce must not count the first twice.
PARITY += [dict(stage=1, optimizer_name="sgd", micro_batches=2, sync_every_micro_batch=True)]
ADAM_STATE_BYTES = 8


def _parity(rank: int, world_size: int) -> list[dict[str, Any]]:
    cases = [train_against_ddp(**case, shard_group_size=GROUP) for case in PARITY]
    cases.append(train_against_ddp(stage=3, optimizer_name="adamw", shard_group_size=1))  # pure replication
    # With the blocks kept gathered (persistence_threshold) and only the root unit sharded.
    cases.append(train_against_ddp(stage=3, optimizer_name="adamw", shard_group_size=GROUP, persistence_threshold=1500))
    return cases


class SentInGroups(SentCollectives):
    """By link class: inside a shard group, across groups, or every rank."""

    spans = ("SHARD_GROUP", "ACROSS_GROUPS", "WORLD")

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size

    def span(self, group: Any) -> str:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if len(ranks) == dist.get_world_size():
            return "WORLD"
        return "SHARD_GROUP" if len({r // self.group_size for r in ranks}) == 1 else "ACROSS_GROUPS"


def _accounting(rank: int, world_size: int) -> list[dict[str, Any]]:
    """One measured step per stage: bytes sent per link class, and model-state bytes held."""
    results = []
    for stage in (1, 2, 3):
        run = GptRun(stage, shard_group_size=GROUP)
        run.train_step(0)
        with SentInGroups(GROUP) as sent:
            run.train_step(1)
        run.backward(2)
        result = {
            "sent": sent.bytes,
            "reported": {span: count.bytes for span, count in run.engine.last_step_traffic_by_span.items()},
            "report": run.engine.memory_report(),
            **run.sizes(),
            "shard_group_size": run.engine.shard_group_size,
        }
        run.engine.zero_grad()
        # Three micro-batches under no_sync, then a synchronising one: the groups still exchange
        # the gradient shards once per step (stages 2/3 reduce inside the group every micro-batch).
        with SentInGroups(GROUP) as accumulated:
            for micro in range(3):
                with run.engine.no_sync():
                    run.backward(3 + micro)
            run.train_step(6)
        result["accumulated_sent"] = accumulated.bytes
        results.append(result)
        run.engine.unshard()
    return results


def _used_by_one_group(rank: int, world_size: int) -> dict[str, Any]:
    """The branch runs on the second group's ranks only: DDP's unused-parameter rule must still
    hold everywhere (the first group steps it with the second group's gradient)."""
    torch.manual_seed(0)
    reference = TinyTransformer()
    model = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    reference_optimizer = make_optimizer("adamw", reference)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(2, shard_group_size=GROUP))
    use_branch = rank >= GROUP
    ids = batch(0, rank)
    lm_loss(ddp(ids, use_branch=use_branch), ids).backward()
    engine.backward(lm_loss(model(ids, use_branch=use_branch), ids))
    reference_norms = {name: p.grad.norm() for name, p in reference.named_parameters() if p.grad is not None}
    norms = {k.removeprefix("grad_2.0_norm/"): v for k, v in engine.grad_norms().items() if "/" in k}
    reference_optimizer.step()
    engine.step()
    return {
        "norms": norms,
        "reference_norms": reference_norms,
        "error": relative_difference(engine.full_state_dict(), rank0_state_dict(reference)),
    }


def _refusals(rank: int, world_size: int) -> dict[str, Any]:
    def build(group: int | None) -> None:
        model = TinyTransformer()
        ZeroEngine(model, make_optimizer("sgd", model), config_for(3, shard_group_size=group))

    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 shard over it

    def build_on_pair() -> None:
        model = TinyTransformer()
        ZeroEngine(model, make_optimizer("sgd", model), config_for(3, shard_group_size=1), process_group=pair)

    return {
        "subgroup": refusal(build_on_pair, ValueError) if rank < 2 else "not built",
        "not_dividing": refusal(lambda: build(3), ValueError),
        "ranks_disagree": refusal(lambda: build(GROUP if rank < 2 else None), ValueError),
        "config": refusal(lambda: ZeroConfig(shard_group_size=0), ValueError),
    }


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    workers = {"parity": _parity, "accounting": _accounting, "one_group": _used_by_one_group, "refusals": _refusals}
    return run_distributed(run_each, WORLD, workers, timeout=600)


@pytest.mark.parametrize(
    "index",
    range(len(PARITY) + 2),
    ids=["-".join(f"{k}={v}" for k, v in case.items()) for case in PARITY]
    + ["stage=3-shard_group_size=1", "stage=3-persistent-blocks"],
)
def test_hybrid_sharding_trains_like_ddp(grid: list, index: int) -> None:
    for rank, results in enumerate(by_rank(grid, "parity")):
        result = results[index]
        assert len(result["param_errors"]) == 5
        for step, error in enumerate(result["param_errors"]):
            assert error <= TOLERANCE, f"rank {rank} step {step}: parameters differ from DDP by {error:.2e}"
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE)
        for ours, reference in result["norms"]:
            assert ours == pytest.approx(reference, rel=TOLERANCE)
    losses = by_rank(grid, "parity")[0][0]["losses"]
    assert len({round(x, 6) for x in losses}) > 1  # training moved


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_bytes_per_link_class_match_the_formulas(grid: list, stage: int) -> None:
    """Inside a group: RS Ψ + AG Ψ (stage 3: + AG Ψ); across groups: the gradient shard (Ψ/k);
    every rank: the step agreement and the buffers only. What was sent equals what is reported."""
    for rank, results in enumerate(by_rank(grid, "accounting")):
        result = results[stage - 1]
        padded = result["padded_numel"]  # of the group's layout: padding below GROUP per unit
        assert result["shard_group_size"] == GROUP
        assert padded - result["numel"] < GROUP * result["units"]
        sent, reported = result["sent"], result["reported"]
        gathers = 2 if stage == 3 else 1
        assert sent["SHARD_GROUP"] == (gathers + 1) * padded * 4
        assert sent["ACROSS_GROUPS"] == padded // GROUP * 4
        assert 0 < sent["WORLD"] < 0.01 * sent["SHARD_GROUP"], "only agreements and buffers cross every link"
        assert reported.pop("TENSOR_PARALLEL") == 0, "no tensor-parallel ranks on a 1-D layout"
        assert reported.pop("SECONDARY") == 0, "no secondary shards (hpZ) unless asked for"
        assert reported.pop("ACROSS_SECONDARY") == 0, "no two-hop gradient reduce (qgZ) unless asked for"
        assert sent == reported, f"rank {rank}: the traffic report differs from what was sent"
        accumulated = result["accumulated_sent"]
        assert accumulated["ACROSS_GROUPS"] == padded // GROUP * 4, "gradient shards cross groups once per step"
        reduces = 1 if stage == 1 else 4  # stage 1 skips communication under no_sync
        gathers = 4 * 2 if stage == 3 else 1  # stage 3: forward and backward of each micro-batch; else after the step
        assert accumulated["SHARD_GROUP"] == (reduces + gathers) * padded * 4


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_model_state_bytes_follow_the_formula_with_the_group_size(grid: list, stage: int) -> None:
    for rank, results in enumerate(by_rank(grid, "accounting")):
        result = results[stage - 1]
        expected = expected_model_state_bytes(stage, result["numel"], GROUP, MixedPrecision(), ADAM_STATE_BYTES)
        flat = expected_model_state_bytes(stage, result["numel"], WORLD, MixedPrecision(), ADAM_STATE_BYTES)
        slack = 4 * 4 * GROUP * result["units"] + 8 * result["param_tensors"]
        actual = result["report"]
        for field in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
            got, want = getattr(actual, field), getattr(expected, field)
            assert abs(got - want) <= slack, f"rank {rank} {field}: measured {got}, formula {want}"
        assert actual.optimizer_state_bytes > flat.optimizer_state_bytes + slack  # really k, not N


def test_a_parameter_one_group_never_used_trains_like_ddp(grid: list) -> None:
    results = by_rank(grid, "one_group")
    for rank, result in enumerate(results):
        assert result["error"] <= TOLERANCE
        assert result["norms"].keys() == result["reference_norms"].keys(), f"rank {rank}"
        assert "branch.weight" in result["norms"]
        for name, value in result["reference_norms"].items():
            assert float(result["norms"][name]) == pytest.approx(float(value), rel=TOLERANCE), name


def test_bad_shard_group_sizes_are_refused_alike_on_every_rank(grid: list) -> None:
    results = by_rank(grid, "refusals")
    for key in ("not_dividing", "ranks_disagree"):
        messages = {result[key] for result in results}
        assert len(messages) == 1 and None not in messages, f"{key}: {messages}"
    assert "shard_group_size=3 must divide the number of ranks (4)" in results[0]["not_dividing"]
    assert "config.shard_group_size" in results[0]["ranks_disagree"]
    assert "shard_group_size=0 is invalid" in results[0]["config"]
    assert results[0]["subgroup"] == results[1]["subgroup"] and "without process_group=" in results[0]["subgroup"]
