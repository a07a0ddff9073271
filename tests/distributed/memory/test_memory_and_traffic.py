"""Measured per-rank bytes of model state and bytes moved per step follow
the formulas of docs/memory.md (padding aside), for every stage, in fp32 and bf16."""

from __future__ import annotations

import time

import pytest
import torch

from tests.rank_pool import by_rank, run_distributed, run_each
from tests.workers import accounting_grid
from zero_core import MixedPrecision, expected_model_state_bytes

CASES = [(stage, dtype) for stage in (1, 2, 3) for dtype in (torch.float32, torch.bfloat16)]
ADAM_STATE_BYTES = 8  # exp_avg and exp_avg_sq in fp32


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def grid(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    """One spawn per world size for every test of the file."""
    workers = {"accounting": accounting_grid, "buffers": _buffer_broadcasts, "reduce_scatter": _reduce_scatter_forms}
    return request.param, run_distributed(run_each, request.param, workers)


@pytest.fixture
def measured(grid: tuple[int, list[dict]]) -> tuple[int, list[list[dict]]]:
    world_size, per_rank = grid
    return world_size, by_rank(per_rank, "accounting")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{s}-{d}" for s, d in CASES])
def test_model_state_bytes_match_formula(measured: tuple[int, list], index: int) -> None:
    world_size, per_rank = measured
    stage, dtype = CASES[index]
    for rank, results in enumerate(per_rank):
        result = results[index]
        expected = expected_model_state_bytes(
            stage, result["numel"], world_size, MixedPrecision(compute_dtype=dtype), ADAM_STATE_BYTES
        )
        # Padding: under world_size elements per unit in every flat buffer;
        # Adam also keeps a scalar step per parameter tensor.
        slack = 4 * 4 * world_size * result["units"] + 8 * result["param_tensors"]
        actual = result["report"]
        for field in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
            got, want = getattr(actual, field), getattr(expected, field)
            assert abs(got - want) <= slack, f"rank {rank} {field}: measured {got}, formula {want}"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{s}-{d}" for s, d in CASES])
def test_bytes_moved_per_step_match_formula(measured: tuple[int, list], index: int) -> None:
    """Stages 1/2: RS Ψ + AG Ψ; stage 3: AG Ψ (forward) + AG Ψ (backward) + RS Ψ."""
    world_size, per_rank = measured
    stage, dtype = CASES[index]
    for results in per_rank:
        result = results[index]
        padded = result["padded_numel"]
        gathers = 2 if stage == 3 else 1
        assert result["all_gather_bytes"] == gathers * padded * _element_size(dtype)
        assert result["reduce_scatter_bytes"] == padded * 4  # fp32 reduction by default
        assert padded - result["numel"] < world_size * result["units"]


def test_stage3_holds_no_full_parameter_at_rest(measured: tuple[int, list]) -> None:
    _, per_rank = measured
    for results in per_rank:
        for (stage, _), result in zip(CASES, results):
            if stage == 3:
                assert result["params_bytes_at_rest"] == 0
            else:
                assert result["params_bytes_at_rest"] > 0


def test_sharding_saves_memory_against_ddp(measured: tuple[int, list]) -> None:
    world_size, per_rank = measured
    for (stage, dtype), result in zip(CASES, per_rank[0]):
        ddp = expected_model_state_bytes(0, result["numel"], world_size, MixedPrecision(compute_dtype=dtype), 8)
        assert result["report"].model_state_bytes < ddp.model_state_bytes


def _buffer_broadcasts(rank: int, world_size: int) -> dict[str, object]:
    """A BatchNorm model: rank 0's buffers reach every rank before each training forward,
    in one broadcast per buffer dtype, not one per buffer."""
    from torch import nn

    from zero_core import ZeroConfig, ZeroEngine

    torch.manual_seed(rank)  # different statistics per rank until broadcast
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(5)])
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    seen: list[list[torch.Tensor]] = []
    model[0].register_forward_pre_hook(lambda *_: seen.append([b.clone() for b in model.buffers()]))
    for step in range(2):
        engine.backward(model(torch.randn(3, 4) + rank + step).sum())
        engine.step()
    traffic = engine.last_step_traffic["broadcast"]
    return {"calls": traffic.calls, "numel": traffic.numel, "buffers": len(list(model.buffers())), "seen": seen[-1]}


