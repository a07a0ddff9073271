"""Model-state bytes per rank before launch, for DDP and each ZeRO stage (DeepSpeed's
``estimate_zero3_model_states_mem_needs_all_live``), and the largest model a device budget holds.

What an estimate stands for: what ``engine.memory_report()`` measures at the peak of model state,
after a backward of a step after the first (gradients alive, optimizer state made by the step
before), with the optimizer state of ``offload_optimizer="nvme"`` in its files. Activations,
gathered stage-3 units, communication buffers and the allocator's slack are not in it.

A model is split into units the way the engine splits it (``wrap_policy``), so padding, gradients
of units with frozen parameters and the offloaded units are the engine's own; a parameter count is
taken as one unit whose ``offload_fraction`` of elements is offloaded (the engine offloads whole
units, the largest first). Optimizer state is each rank's average share: where a unit mixes frozen
and trainable parameters, which rank holds how many of the trainable elements depends on the layout.
Stage 3's ``persistence_threshold`` is not modelled (every unit sharded); ``offload_params`` applies
to stage 3's row only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .accounting import MemoryReport, expected_model_state_bytes
from .config import OFFLOAD_MODES, MixedPrecision, WrapPolicy, ZeroConfig
from .offload_plan import units_to_offload
from .unit.plan import plan_units

STAGES = (0, 1, 2, 3)  # 0: DDP, the reference


@dataclass(frozen=True)
class UnitCount:
    """One unit's parameters (each shared one once) and the trainable ones among them."""

    numel: int
    trainable_numel: int


@dataclass(frozen=True)
class EstimateSettings:
    """Everything but the model that decides the bytes."""

    world_size: int
    shard_group_size: int | None = None  # hybrid sharding: shards divide over this many ranks
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    optimizer_state_bytes_per_param: int = 8  # Adam(W): two fp32 moments; SGD with momentum: 4
    offload_optimizer: str = "none"
    offload_fraction: float = 1.0
    host_is_device: bool = False  # a CPU device: an offloaded unit's master and gradient shard stay in place
    offload_params: str = "none"  # stage 3: the parameter shards at rest in host memory ("cpu") or files ("nvme")

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} is invalid: use a positive number of ranks.")
        group = self.shard_group_size
        if group is not None and (not isinstance(group, int) or group < 1 or self.world_size % group):
            raise ValueError(
                f"shard_group_size={group!r} is invalid: use a positive divisor of world_size={self.world_size} "
                "(usually the ranks of one node), or None to shard over every rank."
            )
        if self.offload_optimizer not in OFFLOAD_MODES:
            modes = " or ".join(repr(mode) for mode in OFFLOAD_MODES)
            raise ValueError(f"offload_optimizer={self.offload_optimizer!r} is invalid: use {modes}.")
        if isinstance(self.offload_fraction, bool) or not 0 < self.offload_fraction <= 1:
            raise ValueError(f"offload_fraction={self.offload_fraction!r} is invalid: use a share in (0, 1].")
        if self.offload_params not in OFFLOAD_MODES:
            modes = " or ".join(repr(mode) for mode in OFFLOAD_MODES)
            raise ValueError(f"offload_params={self.offload_params!r} is invalid: use {modes}.")
        if not isinstance(self.optimizer_state_bytes_per_param, int) or self.optimizer_state_bytes_per_param < 0:
            raise ValueError(
                f"optimizer_state_bytes_per_param={self.optimizer_state_bytes_per_param!r} is invalid: use 8 "
                "(Adam), 4 (SGD with momentum) or 0 (plain SGD)."
            )

    @property
    def shard_size(self) -> int:
        return self.shard_group_size or self.world_size


@dataclass(frozen=True)
class ZeroEstimate:
    numel: int
    trainable_numel: int
    units: int
    settings: EstimateSettings
    by_stage: dict[int, MemoryReport]  # 0 (DDP), 1, 2, 3 -> bytes per rank

    def __getitem__(self, stage: int) -> MemoryReport:
        return self.by_stage[stage]


def count_units(model: nn.Module, wrap_policy: WrapPolicy | None = None, bucket_size_mb: float = 25) -> list[UnitCount]:
    """The model's units as the engine plans them; reads shapes only, so a meta model costs nothing."""
    config = ZeroConfig(wrap_policy=wrap_policy or WrapPolicy(), bucket_size_mb=bucket_size_mb)
    plans = plan_units(model, config.wrap_policy, config.bucket_numel)
    return [
        UnitCount(sum(p.numel() for p in plan.params), sum(p.numel() for p in plan.params if p.requires_grad))
        for plan in plans
    ]


