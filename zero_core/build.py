"""Building an engine's parts, in dependency order, each from constructor arguments.

Each part gets what it needs when it is made, and the engine (a facade) holds the result. A part that must
act at the edges of a forward is a ``PassListener``, subscribed right after it is made (``pass_listeners.py``).
The comm exists before the others (the setup's agreement and the shard groups' split run on it); the phase and
step a failed collective's message names are its ``progress``, given to the runtime and the optimizer step,
which move it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from . import agreement
from .checkpoint.background_save import BackgroundSave
from .checkpoint.save_and_load import CheckpointTarget
from .collectives import CommContext
from .config import ZeroConfig
from .engine_plans import EnginePlans, PassSettings
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
from .passes.prefetch_tuning import AutoPrefetch
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
    plans: EnginePlans,
    settings: ZeroConfig,
    optimizer: torch.optim.Optimizer | None,
    comm: CommContext,
    digests: ParameterDigests,
    param_init_fn: ParamInitFn | None,
) -> tuple[list[FlatUnit], OffloadFiles, CommContext]:
    """Every rank agrees on the setup (``settings``: the user's, which the agreement alone reads), then the
    comm is split into the groups it shards over (hybrid sharding, hpZ) and each unit is flattened and sharded
    over them (children first). Returns the units, their offload files and the split comm, the one every
    part after them runs on."""
    # Refused before the setup's collectives, alike on every rank.
    check_partition_activations(model, plans.passes.partition_activations, comm.tensor_parallel_size)
    on_meta = model_is_on_meta(model)
    if on_meta:
        check_meta_initialisable(model, param_init_fn)
    cut = plans.units
    unit_plans = plan_units(model, cut.wrap_policy, cut.bucket_numel)
    # Before any other collective: ranks that built different models, configs
    # or optimizers would hang, abort in the backend or train wrong values.
    setup = agreement.describe_setup(model, unit_plans, settings, optimizer)
    agreement.agree_on_setup(spanning_every_rank(comm), setup)
    # After the agreement: every rank has the same model and policy, so every rank refuses alike.
    check_wrap_classes_present(model, cut.wrap_policy)
    groups = plans.groups
    if groups.shard_group_size is not None:  # agreed above: every rank creates the same subgroups
        comm = comm.in_shard_groups(groups.shard_group_size)
    if groups.secondary_shard_group_size is not None:  # hpZ: inside each shard group
        comm = comm.with_secondary_groups(groups.secondary_shard_group_size)
    units: dict[int, FlatUnit] = {}
    plan_rooted_at = {id(plan.module): plan for plan in unit_plans}
    where = unit_offloads(unit_plans, plans, comm)
    files = _open_offload_files(unit_plans, where, plans, comm)
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
                cut.plan_for(_numel(plan)),
                plans.precision,
                comm,
                where[plan.index],
                comparisons=digests,
                param_files=files.params,
                state_files=files.optimizer,
                wire=plans.wire,
                # offload_step_in_backward: the reduce schedule asks each reduce whether it landed.
                polled_reduces=plans.offload.step_in_backward,
            )
            if files.optimizer is not None:
                files.optimizer.add_unit(units[plan.index])  # its master to its file now
    if files.optimizer is not None:
        files.optimizer.all_units_added()
    digests.track([units[i] for i in range(len(unit_plans))])
    return [units[i] for i in range(len(unit_plans))], files, comm


def _numel(plan: UnitPlan) -> int:
    return sum(local_shape(p).numel() for p in plan.params)  # this rank's pieces of split layers


def unit_offloads(unit_plans: list[UnitPlan], plans: EnginePlans, comm: CommContext) -> list[UnitOffload]:
    """Where each unit's tensors rest, by the offload plan: which units are offloaded (the largest first, up to
    offload_fraction of the trainable elements), and for each its stage's sharding at rest and the precision."""
    trainable = [sum(p.numel() for p in plan.params if p.requires_grad) for plan in unit_plans]
    offloaded = plans.offload.offloaded_units(trainable)
    low_precision, host_is_device = plans.precision.compute_dtype != torch.float32, comm.device.type == "cpu"
    return [
        plans.offload.for_unit(
            plan.index in offloaded,
            plans.units.plan_for(_numel(plan)).params_sharded_at_rest,
            low_precision,
            host_is_device,
        )
        for plan in unit_plans
    ]


