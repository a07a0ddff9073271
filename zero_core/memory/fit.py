"""Settings chosen for a memory budget: the stage, offload, activation checkpointing and micro-batch that are
fastest among those whose predicted peak fits, with the prediction per tier and the runner-up.

The prediction, per rank and tier (docs/memory-budget.md gives each term):

    device = model states on the device (estimate.py, the engine's own units and padding)
           + stage 3: the root unit and the 1 + prefetch largest other units gathered, in the compute dtype
           + stages 2 and 3: the two largest units' full gradients (one reducing, one filling), reduce dtype
           + the largest trainable parameter's whole gradient, as autograd makes it, compute dtype
           + the step: Adam's fp32 temporary of the largest shard stepped on the device, or with "nvme" the
             optimizer state of the offload_units_in_memory largest offloaded units, the larger
           + activations at the micro-batch, with or without checkpointing (activations.py, measured); at
             stages 2 and 3 less the gradient shards, which fill as the activations are freed (not below 0)
           + what each process holds besides training (``overhead_bytes``)
    host   = the offloaded units' master, optimizer state and gradient copies, and parameter shards
    disk   = the optimizer state and parameter shards in files (offload "nvme")

On a CPU device host and device are one memory: their sum is held to the device budget.

The cost order, cheapest first: where the state lives (in memory < the optimizer's state on the host,
a smaller share first < also the parameters on the host < the optimizer's state on disk, a smaller share
first < also the parameters on disk), then no checkpointing < checkpointing, then a larger micro-batch <
a smaller one, then stage 1 < 2 < 3, then prefetch 1 < 0. The choice is the first candidate in that order whose every
tier is within ``budget x (1 - margin)``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
)

from ..agreement.setup import Field, agree_on_setup
from ..collectives import CommContext
from ..config import ZeroConfig
from ..memory_budget import BUDGET_PARTS, MemoryBudget
from ..offload_plan import OffloadTier
from ..precision import MixedPrecision
from ..sizes import human_bytes
from ..wrap_policy import WrapPolicyLike, as_wrap_policy
from .activations import LossFn, measure_activations, tensors_in
from .estimate import EstimateSettings, UnitCount, count_units, estimate_units, padded_numel
from .machine_memory import device_memory_per_rank

# What one rank's process holds besides training: the interpreter, torch's libraries and the communication
# threads (about 0.3 GiB measured on a CPU after `import torch, zero_core`); on a GPU, its context.
PROCESS_BYTES = 512 * 2**20
DEFAULT_MARGIN = 0.1
OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
STEP_TEMPORARY_BYTES = 4  # torch's Adam(W) step: one fp32 temporary per element of a tensor it steps


class StatePlacement(enum.IntEnum):
    """Where the model state lives, in the cost order's first key (read by the search and the description)."""

    IN_MEMORY = 0
    HOST = 1  # offload_optimizer="cpu"
    HOST_WITH_PARAMETERS = 2  # and offload_params="cpu" (stage 3)
    DISK = 3  # offload_optimizer="nvme"
    DISK_WITH_PARAMETERS = 4  # and offload_params="nvme" (stage 3)

    @property
    def offload_optimizer(self) -> str:
        return {0: "none", 1: "cpu", 2: "cpu", 3: "nvme", 4: "nvme"}[self.value]

    @property
    def offload_params(self) -> str:
        return {2: "cpu", 4: "nvme"}.get(self.value, "none")

    @property
    def on_disk(self) -> bool:
        return self >= StatePlacement.DISK


def described_budget(budget: MemoryBudget) -> str:
    """``device 20.00 GiB, disk 2.00 TiB``: for people (``str(budget)`` is the exact text form)."""
    return ", ".join(f"{name} {human_bytes(getattr(budget, name))}" for name in BUDGET_PARTS if getattr(budget, name))


