"""The plans an engine is built from, derived once from its ``ZeroConfig``.

The config is the user's settings, as they wrote them; the plans are what the parts need to know, each part
given the plan it reads (``build.py``): the stage's, the units' cut, the precision and fp16's loss scaling,
offload, the wire (ZeRO++), the groups (hybrid sharding, hpZ, tensor parallelism), the passes' and the optimizer
step's settings. Only the setup's agreement reads the whole config (every setting must be the same on every
rank); nothing else is handed the config.
"""

from __future__ import annotations

from typing import NamedTuple

from .config import ZeroConfig
from .offload_plan import OffloadPlan
from .precision import MixedPrecision
from .stage_plan import StagePlan
from .wire_plan import WirePlan
from .wrap_policy import WrapPolicy


class UnitCut(NamedTuple):
    """How the model is cut into units, and what the stage means for each."""

    wrap_policy: WrapPolicy
    bucket_numel: int  # the size-based policy's unit, in fp32 elements
    stage: StagePlan
    persistence_threshold: int  # stage 3: smaller units keep their full parameters

    def plan_for(self, numel: int) -> StagePlan:
        """A stage-3 unit of ``numel`` parameters below ``persistence_threshold`` keeps its full parameters
        (DeepSpeed's stage3_param_persistence_threshold), which is stage 2's plan."""
        if self.stage.params_sharded_at_rest and numel < self.persistence_threshold:
            return StagePlan.for_stage(2)
        return self.stage


class LossScaling(NamedTuple):
    """fp16's loss scaling (``optim/loss_scaling.py``): a fixed scale, or a dynamic one and its rules."""

    dynamic: bool
    initial_scale: float
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float

    @classmethod
    def of(cls, config: ZeroConfig) -> LossScaling:
        dynamic = config.loss_scale == 0
        return cls(
            dynamic,
            float(config.initial_loss_scale if dynamic else config.loss_scale),
            config.loss_scale_window,
            config.loss_scale_hysteresis,
            config.consecutive_hysteresis,
            config.min_loss_scale,
        )


class PassSettings(NamedTuple):
    """What the forward and backward passes read."""

    prefetch: int | str  # a depth, or "auto"
    prefetch_cap_mb: float
    broadcast_buffers: bool
    offload_activations: bool
    partition_activations: bool


class StepSettings(NamedTuple):
    """What the optimizer step reads."""

    overlap_param_refresh: bool
    skip_nonfinite_steps: bool


class Groups(NamedTuple):
    """The process groups the engine shards over, beyond its data-parallel group."""

    shard_group_size: int | None  # hybrid sharding
    secondary_shard_group_size: int | None  # hpZ
    tensor_parallel_size: int


class EnginePlans(NamedTuple):
    stage: int
    units: UnitCut
    precision: MixedPrecision
    loss_scaling: LossScaling | None  # None: no loss scaling (the precision is not fp16)
    offload: OffloadPlan
    offload_dir: str | None
    wire: WirePlan
    groups: Groups
    passes: PassSettings
    step: StepSettings

    @property
    def stage_plan(self) -> StagePlan:
        return self.units.stage

    @classmethod
    def of(cls, config: ZeroConfig) -> EnginePlans:
        scaling = LossScaling.of(config) if config.mixed_precision.uses_loss_scaling else None
        return cls(
            config.stage,
            UnitCut(config.wrap_policy, config.bucket_numel, config.plan, config.persistence_threshold),
            config.mixed_precision,
            scaling,
            config.offload,
            config.offload_dir,
            config.wire,
            Groups(config.shard_group_size, config.secondary_shard_group_size, config.tensor_parallel_size),
            PassSettings(
                config.prefetch,
                config.prefetch_cap_mb,
                config.broadcast_buffers,
                config.offload_activations,
                config.partition_activations,
            ),
            StepSettings(config.overlap_param_refresh, config.skip_nonfinite_steps),
        )
