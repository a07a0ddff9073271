"""Where each unit's tensors rest between uses, derived once from the offload settings: :class:`OffloadPlan`.

``offload_optimizer`` and ``offload_params`` are strings in the settings (what users type); everything past
``ZeroConfig`` reads this plan instead, as it reads :class:`~zero_core.config.StagePlan` instead of the stage
number. Per unit (:meth:`OffloadPlan.for_unit`) it says where the fp32 master, the optimizer's per-element
state, the parameter shard at rest and the reduced gradient rest (:class:`Rest`), and whether the master is a
tensor of its own or the parameters' own memory. Unit storage, the step, checkpointing, the memory report and
the estimate all read it, so the rule is written once (:func:`master_stands_alone`).

``ZeroConfig`` calls :func:`check_offload` when it is built (the checks live here, beside the modes, as the
loss-scaling checks live in ``precision.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from .settings import check_flags, is_count


class OffloadTier(Enum):
    """An offload setting's value: where the offloaded part goes."""

    NONE = "none"  # stays on the device
    CPU = "cpu"  # host memory (pinned on a GPU)
    NVME = "nvme"  # files under offload_dir, a few units in host memory at a time

    @property
    def offloads(self) -> bool:
        return self is not OffloadTier.NONE


OFFLOAD_MODES = tuple(tier.value for tier in OffloadTier)


class Rest(Enum):
    """Where a tensor rests between uses."""

    DEVICE = "device"  # the compute device (on a CPU device: host memory that nothing moves)
    HOST = "host"  # host memory apart from the device (pinned on a GPU)
    FILE = "file"  # a file under offload_dir; its memory is freed (its storage resized to zero)


def master_stands_alone(
    offloaded: bool, sharded_at_rest: bool, low_precision: bool, host_is_device: bool, params: OffloadTier
) -> bool:
    """Whether a unit's fp32 master shard is a tensor of its own rather than the parameters' own memory. In a
    lower compute precision it always is. In fp32 the master is the compute shard itself (the full parameters'
    slice at stages 1/2), except: an offloaded unit on a GPU keeps its master in host memory;
    ``offload_params="nvme"`` gives the shard at rest a file of its own (the master stays apart from it); and
    ``offload_params="cpu"`` moves the shard at rest to the host, where it is the master of an offloaded unit
    (and of every unit on a CPU device), while on a GPU a unit not offloaded keeps its master on the device,
    apart from the host shard (the compute shard becomes an empty staging buffer)."""
    if low_precision:
        return True
    params_moved = sharded_at_rest and params.offloads
    if params_moved and params is OffloadTier.NVME:
        return True
    if params_moved:  # offload_params="cpu"
        return not offloaded and not host_is_device
    return offloaded and not host_is_device


@dataclass(frozen=True)
class UnitOffload:
    """Where one unit's tensors rest between uses."""

    offloaded: bool  # offload_optimizer chose it: its optimizer work leaves the device
    master: Rest
    master_stands_alone: bool  # a tensor of its own, not the parameters' own memory (master_stands_alone)
    optimizer_state: Rest
    param_shard: Rest  # stages 1/2 and units stage 3 keeps gathered: DEVICE (the full parameters' slice)
    reduced_grad: Rest  # an offloaded unit's reduced gradient shard is copied to the host (unless host is device)

    @property
    def master_in_file(self) -> bool:
        return self.master is Rest.FILE

    @property
    def state_in_file(self) -> bool:
        return self.optimizer_state is Rest.FILE

    @property
    def param_shard_in_file(self) -> bool:
        return self.param_shard is Rest.FILE


_TIER_REST = {OffloadTier.NONE: Rest.DEVICE, OffloadTier.CPU: Rest.HOST, OffloadTier.NVME: Rest.FILE}