def test_buffers_are_broadcast_in_one_call_per_dtype(grid: tuple[int, list[dict]]) -> None:
    results = by_rank(grid[1], "buffers")
    for result in results:
        assert result["buffers"] == 15 and result["calls"] == 2  # float32 statistics, int64 batch counts
        assert result["numel"] == 5 * (4 + 4 + 1)
    for other in results[1:]:  # rank 0's, everywhere
        assert all(torch.equal(a, b) for a, b in zip(results[0]["seen"], other["seen"]))


def _reduce_scatter_forms(rank: int, world_size: int) -> dict[str, object]:
    """The engine's exact reduce-scatter into a shard of its own, as stages 2 and 3 call it, and the form it
    keeps when its handle is polled (offload_step_in_backward): what each hands to torch.distributed, and
    what each leaves in the shard."""
    import torch.distributed as dist

    from tests.zero_plus_plus_workers import SentPayloads
    from zero_core.collectives import CommContext, reduce_scatter

    comm = CommContext.create(None, torch.device("cpu"))
    results: dict[str, object] = {}
    for dtype in (torch.float32, torch.bfloat16):
        generator = torch.Generator().manual_seed(rank)
        # Magnitudes far apart, so that a sum of three terms depends on its order and rounding shows.
        full = (torch.randn(world_size * 1000, generator=generator) * 10.0 ** (3 * rank)).to(dtype)
        every = [torch.empty_like(full) for _ in range(world_size)]
        dist.all_gather(every, full)
        for polled in (False, True):
            shard = torch.empty(1000, dtype=dtype)
            with SentPayloads() as sent:  # every call handed to torch.distributed, with the bytes it sends
                handle = reduce_scatter(comm, shard, full.clone(), polled=polled)
            deadline = time.monotonic() + 30
            answered = handle.is_completed()
            while polled and not answered and time.monotonic() < deadline:
                time.sleep(0.01)
                answered = handle.is_completed()
            handle.wait()
            results[f"{dtype} polled={polled}"] = {"calls": sent.calls, "answered": answered, "shard": shard}
        own = [piece.chunk(world_size)[rank] for piece in every]
        results[f"{dtype} terms"] = own
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_ranks_reduce_scatter_by_one_exchange_with_the_reduces_numbers(
    grid: tuple[int, list[dict]], dtype: torch.dtype
) -> None:
    """Over two ranks a reduce-scatter into its own shard is one exchange: each rank sends its peer the
    peer's slice (S / 2 bytes, what a reduce-scatter must send) and calls no reduce, and the shard holds
    the reduces' sum bit for bit. Over three ranks, and whenever the handle is polled (which gloo's
    point-to-point works cannot answer before their wait), it is one reduce per slice, and a polled handle
    says it has landed without being waited for."""
    world_size, per_rank = grid
    element = _element_size(dtype)
    for rank, result in enumerate(by_rank(per_rank, "reduce_scatter")):
        exchanged, reduced = result[f"{dtype} polled=False"], result[f"{dtype} polled=True"]
        assert reduced["calls"] == [("reduce", 1000 * element)] * world_size
        assert reduced["answered"]
        assert torch.equal(exchanged["shard"], reduced["shard"]), rank
        terms = result[f"{dtype} terms"]
        if world_size == 2:
            assert exchanged["calls"] == [("batch_isend_irecv", 1000 * element)]
            assert torch.equal(exchanged["shard"], terms[0] + terms[1])
        else:
            assert exchanged["calls"] == reduced["calls"]
