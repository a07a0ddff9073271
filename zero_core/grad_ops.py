"""Operations on the sharded gradients that need every rank: norms, clipping,
overflow checks, and the agreement on which parameters have gradients.

Each works on this rank's ``sharded_grads`` and combines across ranks with
one small all-reduce, giving exactly what the same operation on the full,
unsharded gradients would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives
from .collectives import CommContext
from .flat_unit import FlatUnit


def _shards(units: list[FlatUnit]) -> list[torch.Tensor]:
    return [u.sharded_grads for u in units if u.sharded_grads is not None]


def scale_grads(units: list[FlatUnit], factor: float) -> None:
    for shard in _shards(units):
        shard.mul_(factor)


def clip_grad_norm(units: list[FlatUnit], comm: CommContext, max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the full model, from the shards."""
    shards = _shards(units)
    local = torch.zeros(1, dtype=torch.float32, device=comm.device)
    if norm_type == float("inf"):
        for shard in shards:
            local = torch.maximum(local, shard.detach().abs().max().float().reshape(1))
        collectives.all_reduce(comm, local, dist.ReduceOp.MAX).wait()
        total_norm = local[0]
    else:
        for shard in shards:
            local += shard.detach().float().abs().pow(norm_type).sum()
        collectives.all_reduce(comm, local).wait()
        total_norm = local[0].pow(1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for shard in shards:
        shard.mul_(clip_coef.to(shard.dtype))
    return total_norm


def clip_grad_value(units: list[FlatUnit], clip_value: float) -> None:
    """Elementwise, so clipping each shard is clipping the whole."""
    for shard in _shards(units):
        shard.clamp_(-clip_value, clip_value)


def any_nonfinite(units: list[FlatUnit], comm: CommContext) -> bool:
    local = any(not torch.isfinite(shard).all() for shard in _shards(units))
    return collectives.agree_on_flag(comm, local)


def agreed_slot_flags(units: list[FlatUnit], comm: CommContext) -> list[list[bool]]:
    """A parameter has a gradient if any rank produced one (DDP's unused-parameter rule)."""
    flags = [flag for u in units for flag in u.slot_has_grad]
    tensor = torch.tensor(flags, dtype=torch.float32, device=comm.device)
    collectives.all_reduce(comm, tensor, dist.ReduceOp.MAX).wait()
    agreed, offset = [], 0
    for unit in units:
        count = len(unit.slot_has_grad)
        agreed.append([bool(x) for x in tensor[offset : offset + count].tolist()])
        offset += count
    return agreed
