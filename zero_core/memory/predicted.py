"""What a rank holds by the formulas ("Memory and communication" in docs/design.md), padding aside: each
unit's bytes read from where its tensors rest (:class:`~zero_core.offload_plan.UnitOffload`) and whether
its parameters are sharded at rest (:class:`~zero_core.config.StagePlan`). The one implementation behind
``expected_model_state_bytes``, the estimate before launch and the setup line; ``engine.memory_report()``
measures the same quantities from live tensors (``measured.py``), and the tests hold one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from ..config import ZeroConfig
from ..offload_plan import OffloadPlan, Rest, UnitOffload
from ..precision import MixedPrecision
from ..stage_plan import StagePlan
from .memory_reports import MemoryReport

MASTER_BYTES = 4  # the fp32 master, per element


@dataclass(frozen=True)
class UnitElements:
    """A unit's elements as the formulas count them (each rank's share is ``/ shard_size``)."""

    numel: int | float  # every element (a unit as the engine lays it out: padded); the master covers them all
    trainable_numel: int | float  # those the optimizer holds state for
    gradient_numel: int | float  # those with a gradient (the engine: every element of a trainable unit)
    shard_size: int  # the ranks a shard divides over (0 or 1 for DDP: not sharded)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def unit_bytes(
    sharding: StagePlan, where: UnitOffload, elements: UnitElements, precision: MixedPrecision, state_bytes: int
) -> tuple[Fraction, ...]:
    """One unit's (parameter, gradient, optimizer state, nvme, host) bytes on a rank, exact (unrounded).

    Parameters: the full unit, or its shard where stage 3 shards it at rest; in a file or on the host where
    ``offload_params`` rests the shard there. Gradients: stage 1 a full buffer, stages 2/3 a shard of the
    ``gradient_numel``; an offloaded unit's reduced shard gets an fp32 host copy (not on a CPU device). The
    fp32 master (in optimizer state) where it is a tensor of its own; an offloaded unit's counts as host
    memory even where it is the parameters' own. Optimizer state over the ``trainable_numel``; in the NVMe
    tier one flat file per key over the whole shard (frozen elements and padding too).
    """
    compute, reduce = _element_size(precision.compute_dtype), _element_size(precision.reduce_dtype)
    shard = Fraction(elements.numel) / elements.shard_size
    grad_shard = Fraction(elements.gradient_numel) / elements.shard_size
    params = shard * compute if sharding.params_sharded_at_rest else elements.numel * compute
    grads = grad_shard * reduce if sharding.grads_sharded else elements.numel * reduce
    host_grads = MASTER_BYTES * grad_shard if where.reduced_grad is Rest.HOST else Fraction(0)
    state = Fraction(elements.trainable_numel) / elements.shard_size * state_bytes
    master = MASTER_BYTES * shard if where.master_stands_alone and not where.master_in_file else Fraction(0)
    nvme = MASTER_BYTES * shard if where.master_in_file else Fraction(0)
    host = MASTER_BYTES * shard if where.offloaded and not where.master_in_file else Fraction(0)
    if where.state_in_file:
        nvme, state = nvme + grad_shard * state_bytes, Fraction(0)
    elif where.optimizer_state is Rest.HOST:
        host += state
    host += host_grads
    if where.param_shard_in_file:
        params, nvme = Fraction(0), nvme + shard * compute
    elif where.param_shard is Rest.HOST and not (where.offloaded and not where.master_stands_alone):
        host += shard * compute  # a copy of its own (an offloaded master that is the shard is counted above)
    return params, grads + host_grads, master + state, nvme, host


def _as_written(share: float) -> Fraction:
    """A share as written: 0.77 is 77/100, not the binary float nearest it."""
    return Fraction(repr(share)) if isinstance(share, float) else Fraction(share)


def ddp_bytes(elements: UnitElements, precision: MixedPrecision, state_bytes: int) -> MemoryReport:
    """DDP, the reference: everything on every rank; the fp32 master a copy of its own in lower precision."""
    compute = _element_size(precision.compute_dtype)
    low_precision = precision.compute_dtype != torch.float32
    return MemoryReport(
        elements.numel * compute,
        elements.trainable_numel * compute,
        elements.trainable_numel * state_bytes + MASTER_BYTES * elements.numel * low_precision,
    )


def model_state_bytes(
    stage: int,
    elements: UnitElements,
    precision: MixedPrecision,
    state_bytes: int,
    plan: OffloadPlan,
    offloaded_share: float,
    host_is_device: bool,
) -> MemoryReport:
    """A unit at ``stage`` (0: DDP, no offload) whose ``offloaded_share`` of elements ``plan`` offloads (1 or
    0 for a whole unit, as the engine offloads; a share for a parameter count taken as one unit): the
    offloaded and the kept unit's bytes weighed by their shares, in exact arithmetic, rounded once."""
    if stage == 0:
        return ddp_bytes(elements, precision, state_bytes)
    sharding = StagePlan.for_stage(stage)
    low_precision = precision.compute_dtype != torch.float32
    share = _as_written(offloaded_share) if plan.optimizer.offloads else Fraction(0)
    totals = [Fraction(0)] * 5
    for offloaded, weight in ((True, share), (False, 1 - share)):
        if weight:
            where = plan.for_unit(offloaded, sharding.params_sharded_at_rest, low_precision, host_is_device)
            part = unit_bytes(sharding, where, elements, precision, state_bytes)
            totals = [total + weight * value for total, value in zip(totals, part)]
    return MemoryReport(*(round(total) for total in totals))


