"""Building an engine's parts, in dependency order, each from constructor arguments.

Each part gets what it needs when it is made, and the engine (a facade) holds the result. A part that must
act at the edges of a forward is a ``PassListener``, subscribed right after it is made (``pass_listeners.py``).
One thing is set afterwards: the comm's ``position``, the phase and step a failed collective's message names,
read from the runtime and the optimizer step; the comm exists before them (the setup's agreement and the
shard groups' split run on it).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from . import agreement
from .checkpoint.save_and_load import CheckpointTarget
from .collectives import CommContext, Position
from .config import ZeroConfig
from .mesh import spanning_every_rank
from .model.buffers import BufferSync, broadcast_buffers, cast_buffers, floating_inputs_cast
from .model.changes import RegisteredParameters
from .model.meta_init import (
    MetaMaterialiser,
    ParamInitFn,
    check_meta_initialisable,
    construction_order,
    model_is_on_meta,
)
from .model.state_dict_hooks import StateDictHooks
from .offload.opening import OffloadFiles, open_offload_files
from .offload.shard_files import ShardFiles
from .offload_plan import UnitOffload
from .optim.attachment import OptimizerAttachment
from .optim.loss_scaling import LossScaler
from .optim.rebuild import canonical_names
from .optim.zero_grad_routes import ZeroGradRoute
from .pass_listeners import PassListener, PassListeners
from .passes.activation_offload import ActivationOffload
from .passes.gradient_reads import GradientReads
from .passes.optimizer_step import OptimizerStep
from .passes.partitioned_activations import PartitionedActivations, check_partition_activations
from .passes.prefetch_tuning import UNTUNED_DEPTH, AutoPrefetch
from .passes.runtime import StepRuntime
from .passes.step_in_backward import StepInBackward
from .unit import FlatUnit, ParameterDigests, UnitPlan, check_wrap_classes_present, plan_units
from .unit.dtensor_params import local_shape


class EngineParts(NamedTuple):
    comm: CommContext
    units: list[FlatUnit]
    digests: ParameterDigests
    canonical_names: dict[int, str]  # id(parameter) -> its first name in the model
    loss_scaler: LossScaler | None
    auto_prefetch: AutoPrefetch | None
    runtime: StepRuntime
    optimizer_step: OptimizerStep
    optimizer: OptimizerAttachment  # no optimizer attached yet: the engine attaches the user's
    gradients: GradientReads
    buffer_sync: BufferSync
    checkpoints: CheckpointTarget
    hooks: list[Any]  # every hook handle the parts installed on the model


def model_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for tensor in list(model.parameters()) + list(model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_units(
    model: nn.Module,
    config: ZeroConfig,
    optimizer: torch.optim.Optimizer | None,
    comm: CommContext,
    digests: ParameterDigests,
    param_init_fn: ParamInitFn | None,
) -> tuple[list[FlatUnit], OffloadFiles]:
    """Every rank agrees on the setup, then each unit is flattened and sharded (children first)."""
    on_meta = model_is_on_meta(model)
    if on_meta:
        check_meta_initialisable(model, param_init_fn)
    plans = plan_units(model, config.wrap_policy, config.bucket_numel)
    # Before any other collective: ranks that built different models, configs
    # or optimizers would hang, abort in the backend or train wrong values.
    agreement.agree_on_setup(spanning_every_rank(comm), agreement.describe_setup(model, plans, config, optimizer))
    # After the agreement: every rank has the same model and policy, so every rank refuses alike.
    check_wrap_classes_present(model, config.wrap_policy)
    if config.shard_group_size is not None:  # agreed above: every rank creates the same subgroups
        comm.split(config.shard_group_size)
    if config.secondary_shard_group_size is not None:  # hpZ: inside each shard group
        comm.split_secondary(config.secondary_shard_group_size)
    units: dict[int, FlatUnit] = {}
    plan_rooted_at = {id(plan.module): plan for plan in plans}
    where = unit_offloads(plans, config, comm)
    files = _open_offload_files(plans, where, config, comm)
    materialiser = MetaMaterialiser(model, comm.device, param_init_fn) if on_meta else None
    # In construction order (children first, in registration order): a meta model's modules are
    # initialised as eager construction initialises them (the same seed gives the same weights),
    # and each unit is flattened once its root module is reached, everything under it initialised.
    # Only the modules of enclosing units reached earlier (the root unit's embeddings) wait unsharded.
    for module in construction_order(model):
        if materialiser is not None:
            materialiser.initialise(module)
        plan = plan_rooted_at.get(id(module))
        if plan is not None:
            units[plan.index] = FlatUnit(
                plan,
                config.unit_plan(_numel(plan)),
                config.mixed_precision,
                comm,
                where[plan.index],
                comparisons=digests,
                param_files=files.params,
                state_files=files.optimizer,
                wire=config.wire,
            )
            if files.optimizer is not None:
                files.optimizer.add_unit(units[plan.index])  # its master to its file now
    if files.optimizer is not None:
        files.optimizer.all_units_added()
    digests.track([units[i] for i in range(len(plans))])
    return [units[i] for i in range(len(plans))], files


def _numel(plan: UnitPlan) -> int:
    return sum(local_shape(p).numel() for p in plan.params)  # this rank's pieces of split layers


def unit_offloads(plans: list[UnitPlan], config: ZeroConfig, comm: CommContext) -> list[UnitOffload]:
    """Where each unit's tensors rest, by the offload plan: which units are offloaded (the largest first, up to
    offload_fraction of the trainable elements), and for each its stage's sharding at rest and the precision."""
    trainable = [sum(p.numel() for p in plan.params if p.requires_grad) for plan in plans]
    offloaded = config.offload.offloaded_units(trainable)
    low_precision, host_is_device = config.mixed_precision.compute_dtype != torch.float32, comm.device.type == "cpu"
    return [
        config.offload.for_unit(
            plan.index in offloaded,
            config.unit_plan(_numel(plan)).params_sharded_at_rest,
            low_precision,
            host_is_device,
        )
        for plan in plans
    ]