def _open_offload_files(
    unit_plans: list[UnitPlan], where: list[UnitOffload], plans: EnginePlans, comm: CommContext
) -> OffloadFiles:
    """The file tiers the offload plan chose, the scratch directory sized from each unit's shard (padded as the
    layout pads) and where its tensors rest."""
    shards = [-(-_numel(plan) // comm.shard_size) for plan in unit_plans]
    compute_bytes = plans.precision.compute_dtype.itemsize
    return open_offload_files(plans.offload, where, shards, compute_bytes, plans.offload_dir, comm)


def _activation_hooks(model: nn.Module, units: list[FlatUnit], comm: CommContext, passes: PassSettings) -> list[Any]:
    """What forward keeps for backward: on the host, split across the tensor-parallel ranks, or both. Installed
    after the runtime's hooks: each unit's forward body runs under the offload context."""
    hooks: list[Any] = ActivationOffload(units).install() if passes.offload_activations else []
    if passes.partition_activations:
        hooks += PartitionedActivations(model, comm, passes.offload_activations).install()
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


def _checkpoint_target(
    model: nn.Module,
    units: list[FlatUnit],
    plans: EnginePlans,
    runtime: StepRuntime,
    optimizer_step: OptimizerStep,
    attachment: OptimizerAttachment,
    gradients: GradientReads,
    buffer_sync: BufferSync,
    loss_scaler: LossScaler | None,
    background: BackgroundSave,
) -> CheckpointTarget:
    """What a save or load works on: the parts it reads, the step's own barriers and resets, and the writer of
    asynchronous saves (over every rank, as checkpoints are agreed and written)."""
    in_backward = runtime.step_in_backward
    return CheckpointTarget(
        model,
        units,
        background.comm,
        attachment,
        loss_scaler,
        plans.stage,
        steps_taken=lambda: optimizer_step.steps_taken,
        quiesce=runtime.quiesce,
        quiesce_for_load=functools.partial(_quiesce_for_load, runtime),
        sync_buffers=buffer_sync.for_export,
        discard_grads=gradients.discard if in_backward is None else lambda: (in_backward.forget(), gradients.discard()),
        refresh_parameters=optimizer_step.refresh_parameters,
        background=background,
    )


def _model_hooks(
    model: nn.Module,
    units: list[FlatUnit],
    plans: EnginePlans,
    comm: CommContext,
    runtime: StepRuntime,
    listeners: PassListeners,
) -> tuple[BufferSync, list[Any]]:
    """The model's hooks around each pass, in their order: its parameters checked against the units
    (``model/changes.py``), the runtime's and the activations' hooks, rank 0's buffers broadcast as DDP does,
    then ``model.state_dict()`` and ``load_state_dict()`` over the shards (an export that raised midway is
    dropped at the next forward)."""
    listeners.subscribe(RegisteredParameters(model, units, runtime))
    hooks = runtime.install() + _activation_hooks(model, units, comm, plans.passes)
    buffer_sync = BufferSync(model, comm, plans.passes.broadcast_buffers, runtime)
    listeners.subscribe(buffer_sync)
    sharded_at_rest = plans.stage_plan.params_sharded_at_rest
    state_dict_hooks = StateDictHooks(model, units, runtime, sharded_at_rest, buffer_sync.for_export)
    hooks += state_dict_hooks.install()
    listeners.subscribe(state_dict_hooks)
    return buffer_sync, hooks


def build_parts(
    model: nn.Module,
    plans: EnginePlans,
    settings: ZeroConfig,
    optimizer: torch.optim.Optimizer | None,
    comm: CommContext,
    param_init_fn: ParamInitFn | None,
    owner: object | None = None,
) -> EngineParts:
    """Every part of an engine, each made from the plans it reads (``engine_plans.py``; ``settings``, the
    user's config they were derived from, goes to the setup's agreement alone); ``owner``: the engine over
    them, kept alive by the runtime (whose hooks the model holds)."""
    # Asked by every unit's guard for exact torch.equal at rest; told the units once they exist.
    digests = ParameterDigests()
    units, files, comm = build_units(model, plans, settings, optimizer, comm, digests, param_init_fn)
    loss_scaler = LossScaler(plans.loss_scaling, announce=comm.rank == 0) if plans.loss_scaling else None
    cast_buffers(model, plans.precision)
    broadcast_buffers(model, comm)
    input_cast = floating_inputs_cast(plans.precision.compute_dtype)  # the runtime's, at every unit call
    nvme = files.optimizer
    # offload_step_in_backward: steps offloaded units during backward, told by the runtime of each reduce and
    # by the attachment of each optimizer, asked by the optimizer step what it did.
    in_backward = StepInBackward(units, nvme, hybrid=comm.replicas > 1) if plans.offload.step_in_backward else None
    # Told at the edges of each forward, in the order subscribed below: the shard files' agreement, (before)
    # the parameters' check, the exports' reset, (before the root) the groups, the buffers' broadcast and rule.
    listeners = PassListeners()
    # Drives each forward and backward over the units; with fp16 a backward must start from a scaled loss.
    runtime = StepRuntime(
        units,
        plans.stage_plan,
        plans.passes,
        progress=comm.progress,
        listeners=listeners,
        step_in_backward=in_backward,
        requires_scaled_backward=loss_scaler is not None,
        input_cast=input_cast,
        owner=owner,
    )
    # offload_params="nvme" with some unit sharded: its files' reads agreed after each forward.
    param_files = files.params if files.params is not None and files.params.files else None
    if param_files is not None:
        listeners.subscribe(_ShardFilesAgreedAfterForward(param_files, runtime, comm))
    # Checkpoints are agreed and written over every rank; asynchronous saves' writes are collected at a step.
    background = BackgroundSave(spanning_every_rank(comm))
    # Its traffic counters start here: no collective runs between this and the end of the engine's constructor.
    optimizer_step = OptimizerStep(units, comm, runtime, plans.step, loss_scaler, nvme, param_files, background)
    names = canonical_names(units)
    gradients = GradientReads(units, comm, runtime, optimizer_step, loss_scaler)
    step_hooks = (optimizer_step.before, optimizer_step.after)
    attachment = OptimizerAttachment(units, comm, names, step_hooks, optimizer, gradients.discard, nvme, in_backward)
    listeners.subscribe(attachment)  # an optimizer.step() that raised midway left the groups showing the pieces
    buffer_sync, hooks = _model_hooks(model, units, plans, comm, runtime, listeners)
    hooks.append(ZeroGradRoute(gradients.discard).route_model(model))  # model.zero_grad(), as under DDP
    checkpoints = _checkpoint_target(
        model, units, plans, runtime, optimizer_step, attachment, gradients, buffer_sync, loss_scaler, background
    )
    return EngineParts(
        comm,
        units,
        digests,
        names,
        loss_scaler,
        runtime.auto_prefetch,
        runtime,
        optimizer_step,
        attachment,
        gradients,
        buffer_sync,
        checkpoints,
        hooks,
    )