OFFLOAD_SETTINGS = ("offload_optimizer", "offload_fraction", "offload_params")  # ZeroConfig's, by name


def expected_model_state_bytes(
    stage: int,
    numel: int,
    world_size: int,
    precision: MixedPrecision,
    optimizer_state_bytes_per_param: int,
    *,
    trainable_numel: int | None = None,
    gradient_numel: int | None = None,
    host_is_device: bool = False,
    **offload: Any,
) -> MemoryReport:
    """The README's formulas, padding aside. ``stage=0``: DDP; ``world_size``: the ranks a shard divides over.

    The fp32 master copy exists only when computing in lower precision, or for the offloaded share
    (its master lives on the host, the compute shard stays on the device); otherwise the parameters
    (or their shard) are the master. The master covers every parameter, frozen ones too (the engine
    keeps a master piece for each, so unfreezing one trains it from its shard); optimizer state
    covers the ``trainable_numel`` (default: all). Gradients: stage 1 keeps a full buffer for every
    parameter; stages 2/3 a shard for the ``gradient_numel`` (default: the trainable ones; the engine
    holds one for every element of a unit with any trainable parameter).

    ``offload``: ``ZeroConfig``'s offload settings by name (``offload_optimizer``, ``offload_fraction``,
    ``offload_params``), checked by it. ``offload_optimizer`` ("cpu" or "nvme", stages 1-3) moves
    ``offload_fraction`` of the elements' master and state into ``host_bytes``; "nvme" moves their state
    (over the ``gradient_numel``: a unit's file covers its whole shard) and, where it is a tensor of its
    own, their master on into ``nvme_bytes``. On a GPU the offloaded gradient shards get fp32 host copies;
    ``host_is_device`` (a CPU device) steps on the shard in place, and in fp32 the parameters' own shard is
    the master. ``offload_params`` (stage 3) rests the parameter shards on the host or in files. Where each
    tensor rests is the offload plan's (``OffloadPlan.for_unit``), as for the engine's units.
    """
    unknown = sorted(set(offload) - set(OFFLOAD_SETTINGS))
    if unknown:
        raise TypeError(f"expected_model_state_bytes: unexpected keyword arguments {unknown}")
    plan = ZeroConfig(**offload).offload
    trainable = numel if trainable_numel is None else trainable_numel
    elements = UnitElements(numel, trainable, trainable if gradient_numel is None else gradient_numel, world_size)
    state_bytes = optimizer_state_bytes_per_param
    return model_state_bytes(stage, elements, precision, state_bytes, plan, plan.fraction, host_is_device)