def _padded(numel: int, shard_size: int) -> int:
    """A unit's flat buffer: padded so that it divides into equal shards (unit/layout.py)."""
    return -(-numel // shard_size) * shard_size


def _sum(reports: list[MemoryReport]) -> MemoryReport:
    fields = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "nvme_bytes", "host_bytes")
    return MemoryReport(*(sum(getattr(report, name) for report in reports) for name in fields))


def _stage_bytes(
    stage: int, units: list[UnitCount], offloaded: list[float], settings: EstimateSettings
) -> MemoryReport:
    """Each unit through the formulas, with the unit's padding and gradients as the engine holds them."""
    if stage == 0:  # DDP: no padding, no offload
        numel, trainable = sum(u.numel for u in units), sum(u.trainable_numel for u in units)
        return expected_model_state_bytes(
            0,
            numel,
            settings.world_size,
            settings.precision,
            settings.optimizer_state_bytes_per_param,
            trainable_numel=trainable,
        )
    k = settings.shard_size
    reports = []
    for unit, fraction in zip(units, offloaded):
        padded = _padded(unit.numel, k)
        reports.append(
            expected_model_state_bytes(
                stage,
                padded,
                k,
                settings.precision,
                settings.optimizer_state_bytes_per_param,
                trainable_numel=unit.trainable_numel,
                gradient_numel=padded if unit.trainable_numel else 0,  # a trainable unit's whole shard
                offload_optimizer=settings.offload_optimizer if fraction else "none",
                offload_fraction=fraction or 1.0,
                host_is_device=settings.host_is_device,
                offload_params=settings.offload_params,  # stage 3's alone (the formula ignores it below)
            )
        )
    return _sum(reports)


def estimate_units(units: list[UnitCount], settings: EstimateSettings, whole_units: bool = True) -> ZeroEstimate:
    """``whole_units``: offload whole units, largest first, as the engine does; else each unit's
    ``offload_fraction`` of elements (a parameter count's one unit)."""
    if settings.offload_optimizer == "none":
        offloaded = [0.0] * len(units)
    elif whole_units:
        chosen = units_to_offload([u.trainable_numel for u in units], settings.offload_fraction)
        offloaded = [1.0 if index in chosen else 0.0 for index in range(len(units))]
    else:
        offloaded = [settings.offload_fraction] * len(units)
    by_stage = {stage: _stage_bytes(stage, units, offloaded, settings) for stage in STAGES}
    numel, trainable = sum(u.numel for u in units), sum(u.trainable_numel for u in units)
    return ZeroEstimate(numel, trainable, len(units), settings, by_stage)


def estimate(
    model: nn.Module | int,
    world_size: int,
    *,
    shard_group_size: int | None = None,
    precision: MixedPrecision | None = None,
    optimizer_state_bytes_per_param: int = 8,
    offload_optimizer: str = "none",
    offload_fraction: float = 1.0,
    host_is_device: bool = False,
    offload_params: str = "none",
    wrap_policy: WrapPolicy | None = None,
    bucket_size_mb: float = 25,
) -> ZeroEstimate:
    """Model-state bytes per rank for DDP and stages 1-3 (``result[stage]``, a ``MemoryReport``:
    ``device_bytes``, ``host_bytes``, ``nvme_bytes``) of ``model`` (an ``nn.Module``, on the meta
    device or anywhere; ``wrap_policy`` and ``bucket_size_mb`` as in ``ZeroConfig``) or of a
    parameter count (every parameter trainable)."""
    settings = EstimateSettings(
        world_size,
        shard_group_size,
        precision or MixedPrecision(),
        optimizer_state_bytes_per_param,
        offload_optimizer,
        offload_fraction,
        host_is_device,
        offload_params,
    )
    if isinstance(model, nn.Module):
        return estimate_units(count_units(model, wrap_policy, bucket_size_mb), settings)
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise ValueError(f"estimate: got {model!r}; pass an nn.Module or a positive number of parameters.")
    return estimate_units([UnitCount(model, model)], settings, whole_units=False)


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
