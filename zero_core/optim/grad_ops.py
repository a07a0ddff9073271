"""Operations on the sharded gradients that need every rank: norms, clipping,
overflow checks, and the agreement on which parameters have gradients.

Each works on this rank's ``sharded_grads`` and combines across ranks with
one small all-reduce, giving exactly what the same operation on the full,
unsharded gradients would. Norms combine inside the shard group (under
hybrid sharding the other groups hold the same shards); agreements span
every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives import CommContext, Span
from ..unit import FlatUnit

# Parameters picked out of the model, as (unit index, slot index): a subset to clip.
Selection = frozenset[tuple[int, int]]


def _shards(units: list[FlatUnit], selected: Selection | None = None) -> list[torch.Tensor]:
    """This rank's gradient shards, or (``selected``) the slices of them that hold the selected parameters."""
    if selected is None:
        return [u.grads.sharded_grads for u in units if u.grads.sharded_grads is not None]
    return [
        unit.grads.sharded_grads[master.piece.shard_start : master.piece.shard_start + master.piece.numel]
        for unit in units
        if unit.grads.sharded_grads is not None
        for master in unit.master_pieces
        if (unit.index, master.piece.slot.index) in selected
    ]


def _norm_terms(units: list[FlatUnit], comm: CommContext, selected: Selection | None) -> list[torch.Tensor]:
    """What this rank adds to a norm over the model. Tensor parallelism: every tensor-parallel rank adds
    its pieces of parameters spread over them (Shard), but only the first adds those every one holds
    alike (Replicate, plain), so each value counts once when the sums meet."""
    if comm.tensor_parallel_size == 1 or comm.tensor_parallel_rank == 0:
        return _shards(units, selected)
    spread = frozenset(
        (unit.index, slot.index) for unit in units for slot in unit.layout.slots if slot.spread_over_ranks
    )
    return _shards(units, spread if selected is None else spread & selected)


def _sum_over_model(comm: CommContext, local: torch.Tensor, op: dist.ReduceOp.RedOpType, label: str) -> None:
    """Combine per-rank partial norms: inside the shard group (other groups hold the same shards), then
    over the tensor-parallel ranks (each holds other pieces of the layers)."""
    collectives.all_reduce(comm, local, op, label=label, span=Span.SHARD_GROUP).wait()
    if comm.tensor_parallel_size > 1:
        collectives.all_reduce(comm, local, op, label=label, span=Span.TENSOR_PARALLEL).wait()


def scale_grads(units: list[FlatUnit], factor: float) -> None:
    for shard in _shards(units):
        shard.mul_(factor)


def clip_grad_norm(
    units: list[FlatUnit], comm: CommContext, max_norm: float, norm_type: float, selected: Selection | None = None
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the full model (or the ``selected`` parameters), from the shards."""
    shards = _shards(units, selected)
    local = torch.zeros(1, dtype=torch.float32, device=comm.device)
    if norm_type == float("inf"):
        for shard in shards:
            local = torch.maximum(local, shard.detach().abs().max().float().reshape(1))
        _sum_over_model(comm, local, dist.ReduceOp.MAX, "gradient norm")
        total_norm = local[0]
    else:
        for shard in _norm_terms(units, comm, selected):
            local += shard.detach().float().abs().pow(norm_type).sum()
        _sum_over_model(comm, local, dist.ReduceOp.SUM, "gradient norm")
        total_norm = local[0].pow(1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for shard in shards:
        shard.mul_(clip_coef.to(shard.dtype))
    return total_norm


def grad_norms(units: list[FlatUnit], comm: CommContext, norm_type: float, factor: float) -> dict[str, torch.Tensor]:
    """Each trainable parameter's gradient norm over the full model (times ``factor``),
    keyed by its canonical name; parameters no rank has a gradient for are left
    out, as Lightning's ``grad_norm`` leaves out ``grad is None``. Per-parameter
    partial sums of this rank's pieces and has-gradient flags, one all-reduce (two under
    hybrid sharding, and one more over the tensor-parallel ranks of a 2-D mesh).
    Reads the shards only."""
    slots = [
        (unit, slot) for unit in units for slot, param in zip(unit.layout.slots, unit.params) if param.requires_grad
    ]
    position = {(unit.index, slot.index): i for i, (unit, slot) in enumerate(slots)}
    count = len(slots)
    partial = torch.zeros(2 * count, dtype=torch.float32, device=comm.device)  # [partial norms | has-gradient flags]
    # Tensor parallelism: values every tensor-parallel rank holds alike are summed on the first one only
    # (a maximum may take them twice).
    counts_replicated = comm.tensor_parallel_rank == 0 or norm_type == float("inf")
    for unit in units:
        if unit.grads.sharded_grads is None:
            continue
        for master in unit.master_pieces:
            i = position.get((unit.index, master.piece.slot.index))
            if i is None:
                continue  # frozen now
            if not (counts_replicated or master.piece.slot.spread_over_ranks):
                continue  # the first tensor-parallel rank holds the same values: counted there
            piece = master.piece
            values = (
                unit.grads.sharded_grads[piece.shard_start : piece.shard_start + piece.numel].detach().float().abs()
            )
            partial[i] = values.max() if norm_type == float("inf") else values.pow(norm_type).sum()
        for slot in unit.layout.slots:
            if (unit.index, slot.index) in position and unit.grads.slot_has_grad[slot.index]:
                partial[count + position[(unit.index, slot.index)]] = 1.0
    # Both halves combine under MAX for the inf-norm and under SUM otherwise (flags only test > 0).
    # The norms combine inside the shard group (other groups hold the same shards); whether a
    # gradient exists, over every rank: under hybrid sharding a parameter one group never used
    # still has another group's gradient in its shard.
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    if comm.replicas == 1:
        collectives.all_reduce(comm, partial, op, label="gradient norms", span=Span.SHARD_GROUP).wait()
    else:
        collectives.all_reduce(comm, partial[:count], op, label="gradient norms", span=Span.SHARD_GROUP).wait()
        collectives.all_reduce(comm, partial[count:], dist.ReduceOp.MAX, label="gradient norms").wait()
    if comm.tensor_parallel_size > 1:
        collectives.all_reduce(comm, partial, op, label="gradient norms", span=Span.TENSOR_PARALLEL).wait()
    norms = partial[:count] if norm_type == float("inf") else partial[:count].pow(1.0 / norm_type)
    return {slot.fqns[0]: norms[i] * factor for i, (_, slot) in enumerate(slots) if partial[count + i] > 0}


def total_norm(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of parameters whose own norms are ``norms`` (0 for none), as
    ``grad_norms`` reports the total: a subset of them totals the same way (Lightning's grad_norm)."""
    if not norms:
        return torch.zeros(())
    values = torch.stack(norms)
    return values.max() if norm_type == float("inf") else values.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grad_value(units: list[FlatUnit], clip_value: float, selected: Selection | None = None) -> None:
    """Elementwise, so clipping each shard is clipping the whole (or the ``selected`` parameters' slices)."""
    for shard in _shards(units, selected):
        shard.clamp_(-clip_value, clip_value)
