"""Model-state bytes per rank before launch, for DDP and each ZeRO stage (DeepSpeed's
``estimate_zero3_model_states_mem_needs_all_live``), and the largest model a device budget holds.

What an estimate stands for: what ``engine.memory_report()`` measures at the peak of model state,
after a backward of a step after the first (gradients alive, optimizer state made by the step
before), with the optimizer state of ``offload_optimizer="nvme"`` in its files. Activations,
gathered stage-3 units, communication buffers and the allocator's slack are not in it; hpZ's secondary
pieces and ZeRO++'s quantization buffers are figures of their own.

A model is split into units the way the engine splits it (``wrap_policy``), so padding, gradients
of units with frozen parameters and the offloaded units are the engine's own; a parameter count is
taken as one unit whose ``offload_fraction`` of elements is offloaded (the engine offloads whole
units, the largest first). Optimizer state is each rank's average share: where a unit mixes frozen
and trainable parameters, which rank holds how many of the trainable elements depends on the layout.
Stage 3's ``persistence_threshold`` is not modelled (every unit sharded); ``offload_params`` applies
to stage 3's row only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..collectives import all_reduce_working_bytes, gather_working_bytes, reduce_working_bytes
from ..config import ZeroConfig, user_settings
from ..precision import MixedPrecision
from ..settings import Setting
from ..unit.layout import FlatLayout
from ..unit.unit_selection import plan_units
from ..whole_tensor_plan import STEPPED_WHOLE, PlannedTensor, StepRounds, pieces_by_slot
from .memory_reports import MemoryReport
from .predicted import UnitElements, ddp_bytes, model_state_bytes

STAGES = (0, 1, 2, 3)  # 0: DDP, the reference
# The settings the estimate shares with the engine, by their ZeroConfig names: ZeroConfig declares and
# checks them, and zero-estimate's flags are generated from their records (the mixed precision too, which is
# no user setting: each framework's own precision flag sets it). What is not a setting is EstimateSettings'.
SHARED_SETTINGS = ("shard_group_size", "bucket_size_mb", "wrap_policy", "offload_optimizer", "offload_fraction")
SHARED_SETTINGS += ("offload_params", "secondary_shard_group_size", "quantize_weights", "quantize_gradients")
SHARED_SETTINGS += ("gradient_quantization_bits", "quantization_block_size", "asynchronous_checkpoints")


def shared_settings() -> list[Setting]:
    """The schema's records of the settings the estimate shares with the engine, in ZeroConfig's order."""
    return [setting for setting in user_settings() if setting.name in SHARED_SETTINGS]


def shared_config(precision: MixedPrecision | None = None, **settings: Any) -> ZeroConfig:
    """The settings the estimate shares with the engine, by name and as the strategies take them
    (``wrap_policy``: a class, classes or a ``WrapPolicy``), checked by ``ZeroConfig``; ``precision``: its
    ``mixed_precision``."""
    forms = {setting.name: setting.keyword for setting in shared_settings()}
    unknown = sorted(set(settings) - set(forms))
    if unknown:
        raise TypeError(f"the estimate takes no setting {unknown}; it shares {list(forms)} with ZeroConfig")
    values = {name: forms[name].to_config(value) for name, value in settings.items()}
    return ZeroConfig(**values, **({} if precision is None else {"mixed_precision": precision}))


@dataclass(frozen=True)
class UnitCount:
    """One unit's parameters (each shared one once) and the trainable ones among them."""

    numel: int
    trainable_numel: int