def _open_offload_files(
    plans: list[UnitPlan], where: list[UnitOffload], config: ZeroConfig, comm: CommContext
) -> OffloadFiles:
    """The file tiers the offload plan chose, the scratch directory sized from each unit's shard (padded as the
    layout pads) and where its tensors rest."""
    shards = [-(-_numel(plan) // comm.shard_size) for plan in plans]
    compute_bytes = config.mixed_precision.compute_dtype.itemsize
    return open_offload_files(config.offload, where, shards, compute_bytes, config.offload_dir, comm)


def _activation_hooks(model: nn.Module, units: list[FlatUnit], comm: CommContext, config: ZeroConfig) -> list[Any]:
    """What forward keeps for backward: on the host, split across the tensor-parallel ranks, or both. Installed
    after the runtime's hooks: each unit's forward body runs under the offload context."""
    hooks: list[Any] = ActivationOffload(units).install() if config.offload_activations else []
    if config.partition_activations:
        hooks += PartitionedActivations(model, comm, config.offload_activations).install()
    return hooks


class _ShardFilesAgreedAfterForward(PassListener):
    """offload_params="nvme" with some unit sharded: a failed read or write of a shard's file is raised alike
    on every rank at the end of each forward, before its output is used. Not after a forward inside
    gathered_parameters(): it reads no file, and may run on one rank only; the next agreement raises."""

    def __init__(self, param_files: ShardFiles, runtime: StepRuntime, comm: CommContext):
        self.param_files, self.runtime, self.comm = param_files, runtime, comm

    def after_root_forward(self) -> None:
        if not self.runtime.suspended:
            self.param_files.agree(self.comm, "at the end of a forward")


def _quiesce_for_load(runtime: StepRuntime, model_and_optimizer: bool) -> None:
    """The entry barrier of a load: between an early step and optimizer.step(), or after a half-applied one,
    only a load of both the model and the optimizer's state (which replaces what stepped), once the worker
    is done."""
    runtime.quiesce(model_access=False)
    if runtime.step_in_backward is not None:
        runtime.step_in_backward.before_load(model_and_optimizer)


def _step_runtime(
    units: list[FlatUnit],
    config: ZeroConfig,
    comm: CommContext,
    loss_scaler: LossScaler | None,
    listeners: PassListeners,
    in_backward: StepInBackward | None,
    owner: object | None,
) -> tuple[StepRuntime, AutoPrefetch | None]:
    """The runtime that drives each forward and backward over the units: its prefetch depth (measured and
    tuned with prefetch="auto"), the inputs' cast to the compute dtype, whether a backward must start from
    a scaled loss (fp16), who is told at the edges of each forward, and offload_step_in_backward's worker."""
    auto_prefetch = None
    if config.prefetch == "auto":
        auto_prefetch = AutoPrefetch.for_units(units, config.prefetch_cap_mb, comm.device)
    compute_dtype = config.mixed_precision.compute_dtype
    input_cast = floating_inputs_cast(compute_dtype) if compute_dtype != torch.float32 else None
    runtime = StepRuntime(
        units,
        config.plan,
        UNTUNED_DEPTH if auto_prefetch else config.prefetch,
        listeners=listeners,
        step_in_backward=in_backward,
        auto_prefetch=auto_prefetch,
        requires_scaled_backward=loss_scaler is not None,
        input_cast=input_cast,
        owner=owner,
    )
    return runtime, auto_prefetch


def _model_hooks(
    model: nn.Module,
    units: list[FlatUnit],
    config: ZeroConfig,
    comm: CommContext,
    runtime: StepRuntime,
    listeners: PassListeners,
) -> tuple[BufferSync, list[Any]]:
    """The model's hooks around each pass, in their order: its parameters checked against the units
    (``model/changes.py``), the runtime's and the activations' hooks, rank 0's buffers broadcast as DDP does,
    then ``model.state_dict()`` and ``load_state_dict()`` over the shards (an export that raised midway is
    dropped at the next forward)."""
    listeners.subscribe(RegisteredParameters(model, units, runtime))
    hooks = runtime.install() + _activation_hooks(model, units, comm, config)
    buffer_sync = BufferSync(model, comm, config.broadcast_buffers, runtime)
    listeners.subscribe(buffer_sync)
    sharded_at_rest = config.plan.params_sharded_at_rest
    state_dict_hooks = StateDictHooks(model, units, runtime, sharded_at_rest, buffer_sync.for_export)
    hooks += state_dict_hooks.install()
    listeners.subscribe(state_dict_hooks)
    return buffer_sync, hooks


def build_parts(
    model: nn.Module,
    config: ZeroConfig,
    optimizer: torch.optim.Optimizer | None,
    comm: CommContext,
    param_init_fn: ParamInitFn | None,
    owner: object | None = None,
) -> EngineParts:
    """Every part of an engine, each made from what it needs; ``owner``: the engine over them, kept alive by
    the runtime (whose hooks the model holds)."""
    # Asked by every unit's guard for exact torch.equal at rest; told the units once they exist.
    digests = ParameterDigests()
    check_partition_activations(model, config, comm.tensor_parallel_size)  # before the setup's collectives
    units, files = build_units(model, config, optimizer, comm, digests, param_init_fn)
    loss_scaler = LossScaler(config, announce=comm.rank == 0) if config.mixed_precision.uses_loss_scaling else None
    cast_buffers(model, config.mixed_precision)
    broadcast_buffers(model, comm)
    nvme = files.optimizer
    # offload_step_in_backward: the worker that steps offloaded units during backward, told by the runtime of
    # each reduce and by the attachment of each optimizer, asked by the optimizer step for what it did, and
    # refusing what may not run in between.
    in_backward = StepInBackward(units, nvme, hybrid=comm.replicas > 1) if config.steps_in_backward else None
    # Told at the edges of each forward, in the order subscribed below: the shard files' agreement, then
    # (before) the parameters' check and the exports' reset, (before the root) the optimizer's groups and
    # the buffers' broadcast, (after the root) the buffers' rule.
    listeners = PassListeners()
    runtime, auto_prefetch = _step_runtime(units, config, comm, loss_scaler, listeners, in_backward, owner)
    # offload_params="nvme" with some unit sharded: its files' reads agreed after each forward.
    param_files = files.params if files.params is not None and files.params.files else None
    if param_files is not None:
        listeners.subscribe(_ShardFilesAgreedAfterForward(param_files, runtime, comm))
    # Its traffic counters start here: no collective runs between this and the end of the engine's constructor.
    optimizer_step = OptimizerStep(units, comm, runtime, config, loss_scaler, auto_prefetch, nvme, param_files)
    comm.position = lambda: Position(runtime.state.name.lower().replace("_", "-"), optimizer_step.steps_taken)
    names = canonical_names(units)
    gradients = GradientReads(units, comm, runtime, optimizer_step, loss_scaler)
    step_hooks = (optimizer_step.before, optimizer_step.after)
    attachment = OptimizerAttachment(units, comm, names, step_hooks, optimizer, gradients.discard, nvme, in_backward)
    listeners.subscribe(attachment)  # an optimizer.step() that raised midway left the groups showing the pieces
    buffer_sync, hooks = _model_hooks(model, units, config, comm, runtime, listeners)
    hooks.append(ZeroGradRoute(gradients.discard).route_model(model))  # model.zero_grad(), as under DDP
    checkpoints = CheckpointTarget(
        model,
        units,
        spanning_every_rank(comm),
        attachment,
        loss_scaler,
        config.stage,
        steps_taken=lambda: optimizer_step.steps_taken,
        quiesce=runtime.quiesce,
        quiesce_for_load=functools.partial(_quiesce_for_load, runtime),
        sync_buffers=buffer_sync.for_export,
        discard_grads=gradients.discard if in_backward is None else lambda: (in_backward.forget(), gradients.discard()),
        refresh_parameters=optimizer_step.refresh_parameters,
    )
    return EngineParts(
        comm,
        units,
        digests,
        names,
        loss_scaler,
        auto_prefetch,
        runtime,
        optimizer_step,
        attachment,
        gradients,
        buffer_sync,
        checkpoints,
        hooks,
    )
