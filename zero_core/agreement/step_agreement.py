"""The agreement before each optimizer step: which parameters have gradients anywhere, whether any
rank overflowed, and whether every rank did the same work since the last step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives import CommContext
from ..unit import FlatUnit
from .flags import differing_values, with_negations


class StepAgreement(NamedTuple):
    found_inf: bool  # some rank has a non-finite gradient: every rank skips the step
    slot_flags: list[list[bool]]  # per unit, per parameter: did any rank produce a gradient
    checks_differ: bool  # some value of ``checks`` differs between ranks (the caller explains it)
    everywhere: list[bool]  # per flag of ``everywhere``: true on every rank


def agree_on_step(
    units: list[FlatUnit],
    comm: CommContext,
    counters: dict[str, int],
    check_finite: bool,
    checks: dict[str, int] | None = None,
    everywhere: Sequence[bool] = (),
) -> StepAgreement:
    """What every rank needs to agree on before the optimizer step, in one all-reduce.

    A parameter has a gradient if any rank produced one (DDP's
    unused-parameter rule); an overflow anywhere skips the step everywhere.
    ``counters`` (forwards, backwards, steps so far) ride along as +x and -x
    under MAX, giving the highest and lowest over ranks: ranks that ran
    different numbers of them are named here instead of mixing collectives
    of different steps. ``checks`` ride along the same way but only report
    whether they differ, for the caller to explain in detail. ``everywhere``
    flags ride along negated, so MAX gives minus their lowest: true only
    where true on every rank (an asynchronous save written on every rank).
    """
    checks = checks or {}
    flags = [float(flag) for u in units for flag in u.grads.slot_has_grad]
    flags += [-float(flag) for flag in everywhere]
    check_values = list(checks.values())
    flags += with_negations(check_values)
    values = list(counters.values())
    tensor = torch.tensor([0.0, *flags, *with_negations(values)], dtype=torch.float64, device=comm.device)
    shards = [u.grads.sharded_grads for u in units if u.grads.sharded_grads is not None] if check_finite else []
    if shards:
        # On the device, into the all-reduced tensor: no host synchronisation per shard.
        tensor[0] = torch.stack([~torch.isfinite(shard).all() for shard in shards]).any().to(tensor.dtype)
    label = "the optimizer-step agreement"
    collectives.all_reduce(comm, tensor, dist.ReduceOp.MAX, label=label).wait()
    # A 2-D mesh: the tensor-parallel ranks hold other pieces of the layers, so an overflow in one
    # rank's piece must skip the step on every rank that shares the layers too.
    if comm.tensor_parallel_size > 1:
        span = collectives.Span.TENSOR_PARALLEL
        collectives.all_reduce(comm, tensor, dist.ReduceOp.MAX, label=label, span=span).wait()
    reduced = tensor.tolist()
    differing = ", ".join(differing_values(counters, reduced))
    if differing:
        raise collectives.CollectiveFailed(
            f"ZeRO: ranks reached this optimizer step after different work ({differing}).\n"
            + collectives.DIVERGENCE_ADVICE
        )
    agreed, offset = [], 1
    for unit in units:
        n = len(unit.grads.slot_has_grad)
        agreed.append([bool(x) for x in reduced[offset : offset + n]])
        offset += n
    on_every_rank = [value <= -1 for value in reduced[offset : offset + len(everywhere)]]
    offset += len(everywhere)
    n = len(check_values)
    checks_differ = bool(differing_values(checks, reduced[offset : offset + 2 * n])) if n else False
    return StepAgreement(bool(reduced[0]), agreed, checks_differ, on_every_rank)