@dataclass(frozen=True, init=False)
class EstimateSettings:
    """Everything but the model that decides the bytes: the settings shared with the engine, as the
    ``ZeroConfig`` that checks them, and what is no setting of the engine's."""

    world_size: int
    config: ZeroConfig  # shard_group_size, bucket_size_mb, wrap_policy, the offload settings, mixed_precision
    optimizer_state_bytes_per_param: int = 8  # Adam(W): two fp32 moments; SGD with momentum: 4
    host_is_device: bool = False  # a CPU device: an offloaded unit's master and gradient shard stay in place

    def __init__(
        self,
        world_size: int,
        config: ZeroConfig | None = None,
        *,
        precision: MixedPrecision | None = None,
        optimizer_state_bytes_per_param: int = 8,
        host_is_device: bool = False,
        **settings: Any,
    ) -> None:
        """``config``, or the shared settings by name (``offload_optimizer="cpu"``, ``precision=...``)."""
        if config is not None and (settings or precision is not None):
            raise TypeError("EstimateSettings: pass a ZeroConfig or its settings by name, not both.")
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "config", config if config is not None else shared_config(precision, **settings))
        object.__setattr__(self, "optimizer_state_bytes_per_param", optimizer_state_bytes_per_param)
        object.__setattr__(self, "host_is_device", host_is_device)
        self._check()

    def _check(self) -> None:
        """What ZeroConfig cannot check: the world size, the shard group beside it, the optimizer's bytes."""
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} is invalid: use a positive number of ranks.")
        group = self.config.shard_group_size
        if group is not None and self.world_size % group:
            raise ValueError(
                f"shard_group_size={group!r} is invalid: use a positive divisor of world_size={self.world_size} "
                "(usually the ranks of one node), or None to shard over every rank."
            )
        secondary = self.config.secondary_shard_group_size
        if secondary is not None and (secondary >= self.shard_size or self.shard_size % secondary):
            raise ValueError(
                f"secondary_shard_group_size={secondary!r} is invalid: use a divisor of the shard group "
                f"({self.shard_size} ranks) smaller than it, or None."
            )
        if not isinstance(self.optimizer_state_bytes_per_param, int) or self.optimizer_state_bytes_per_param < 0:
            raise ValueError(
                f"optimizer_state_bytes_per_param={self.optimizer_state_bytes_per_param!r} is invalid: use 8 "
                "(Adam), 4 (SGD with momentum) or 0 (plain SGD)."
            )

    @property
    def shard_size(self) -> int:
        return self.config.shard_group_size or self.world_size


@dataclass(frozen=True)
class ZeroEstimate:
    numel: int
    trainable_numel: int
    units: int
    settings: EstimateSettings
    by_stage: dict[int, MemoryReport]  # 0 (DDP), 1, 2, 3 -> bytes per rank
    # hpZ (secondary_shard_group_size, stage 3): every unit's piece, on the device between the unit's forward
    # and its backward; not in by_stage, whose peak is after a backward, when the pieces are gone.
    secondary_piece_bytes: int = 0
    # ZeRO++ (quantize_weights at stage 3, quantize_gradients at stages 2 and 3): the most one quantized gather,
    # and one quantized reduce, of the largest unit allocates at once besides its input and output (the packed
    # buffers and a float32 pass); transient, on the device, not in by_stage.
    quantized_gather_bytes: int = 0
    quantized_reduce_bytes: int = 0
    # An optimizer that steps whole tensors (whole_tensor_optimizer: "muon", "adafactor"): what the rank that
    # sends most sends each step, to the owners and back (the traffic report's "send"), and the most one owner
    # builds at once (a round's whole tensors); transient, not in by_stage.
    whole_tensor_sent_bytes: int = 0
    whole_tensor_working_bytes: int = 0
    # asynchronous_checkpoints (stages 1-3): the host memory each rank keeps from its first asynchronous save on,
    # a copy of its shard of the fp32 weights and of the optimizer state (each unit's padded shard; the model's
    # buffers and the optimizer's step counts aside); not in by_stage.
    checkpoint_staging_bytes: int = 0

    def __getitem__(self, stage: int) -> MemoryReport:
        return self.by_stage[stage]


def count_units(model: nn.Module, config: ZeroConfig) -> list[UnitCount]:
    """The model's units as the engine plans them (``config``'s wrap_policy and bucket size); reads shapes
    only, so a meta model costs nothing."""
    plans = plan_units(model, config.wrap_policy, config.bucket_numel)
    return [
        UnitCount(sum(p.numel() for p in plan.params), sum(p.numel() for p in plan.params if p.requires_grad))
        for plan in plans
    ]


def padded_numel(numel: int, shard_size: int) -> int:
    """A unit's flat buffer: padded so that it divides into equal shards (unit/layout.py)."""
    return -(-numel // shard_size) * shard_size


def _sum(reports: list[MemoryReport]) -> MemoryReport:
    fields = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "nvme_bytes", "host_bytes")
    return MemoryReport(*(sum(getattr(report, name) for report in reports) for name in fields))


def _stage_bytes(stage: int, units: list[UnitCount], shares: list[float], settings: EstimateSettings) -> MemoryReport:
    """Each unit through the memory model, with the unit's padding and gradients as the engine holds them."""
    config, state_bytes = settings.config, settings.optimizer_state_bytes_per_param
    if stage == 0:  # DDP: no padding, no offload
        numel, trainable = sum(u.numel for u in units), sum(u.trainable_numel for u in units)
        return ddp_bytes(UnitElements(numel, trainable, trainable, 1), config.mixed_precision, state_bytes)
    k = settings.shard_size
    reports = []
    for unit, share in zip(units, shares):
        padded = padded_numel(unit.numel, k)
        # A trainable unit's gradient is its whole shard.
        elements = UnitElements(padded, unit.trainable_numel, padded if unit.trainable_numel else 0, k)
        plan, precision = config.offload, config.mixed_precision
        reports.append(model_state_bytes(stage, elements, precision, state_bytes, plan, share, settings.host_is_device))
    return _sum(reports)