@dataclass(frozen=True)
class PredictedPeak:
    """The most bytes each tier holds at once on a rank."""

    device: int
    host: int
    disk: int

    def over(self, budget: MemoryBudget, margin: float) -> list[str]:
        """The tiers over ``budget x (1 - margin)``, each with its numbers."""
        lines = []
        for name in BUDGET_PARTS:
            limit = getattr(budget, name)
            if limit is not None and getattr(self, name) > limit * (1 - margin):
                usable = human_bytes(limit * (1 - margin))
                lines.append(f"{name} {human_bytes(getattr(self, name))} > {usable}")
        return lines


@dataclass(frozen=True)
class FitCandidate:
    config: ZeroConfig
    placement: StatePlacement
    activation_checkpointing: bool
    micro_batch_size: int
    gradient_accumulation_steps: int
    predicted: PredictedPeak

    @property
    def cost(self) -> tuple:
        fraction = self.config.offload_fraction if self.placement else 0.0
        prefetch = self.config.prefetch if self.config.stage == 3 else 1
        return (
            self.placement,
            fraction,
            self.activation_checkpointing,
            -self.micro_batch_size,
            self.config.stage,
            -prefetch,
        )

    def describe(self) -> str:
        config, placement = self.config, self.placement
        where = {
            StatePlacement.IN_MEMORY: "in memory",
            StatePlacement.HOST: f"{config.offload_fraction:.0%} of the optimizer state on the host",
            StatePlacement.HOST_WITH_PARAMETERS: "optimizer state and parameters on the host",
            StatePlacement.DISK: f"{config.offload_fraction:.0%} of the optimizer state on disk",
            StatePlacement.DISK_WITH_PARAMETERS: "optimizer state and parameters on disk",
        }[placement]
        prefetch = f", prefetch {config.prefetch}" if config.stage == 3 else ""
        checkpointing = "activation checkpointing" if self.activation_checkpointing else "no checkpointing"
        batch = f"micro-batch {self.micro_batch_size} x {self.gradient_accumulation_steps} accumulation"
        return f"stage {config.stage}{prefetch}, {where}, {checkpointing}, {batch}"


@dataclass(frozen=True)
class FitResult:
    choice: FitCandidate
    runner_up: FitCandidate | None
    runner_up_lost: str  # why the runner-up was not chosen
    budget: MemoryBudget
    margin: float
    checkpointed_blocks: tuple[str, ...]  # the module paths activation checkpointing wraps, when chosen
    candidates: tuple[FitCandidate, ...]  # every one searched, in the cost order

    @property
    def config(self) -> ZeroConfig:
        return self.choice.config

    @property
    def micro_batch_size(self) -> int:
        return self.choice.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.choice.gradient_accumulation_steps

    @property
    def activation_checkpointing(self) -> bool:
        return self.choice.activation_checkpointing

    def summary(self) -> str:
        """One line: the choice, its predicted peak per tier, and the runner-up with why it lost."""
        peak = self.choice.predicted
        tiers = [f"device {human_bytes(peak.device)}"]
        tiers += [f"{name} {human_bytes(getattr(peak, name))}" for name in ("host", "disk") if getattr(peak, name)]
        line = f"zero fit for {described_budget(self.budget)} per rank (margin {self.margin:.0%}): "
        line += f"{self.choice.describe()}; "
        line += f"predicted peak {', '.join(tiers)}"
        if self.runner_up is not None:
            line += f"; runner-up: {self.runner_up.describe()} ({self.runner_up_lost})"
        return line

    def apply_activation_checkpointing(self, model: nn.Module) -> None:
        """Wrap the chosen blocks of ``model`` with torch's ``checkpoint_wrapper`` (before the engine is
        built); nothing when the choice has no checkpointing."""
        if self.activation_checkpointing:
            checkpoint_blocks(model, self.checkpointed_blocks)


def checkpoint_blocks(model: nn.Module, paths: tuple[str, ...]) -> None:
    """Wrap the modules of ``model`` at ``paths`` with torch's ``checkpoint_wrapper`` (non-reentrant, what the
    measurement assumes); refused on a model that has checkpointed blocks already."""
    if any(isinstance(module, CheckpointWrapper) for module in model.modules()):
        raise ValueError(
            "fit: the model already has checkpoint_wrapper blocks; apply the fit's checkpointing to the "
            "model as it was given to fit(), once."
        )
    blocks = {id(model.get_submodule(path)) for path in paths}
    apply_activation_checkpointing(model, check_fn=lambda module: id(module) in blocks)