@dataclass(frozen=True)
class OffloadPlan:
    """The offload settings, typed: what leaves the device and where it goes."""

    optimizer: OffloadTier = OffloadTier.NONE
    params: OffloadTier = OffloadTier.NONE
    fraction: float = 1.0  # of the optimizer's elements, by units (units_to_offload)
    units_in_memory: int = 2  # the NVMe tiers' bound on units in host memory at once
    step_in_backward: bool = False  # offloaded units step during backward (only with an offloaded optimizer)

    @classmethod
    def from_config(cls, config: Any) -> OffloadPlan:
        """From a ``ZeroConfig`` (checked by :func:`check_offload` first)."""
        optimizer = OffloadTier(config.offload_optimizer)
        return cls(
            optimizer=optimizer,
            params=OffloadTier(config.offload_params),
            fraction=config.offload_fraction,
            units_in_memory=config.offload_units_in_memory,
            step_in_backward=config.offload_step_in_backward and optimizer.offloads,
        )

    @property
    def uses_files(self) -> bool:
        """Something rests in files under offload_dir: the run needs its scratch directory."""
        return OffloadTier.NVME in (self.optimizer, self.params)

    def offloaded_units(self, trainable: list[int]) -> set[int]:
        """The units whose optimizer work leaves the device (none without ``offload_optimizer``)."""
        return units_to_offload(trainable, self.fraction) if self.optimizer.offloads else set()

    def for_unit(
        self, offloaded: bool, sharded_at_rest: bool, low_precision: bool, host_is_device: bool
    ) -> UnitOffload:
        """Where a unit's tensors rest. ``offloaded``: chosen by :meth:`offloaded_units`; ``sharded_at_rest``:
        its ``StagePlan`` (stage 3, unless persistence_threshold keeps it gathered); ``low_precision``: a compute
        dtype other than fp32; ``host_is_device``: a CPU device."""
        alone = master_stands_alone(offloaded, sharded_at_rest, low_precision, host_is_device, self.params)
        optimizer = self.optimizer if offloaded else OffloadTier.NONE
        params = self.params if sharded_at_rest else OffloadTier.NONE
        if optimizer is OffloadTier.NVME and alone:
            master = Rest.FILE
        elif (optimizer.offloads and not host_is_device) or (params.offloads and not alone):
            master = Rest.HOST  # with the optimizer on the host, or the host parameter shard itself
        else:
            master = Rest.DEVICE
        return UnitOffload(
            offloaded=offloaded,
            master=master,
            master_stands_alone=alone,
            optimizer_state=_TIER_REST[optimizer],
            param_shard=_TIER_REST[params],
            reduced_grad=Rest.HOST if optimizer.offloads and not host_is_device else Rest.DEVICE,
        )


def units_to_offload(trainable: list[int], fraction: float) -> set[int]:
    """The indices of the units offloaded: the largest first, as many as keep the offloaded share of the
    optimizer's elements at most ``fraction`` (at least the largest one). ``trainable`` are the units'
    trainable parameter counts (the elements the optimizer holds state for; a frozen unit has none and is
    never chosen), the same on every rank, so every rank chooses the same units."""
    chosen: set[int] = set()
    offloaded = 0
    for index in sorted(range(len(trainable)), key=lambda i: (-trainable[i], i)):
        if trainable[index] == 0:
            break
        if not chosen or offloaded + trainable[index] <= fraction * sum(trainable):
            chosen.add(index)
            offloaded += trainable[index]
    return chosen


def check_offload(config: Any) -> None:
    """Raises ``ValueError`` saying what to use for the first offload setting of ``config`` (a
    ``ZeroConfig``) that is invalid, alone or beside the others."""
    for name in ("offload_optimizer", "offload_params"):
        if getattr(config, name) not in OFFLOAD_MODES:
            modes = " or ".join(repr(m) for m in OFFLOAD_MODES)
            raise ValueError(f"ZeroConfig.{name}={getattr(config, name)!r} is invalid: use {modes}.")
    if isinstance(config.offload_fraction, bool) or not 0 < config.offload_fraction <= 1:
        raise ValueError(
            f"ZeroConfig.offload_fraction={config.offload_fraction!r} is invalid: use a share in (0, 1] "
            "(1: the whole optimizer state; for none, leave offload_optimizer at 'none')."
        )
    if not is_count(config.offload_units_in_memory, minimum=1):
        raise ValueError(
            f"ZeroConfig.offload_units_in_memory={config.offload_units_in_memory!r} is invalid: use an integer >= 1."
        )
    if OffloadTier(config.offload_params).offloads and config.stage != 3:
        raise ValueError(
            f"ZeroConfig.offload_params={config.offload_params!r} needs stage=3: at stage {config.stage} every rank "
            "keeps the full parameters on the device to compute with. Use stage=3, or offload_optimizer to "
            "move the optimizer's part off the device."
        )
    check_flags(config, ("offload_activations", "partition_activations", "offload_step_in_backward"))
    if config.steps_in_backward and config.mixed_precision.uses_loss_scaling:
        raise ValueError(
            "ZeroConfig.offload_step_in_backward=True cannot run with fp16 loss scaling: a step may be skipped "
            "for an overflow found only after backward. Use bf16, or turn offload_step_in_backward off."
        )
    if config.steps_in_backward and config.skip_nonfinite_steps:
        raise ValueError(
            "ZeroConfig.offload_step_in_backward=True cannot run with skip_nonfinite_steps=True: a step may be "
            "skipped for an inf or NaN gradient found only after backward (a DeepSpeed config asks for that "
            "skip unless bf16.check_grad_overflow is false at stage 1 or 2). Turn one of the two off."
        )
    if config.offload_dir is not None and not isinstance(config.offload_dir, str):
        raise ValueError("ZeroConfig.offload_dir must be a path (a string) or None.")