def estimate_units(units: list[UnitCount], settings: EstimateSettings, whole_units: bool = True) -> ZeroEstimate:
    """``whole_units``: offload whole units, largest first, as the engine does; else each unit's
    ``offload_fraction`` of elements (a parameter count's one unit)."""
    plan = settings.config.offload
    if whole_units:
        chosen = plan.offloaded_units([u.trainable_numel for u in units])
        shares = [1.0 if index in chosen else 0.0 for index in range(len(units))]
    else:  # no share without offload_optimizer (model_state_bytes reads the plan)
        shares = [plan.fraction] * len(units)
    by_stage = {stage: _stage_bytes(stage, units, shares, settings) for stage in STAGES}
    numel, trainable = sum(u.numel for u in units), sum(u.trainable_numel for u in units)
    gather, reduce = _quantized_working_bytes(units, settings)
    secondary = _secondary_piece_bytes(units, settings)
    result = ZeroEstimate(numel, trainable, len(units), settings, by_stage, secondary, gather, reduce)
    return replace(result, checkpoint_staging_bytes=_checkpoint_staging_bytes(units, settings))


def _checkpoint_staging_bytes(units: list[UnitCount], settings: EstimateSettings) -> int:
    """asynchronous_checkpoints: each unit's shard of the fp32 weights (all of them) and of the optimizer state
    (the trainable ones'), as a save stages them in host memory (0 when off)."""
    if not settings.config.asynchronous_checkpoints:
        return 0
    k, state = settings.shard_size, settings.optimizer_state_bytes_per_param
    weights = sum(padded_numel(unit.numel, k) // k for unit in units) * 4  # the masters are always fp32
    return weights + sum(padded_numel(unit.trainable_numel, k) // k for unit in units) * state


def _quantized_working_bytes(units: list[UnitCount], settings: EstimateSettings) -> tuple[int, int]:
    """ZeRO++: the working bytes of the largest unit's quantized gather and quantized reduce (0 when off)."""
    config, shards = settings.config, settings.shard_size
    if not units or not (config.quantize_weights or config.quantize_gradients):
        return 0, 0
    shard = max(padded_numel(unit.numel, shards) for unit in units) // shards
    block, bits = config.quantization_block_size, config.gradient_quantization_bits
    compute_bytes = config.mixed_precision.compute_dtype.itemsize  # the gathered buffer's
    gather = gather_working_bytes(shard, shards, block, 8, compute_bytes) if config.quantize_weights else 0
    if not config.quantize_gradients:
        return gather, 0
    element_bytes, replicas = config.mixed_precision.reduce_dtype.itemsize, settings.world_size // shards
    # Two hops with secondary groups in one shard group; under hybrid sharding one, then the all-reduce across.
    secondary = config.secondary_shard_group_size if replicas == 1 else None
    reduce = reduce_working_bytes(shard, shards, secondary, block, bits, element_bytes)
    if replicas > 1:
        reduce = max(reduce, all_reduce_working_bytes(shard, replicas, block, bits, element_bytes))
    return gather, reduce


def _secondary_piece_bytes(units: list[UnitCount], settings: EstimateSettings) -> int:
    """hpZ: each unit's padded elements over the secondary group, in the compute dtype."""
    secondary = settings.config.secondary_shard_group_size
    if secondary is None:
        return 0
    compute_bytes = settings.config.mixed_precision.compute_dtype.itemsize
    return sum(padded_numel(unit.numel, settings.shard_size) // secondary * compute_bytes for unit in units)


def estimate(
    model: nn.Module | int,
    world_size: int,
    config: ZeroConfig | None = None,
    *,
    precision: MixedPrecision | None = None,
    optimizer_state_bytes_per_param: int = 8,
    host_is_device: bool = False,
    whole_tensor_optimizer: str | None = None,
    **settings: Any,
) -> ZeroEstimate:
    """Model-state bytes per rank for DDP and stages 1-3 (``result[stage]``, a ``MemoryReport``:
    ``device_bytes``, ``host_bytes``, ``nvme_bytes``) of ``model`` (an ``nn.Module``, on the meta
    device or anywhere, split into units as the engine splits it) or of a parameter count (every
    parameter trainable).

    The engine's settings it reads come from ``config`` (a ``ZeroConfig``), or by name as ``ZeroConfig``
    takes them: ``shard_group_size``, ``bucket_size_mb``, ``wrap_policy`` (a class, classes or a
    ``WrapPolicy``), ``offload_optimizer``, ``offload_fraction``, ``offload_params``,
    ``secondary_shard_group_size`` (hpZ: ``secondary_piece_bytes``), ``quantize_weights``,
    ``quantize_gradients``, ``gradient_quantization_bits``, ``quantization_block_size`` (ZeRO++:
    ``quantized_gather_bytes``, ``quantized_reduce_bytes``) and ``precision`` (its ``mixed_precision``),
    checked by it. Its own: ``world_size`` (the ranks in all),
    ``optimizer_state_bytes_per_param`` (Adam 8, SGD with momentum 4), ``host_is_device`` (a CPU device:
    an offloaded unit's master and gradient shard stay in place) and ``whole_tensor_optimizer`` ("muon":
    torch's Muon over the trainable matrices, "adafactor": torch's Adafactor over every trainable tensor,
    each listed in the model's order as torch's docs build them; with a model only:
    ``whole_tensor_sent_bytes`` and ``whole_tensor_working_bytes``)."""
    estimate_settings = EstimateSettings(
        world_size,
        config,
        precision=precision,
        optimizer_state_bytes_per_param=optimizer_state_bytes_per_param,
        host_is_device=host_is_device,
        **settings,
    )
    if whole_tensor_optimizer is not None and whole_tensor_optimizer not in WHOLE_TENSOR_OPTIMIZERS:
        raise ValueError(
            f"whole_tensor_optimizer={whole_tensor_optimizer!r} is invalid: use one of "
            f"{', '.join(WHOLE_TENSOR_OPTIMIZERS)}, or None for an elementwise optimizer."
        )
    if isinstance(model, nn.Module):
        result = estimate_units(count_units(model, estimate_settings.config), estimate_settings)
        if whole_tensor_optimizer is None:
            return result
        sent, working = whole_tensor_step_bytes(model, estimate_settings, whole_tensor_optimizer)
        return replace(result, whole_tensor_sent_bytes=sent, whole_tensor_working_bytes=working)
    if whole_tensor_optimizer is not None:
        raise ValueError("whole_tensor_optimizer needs the model (which tensors, of which shapes), not a count.")
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise ValueError(f"estimate: got {model!r}; pass an nn.Module or a positive number of parameters.")
    return estimate_units([UnitCount(model, model)], estimate_settings, whole_units=False)


# The optimizers zero-estimate plans the whole-tensor step of, by name: each one's class, and which of the
# model's trainable tensors it is given.
WHOLE_TENSOR_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], Callable[[nn.Parameter], bool]]] = {
    "muon": (torch.optim.Muon, lambda param: param.ndim == 2),
    "adafactor": (torch.optim.Adafactor, lambda param: True),
}