def fit(
    model: nn.Module | Callable[[], nn.Module],
    sample: Any,
    *,
    world_size: int,
    budget: MemoryBudget | str | int | Mapping[str, Any],
    global_batch_size: int | None = None,
    wrap_policy: WrapPolicyLike = None,
    shard_group_size: int | None = None,
    bucket_size_mb: float = 25.0,
    precision: MixedPrecision | None = None,
    optimizer_state_bytes_per_param: int = 8,
    device: torch.device | str | None = None,
    offload_dir: str | None = None,
    margin: float = DEFAULT_MARGIN,
    loss_fn: LossFn | None = None,
    activation_bytes: int | None = None,
    overhead_bytes: int = PROCESS_BYTES,
) -> FitResult:
    """The fastest settings (by the cost order above) whose predicted peak fits ``budget`` on each rank.

    ``model``: the model, on the meta device or anywhere (not touched), or a factory called under
    ``torch.device("meta")``. ``sample``: one input batch as the model takes it (a tensor, a tuple or a mapping,
    the batch in each tensor's first dimension; values are not read). ``global_batch_size``: the samples of one
    optimizer step over every rank, split into micro-batches and accumulation; without it the micro-batch is
    the sample's. ``offload_dir``: where files may go; without it the disk tiers are not considered.
    ``activation_bytes``: the activations of one sample, measured by you, for a forward that cannot run on
    fake tensors (checkpointing is then not considered). Raises ``ValueError`` naming the smallest budget that
    fits when nothing does."""
    budget = MemoryBudget.of(budget)
    if budget.device_is_auto:
        raise ValueError(
            'fit: the device part "auto" is read by the engine at setup (every rank\'s device); give fit() the '
            'bytes per rank, e.g. budget="20GiB".'
        )
    base = ZeroConfig(
        wrap_policy=as_wrap_policy(wrap_policy),
        shard_group_size=shard_group_size,
        bucket_size_mb=bucket_size_mb,
        offload_dir=offload_dir,
        **({} if precision is None else {"mixed_precision": precision}),
    )
    return fit_config(
        model,
        sample,
        base,
        world_size=world_size,
        budget=budget,
        device=device,
        global_batch_size=global_batch_size,
        optimizer_state_bytes_per_param=optimizer_state_bytes_per_param,
        margin=margin,
        loss_fn=loss_fn,
        activation_bytes=activation_bytes,
        overhead_bytes=overhead_bytes,
    )


