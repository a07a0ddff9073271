"""What the qgZ collective tests run on each rank: quantized reductions beside the exact sums.

Four ranks, three layouts: one shard group (one hop), one shard group in secondary groups of 2 (two hops,
"two nodes of two"), and hybrid sharding in groups of 2 (one hop inside, the quantized all-reduce across).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zero_core import quantization
from zero_core.collectives import (
    CommContext,
    Span,
    all_gather_quantized,
    all_reduce_quantized,
    all_reduce_working_bytes,
    gather_working_bytes,
    reduce_scatter_quantized,
    reduce_working_bytes,
)

from .allocations import peak_allocated_bytes

PIECE, BLOCK = 1024, 64  # elements per rank's shard, elements per quantization block


def _comm(layout: str) -> CommContext:
    comm = CommContext.create(None, torch.device("cpu"))
    if layout == "hybrid":
        comm = comm.in_shard_groups(2)
    if layout == "two_hops":
        comm = comm.with_secondary_groups(2)
    return comm


def _everyone(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return gathered


def _constant_blocks(rank: int, numel: int) -> torch.Tensor:
    """Every block one small integer (different per rank and block): quantized exactly at every hop, as
    their sums are constant blocks too, and summed exactly in fp32."""
    per_block = (torch.arange(numel // BLOCK) * 7 + rank * 3) % 11 - 5
    return per_block.float().repeat_interleave(BLOCK)


def _reduced(comm: CommContext, full: torch.Tensor, bits: int) -> torch.Tensor:
    shard = torch.empty(PIECE)
    reduce_scatter_quantized(comm, shard, full.clone(), block_size=BLOCK, bits=bits).wait()
    return shard


def _exact_shard(comm: CommContext, full: torch.Tensor) -> torch.Tensor:
    """The exact sum over this rank's shard group, this rank's slice."""
    group_first = comm.rank - comm.shard_rank
    inputs = _everyone(full)[group_first : group_first + comm.shard_size]
    total = torch.stack(inputs).double().sum(dim=0)
    return total[comm.shard_rank * PIECE : (comm.shard_rank + 1) * PIECE].float()


def reductions(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for layout in ("flat", "two_hops", "hybrid"):
        comm = _comm(layout)
        numel = PIECE * comm.shard_size
        for bits in (4, 8):
            routed = _constant_blocks(rank, numel)
            results[f"{layout}-{bits}-routed"] = torch.equal(_reduced(comm, routed, bits), _exact_shard(comm, routed))
            torch.manual_seed(rank * 100 + bits)
            full = torch.randn(numel) * torch.logspace(-3, 1, numel)  # blocks of different magnitudes
            comm.stats.reset()
            error = (_reduced(comm, full, bits) - _exact_shard(comm, full)).abs()
            results[f"{layout}-{bits}-error"] = error
            results[f"{layout}-{bits}-inputs"] = full
            results[f"{layout}-{bits}-spans"] = {name: c.bytes for name, c in comm.stats.span_snapshot().items()}
        if layout == "hybrid":
            results.update(_across_groups(comm, rank))
        results[f"{layout}-working"] = _working_memory(comm, layout)
    return results


# Elements per quantization pass while the working memory is measured: a piece of 3000 elements goes in passes
# of several rows, one of 20000 in runs of one row's blocks.
SMALL_PASS = 16384


def _working_memory(comm: CommContext, layout: str) -> dict[str, tuple[int, int]]:
    """Each quantized collective's peak allocation (the profiler's count) beside the formula the estimate uses."""
    measured: dict[str, tuple[int, int]] = {}
    secondary = comm.secondary_size if layout == "two_hops" else None
    default, quantization.BATCH_ELEMENTS = quantization.BATCH_ELEMENTS, SMALL_PASS
    try:
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            for piece in (3000, 20000):
                for bits in (4, 8):
                    shard, full = torch.randn(piece).bfloat16(), torch.randn(piece * comm.shard_size)
                    out = torch.empty(piece * comm.shard_size, dtype=torch.bfloat16)
                    call = lambda: all_gather_quantized(comm, out, shard, block_size=BLOCK, bits=bits).wait()  # noqa: E731
                    formula = gather_working_bytes(piece, comm.shard_size, BLOCK, bits, out.element_size())
                    measured[f"gather-{piece}-{bits}"] = (peak_allocated_bytes(call, trace), formula)
                    into = torch.empty(piece)
                    call = lambda: reduce_scatter_quantized(comm, into, full, block_size=BLOCK, bits=bits).wait()  # noqa: E731
                    formula = reduce_working_bytes(piece, comm.shard_size, secondary, BLOCK, bits, into.element_size())
                    measured[f"reduce-{piece}-{bits}"] = (peak_allocated_bytes(call, trace), formula)
                    if layout == "hybrid":
                        call = lambda: all_reduce_quantized(comm, into, "gradients", block_size=BLOCK, bits=bits).wait()  # noqa: E731
                        formula = all_reduce_working_bytes(piece, comm.replicas, BLOCK, bits, into.element_size())
                        measured[f"all_reduce-{piece}-{bits}"] = (peak_allocated_bytes(call, trace), formula)
    finally:
        quantization.BATCH_ELEMENTS = default
    return measured


def _across_groups(comm: CommContext, rank: int) -> dict[str, Any]:
    """The quantized all-reduce between the two shard groups: every replica holds the same result."""
    numel = PIECE + 3  # not a multiple of the replicas: the last piece is padded
    torch.manual_seed(rank)
    shard = torch.randn(numel)
    exact = torch.stack(_everyone(shard)[comm.shard_rank :: comm.shard_size]).double().sum(dim=0).float()
    comm.stats.reset()
    all_reduce_quantized(comm, shard, "gradients", Span.ACROSS_GROUPS, block_size=BLOCK, bits=8).wait()
    replicas = _everyone(shard)[comm.shard_rank :: comm.shard_size]
    return {
        "across-equal": all(torch.equal(replica, shard) for replica in replicas),
        "across-error": (shard - exact).abs().max().item(),
        "across-amax": exact.abs().max().item(),
        "across-spans": {name: c.bytes for name, c in comm.stats.span_snapshot().items()},
    }