def whole_tensor_step_bytes(model: nn.Module, settings: EstimateSettings, name: str) -> tuple[int, int]:
    """(what the rank that sends most sends in a step, the most one owner builds at once) for the optimizer
    ``name`` over the model's trainable tensors: the units' layouts as the engine builds them, and the step's
    own plan of owners and rounds (whole_tensor_plan.py)."""
    kind, takes = WHOLE_TENSOR_OPTIMIZERS[name]
    rule = STEPPED_WHOLE[kind]
    config, ranks = settings.config, settings.shard_size
    planned: dict[int, PlannedTensor] = {}
    for plan in plan_units(model, config.wrap_policy, config.bucket_numel):
        params = [(fqns, p.shape, p.requires_grad) for p, fqns in zip(plan.params, plan.param_fqns)]
        layout = FlatLayout.build(params, ranks)
        pieces = pieces_by_slot(layout)
        for param, slot in zip(plan.params, layout.slots):
            planned[id(param)] = PlannedTensor(slot, pieces[slot.index], 0, rule.state_of(tuple(slot.shape), {}))
    stepped = [planned[id(p)] for p in model.parameters() if p.requires_grad and takes(p) and planned[id(p)].slot.numel]
    step = StepRounds.plan(stepped, rule, ranks)
    return max(step.sent_bytes(r) for r in range(ranks)), max(step.working_bytes(r) for r in range(ranks))


def largest_fitting_model(device_budget_bytes: int, stage: int, settings: EstimateSettings) -> int:
    """The most parameters (one unit, every one trainable) whose model state fits ``device_budget_bytes``
    on each rank's device at ``stage`` (0: DDP); 0 if not even one parameter does."""

    def fits(numel: int) -> bool:
        unit = [UnitCount(numel, numel)]
        return estimate_units(unit, settings, whole_units=False)[stage].device_bytes <= device_budget_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):  # device bytes grow with the count: double, then bisect
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