def fit_config(
    model: nn.Module | Callable[[], nn.Module],
    sample: Any,
    base: ZeroConfig,
    *,
    world_size: int,
    budget: MemoryBudget,
    device: torch.device | str | None = None,
    global_batch_size: int | None = None,
    optimizer_state_bytes_per_param: int = 8,
    margin: float = DEFAULT_MARGIN,
    loss_fn: LossFn | None = None,
    activation_bytes: int | None = None,
    overhead_bytes: int = PROCESS_BYTES,
) -> FitResult:
    """``fit`` with the settings it does not choose taken from ``base`` (the engine's config under
    ``memory_budget``; its chosen settings at their defaults, which ``check_memory_budget`` sees to)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    _check_inputs(world_size, global_batch_size, margin, device, budget, activation_bytes)
    _check_counts(overhead_bytes=overhead_bytes, optimizer_state_bytes_per_param=optimizer_state_bytes_per_param)
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            built = model()
        if not isinstance(built, nn.Module):
            raise ValueError(f"fit: the model factory returned a {type(built).__name__}, not an nn.Module.")
        model = built
    base = replace(base, memory_budget=None)
    compute_dtype = base.mixed_precision.compute_dtype
    if activation_bytes is None:
        profile = measure_activations(
            model,
            sample,
            wrap_policy=base.wrap_policy,
            bucket_numel=base.bucket_numel,
            compute_dtype=compute_dtype,
            device=device,
            loss_fn=loss_fn,
        )
        activations = profile.peak_bytes
    else:
        profile, activations = None, lambda micro_batch, _: activation_bytes * micro_batch
    units = count_units(model, base)
    host_is_device = device.type == "cpu"
    largest = max((p.numel() for p in model.parameters() if p.requires_grad), default=0)
    states = _ModelStates(units, largest, world_size, optimizer_state_bytes_per_param, host_is_device)
    candidates = sorted(
        (
            _candidate(config, placement, checkpointed, micro_batch, accumulation, states, activations, overhead_bytes)
            for config, placement in _configs(base, host_is_device)
            for checkpointed in ((False, True) if profile is not None and profile.checkpointed_blocks else (False,))
            for micro_batch, accumulation in _micro_batches(sample, global_batch_size, world_size)
        ),
        key=lambda candidate: candidate.cost,
    )
    blocks = profile.checkpointed_blocks if profile is not None else ()
    return _choose(candidates, budget, margin, blocks)


def fit_at_setup(model: nn.Module, sample: Any, config: ZeroConfig, comm: CommContext) -> FitResult:
    """The engine's fit under ``config.memory_budget``: every rank agrees on the budget and the sample's shapes
    first (or every rank raises the same error), "auto" becomes the smallest rank's share of its device, and the
    sample is ``model.example_input_array`` where none is given."""
    budget = config.memory_budget
    assert budget is not None
    if sample is None:
        sample = getattr(model, "example_input_array", None)
    # Before anything is measured: ranks that would choose apart are refused alike, naming the budget or sample.
    shapes = "none" if sample is None else repr([(tuple(t.shape), str(t.dtype)) for t in tensors_in(sample)])
    agree_on_setup(comm, [Field("config.memory_budget", str(budget)), Field("the sample batch's shapes", shapes)])
    if sample is None:
        raise ValueError(
            "memory_budget: the settings are chosen from one measured batch, and there is none: set "
            "model.example_input_array to one batch as the model's forward takes it (a tensor, a tuple of "
            "arguments or a mapping of keywords, the micro-batch in each tensor's first dimension), as Lightning's "
            "LightningModule does, or pass ZeroEngine(..., sample=batch)."
        )
    if any(isinstance(module, CheckpointWrapper) for module in model.modules()):
        raise ValueError(
            "memory_budget chooses activation checkpointing itself, and the model has checkpoint_wrapper blocks "
            "already (wrapped by you, or by an earlier setup of it that failed): build the model without them, or "
            "drop memory_budget to checkpoint by hand."
        )
    if budget.device_is_auto:
        budget = replace(budget, device=device_memory_per_rank(comm))
    return fit_config(model, sample, config, world_size=comm.world_size, budget=budget, device=comm.device)


def _check_inputs(
    world_size: int,
    global_batch_size: int | None,
    margin: float,
    device: torch.device,
    budget: MemoryBudget,
    activation_bytes: int | None,
) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fit: world_size={world_size!r} is invalid: use the number of ranks (processes) in all.")
    if global_batch_size is not None and (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, int)
        or global_batch_size < 1
        or global_batch_size % world_size
    ):
        raise ValueError(
            f"fit: global_batch_size={global_batch_size!r} is invalid: use a positive multiple of "
            f"world_size={world_size} (the samples of one optimizer step over every rank)."
        )
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"fit: margin={margin!r} is invalid: use a share in [0, 1), e.g. 0.1 (10% kept free).")
    if budget.device is None:
        raise ValueError("fit: the budget has no device part; give at least the device's bytes per rank.")
    if device.type == "cuda" and not torch.backends.cuda.is_built():
        raise ValueError("fit: device='cuda', but this torch is built without CUDA; use device='cpu'.")
    if device.type == "cpu" and budget.host is not None:
        raise ValueError(
            "fit: on a CPU device the host is the device: give the budget's device part only (the memory of one rank)."
        )
    if activation_bytes is not None and (
        isinstance(activation_bytes, bool) or not isinstance(activation_bytes, int) or activation_bytes < 0
    ):
        raise ValueError(f"fit: activation_bytes={activation_bytes!r} is invalid: use the bytes of one sample, >= 0.")


def _check_counts(**counts: Any) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"fit: {name}={value!r} is invalid: use a number of bytes, an integer >= 0.")


def _configs(base: ZeroConfig, host_is_device: bool) -> list[tuple[ZeroConfig, StatePlacement]]:
    """Every (config, placement) searched: on a CPU device no host tier (nothing would move), without an
    offload directory no disk tier; the parameters offloaded at stage 3 only."""
    configs = [(replace(base, stage=stage), StatePlacement.IN_MEMORY) for stage in (1, 2)]
    configs += [(replace(base, stage=3, prefetch=prefetch), StatePlacement.IN_MEMORY) for prefetch in (1, 0)]
    placements = [p for p in StatePlacement if p and not (host_is_device and not p.on_disk)]
    placements = [p for p in placements if not (p.on_disk and base.offload_dir is None)]
    for placement in placements:
        optimizer, params = placement.offload_optimizer, placement.offload_params
        if params == "none":
            for stage in (1, 2, 3):
                for fraction in OFFLOAD_FRACTIONS:
                    configs.append(
                        (replace(base, stage=stage, offload_optimizer=optimizer, offload_fraction=fraction), placement)
                    )
        else:
            for prefetch in (1, 0):
                configs.append(
                    (
                        replace(base, stage=3, prefetch=prefetch, offload_optimizer=optimizer, offload_params=params),
                        placement,
                    )
                )
    return configs


def _micro_batches(sample: Any, global_batch_size: int | None, world_size: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs: every divisor of a rank's share of the global batch, or the sample's
    own size when no global batch is asked for."""
    if global_batch_size is None:
        first = next(tensors_in(sample), None)
        if first is None or first.dim() == 0:
            raise ValueError("fit: the sample batch has no tensor with a batch dimension; pass one the model takes.")
        return [(first.shape[0], 1)]
    per_rank = global_batch_size // world_size
    return [(size, per_rank // size) for size in range(per_rank, 0, -1) if per_rank % size == 0]


class _ModelStates:
    """The model-state prediction of each config with the stage's and the step's working memory, once per
    config (the micro-batch does not change it)."""

    def __init__(
        self, units: list[UnitCount], largest_parameter: int, world_size: int, state_bytes: int, host_is_device: bool
    ):
        self.units, self.largest_parameter, self.world_size = units, largest_parameter, world_size
        self.state_bytes, self.host_is_device = state_bytes, host_is_device
        self.of = cache(self._of)

    def _of(self, config: ZeroConfig) -> tuple[int, int, int, int]:
        """(device, host, disk) bytes per rank, and of the device's the gradients that fill as the activations
        are freed (0 where they are kept all along)."""
        settings = EstimateSettings(
            self.world_size,
            config,
            optimizer_state_bytes_per_param=self.state_bytes,
            host_is_device=self.host_is_device,
        )
        report = estimate_units(self.units, settings)[config.stage]
        device, host = report.device_bytes + self._working_bytes(config, settings.shard_size), report.host_bytes
        if self.host_is_device:
            device, host = device + host, 0
        # Stages 2 and 3 make each unit's gradient shard in its backward (optimizer.zero_grad() frees them), as
        # its activations are freed; stage 1 keeps full gradients between steps. With offload on a GPU the
        # shards' copies are on the host: kept in the sum, which errs high.
        filling = report.gradient_bytes if config.stage >= 2 and (self.host_is_device or not host) else 0
        return device, host, report.nvme_bytes, filling

    def _working_bytes(self, config: ZeroConfig, shards: int) -> int:
        """What a step allocates beside the model states, on the device."""
        padded = [padded_numel(unit.numel, shards) for unit in self.units]
        others = sorted(padded[1:], reverse=True)
        precision = config.mixed_precision
        gathered = 0
        if config.stage == 3:  # the root, the unit computing and those prefetched: at most the largest others
            gathered = (padded[0] + sum(others[: 1 + config.prefetch])) * precision.compute_dtype.itemsize
        # One unit's full gradient being reduced while the next fills: at most the two largest.
        reducing = sum(sorted(padded, reverse=True)[:2]) * precision.reduce_dtype.itemsize if config.stage >= 2 else 0
        # Autograd makes a parameter's whole gradient before it is added into its unit's buffer.
        made_by_autograd = self.largest_parameter * precision.compute_dtype.itemsize
        offloaded = config.offload.offloaded_units([unit.trainable_numel for unit in self.units])
        shard_numels = [padded[i] // shards for i in range(len(self.units)) if i not in offloaded]
        # The step on the device: torch's Adam(W) makes one fp32 temporary of each tensor it steps (its denom).
        stepping = max(shard_numels, default=0) * STEP_TEMPORARY_BYTES if self.state_bytes else 0
        staged = 0
        if config.offload.optimizer is OffloadTier.NVME:  # nvme: the state of a few units in memory during the step
            in_files = sorted((padded[i] // shards for i in offloaded), reverse=True)
            staged = sum(in_files[: config.offload_units_in_memory]) * self.state_bytes
        return gathered + reducing + made_by_autograd + max(stepping, staged)


def _candidate(
    config: ZeroConfig,
    placement: StatePlacement,
    checkpointed: bool,
    micro_batch: int,
    accumulation: int,
    states: _ModelStates,
    activations: Callable[[int, bool], int],
    overhead_bytes: int,
) -> FitCandidate:
    device, host, disk, filling = states.of(config)
    # The activations' peak is at the start of backward; the gradients that fill meanwhile take their place.
    device += max(activations(micro_batch, checkpointed), filling) - filling + overhead_bytes
    return FitCandidate(config, placement, checkpointed, micro_batch, accumulation, PredictedPeak(device, host, disk))


def _choose(candidates: list[FitCandidate], budget: MemoryBudget, margin: float, blocks: tuple[str, ...]) -> FitResult:
    fitting = [index for index, candidate in enumerate(candidates) if not candidate.predicted.over(budget, margin)]
    if not fitting:
        raise ValueError(_nothing_fits(candidates, budget, margin))
    index = fitting[0]
    choice = candidates[index]
    if index > 0:  # the next cheaper, which lost on memory
        runner_up = candidates[index - 1]
        lost = "over the budget: " + "; ".join(runner_up.predicted.over(budget, margin))
    elif len(fitting) > 1:  # the cheapest fits: the next that fits, which lost on speed
        runner_up, lost = candidates[fitting[1]], "fits too, slower by the cost order"
    else:
        runner_up, lost = None, ""
    blocks = blocks if choice.activation_checkpointing else ()
    return FitResult(choice, runner_up, lost, budget, margin, blocks, tuple(candidates))


def _nothing_fits(candidates: list[FitCandidate], budget: MemoryBudget, margin: float) -> str:
    """The refusal: the smallest device budget any candidate fits (its other tiers within theirs), and with what."""
    # Never empty: the in-memory candidates hold nothing on the host or the disk.
    within_others = [c for c in candidates if not c.predicted.over(replace(budget, device=None), margin)]
    smallest = min(within_others, key=lambda candidate: (candidate.predicted.device, candidate.cost))
    needed = math.ceil(smallest.predicted.device / (1 - margin))
    disk = "" if any(c.placement.on_disk for c in candidates) else " Without offload_dir the disk tiers were not tried."
    return (
        f"fit: no configuration fits memory_budget ({described_budget(budget)} per rank, margin {margin:.0%}). "
        f"The smallest that fits is device {human_bytes(needed)} ({needed} bytes) per rank, with "
        f"{smallest.describe()}. Raise the budget, add ranks, or shorten the sequence.{disk}"
    )
