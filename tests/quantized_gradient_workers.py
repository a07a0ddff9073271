"""What the qgZ collective tests run on each rank: quantized reductions beside the exact sums.

Four ranks, three layouts: one shard group (one hop), one shard group in secondary groups of 2 (two hops,
"two nodes of two"), and hybrid sharding in groups of 2 (one hop inside, the quantized all-reduce across).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero_core.collectives import CommContext, Span, all_reduce_quantized, reduce_scatter_quantized

PIECE, BLOCK = 1024, 64  # elements per rank's shard, elements per quantization block


def _comm(layout: str) -> CommContext:
    comm = CommContext.create(None, torch.device("cpu"))
    if layout == "hybrid":
        comm.split(2)
    if layout == "two_hops":
        comm.split_secondary(2)
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
    return results


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
