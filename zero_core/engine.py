"""``ZeroEngine``: the plain-PyTorch entry point to ZeRO stages 1, 2 and 3.

Communication plan per optimizer step (Ψ parameters, N ranks):

- stage 1: gradients accumulate in full on every rank; at the accumulation
  boundary each unit is reduce-scattered (Ψ) as soon as its backward ends;
  the optimizer updates this rank's fp32 shard; the updated shards are
  all-gathered (Ψ) back into the full parameters.
- stage 2: as stage 1, but every micro-batch reduce-scatters each unit
  during backward and keeps only the gradient shard.
- stage 3: parameters are sharded at rest; each unit is all-gathered before
  its forward (Ψ) and again before its backward (Ψ), released after each,
  and its gradients are reduce-scattered (Ψ) when its backward ends.

The model is sharded in place and keeps being called as before; the
optimizer object is rebuilt in place over this rank's fp32 shard, so
``optimizer.step()`` and schedulers keep working. Gradients are consumed by
the optimizer step (there is nothing left for ``zero_grad`` to clear).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from . import full_params, grad_ops, setup_agreement
from .accounting import MemoryReport, StorageCounter, UnitReport
from .buffers import broadcast_buffers, cast_buffers
from .collectives import CommContext, CommStats, Position
from .config import ZeroConfig
from .engine_checkpoints import CheckpointMethods
from .flat_unit import FlatUnit
from .meta_init import ParamInitFn, check_meta_initialisable, materialize_modules, model_is_on_meta
from .model_changes import RegisteredParameters
from .optim import canonical_names, check_optimizer_supported, reset_optimizer_state
from .param_groups import OptimizerGroups
from .parameter_digests import ParameterDigests
from .precision import DynamicLossScaler
from .prefetch_tuning import UNTUNED_DEPTH, AutoPrefetch, PrefetchReport
from .runtime import StepRuntime, TrainingState
from .state_dict_hooks import StateDictHooks
from .units import plan_units

# Which engine has sharded a model, so a model is never sharded twice.
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, ZeroEngine]" = weakref.WeakKeyDictionary()
# Optimizers of unsharded engines -> the hooks that keep them refusing to step (and their
# state_dict() working) until an engine attaches them again.
_RETIRED_OPTIMIZERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]]" = weakref.WeakKeyDictionary()


def engine_of(model: nn.Module) -> "ZeroEngine | None":
    """The engine that sharded ``model``, if any."""
    return _ENGINES.get(model)


def engine_owning(module: nn.Module) -> "tuple[ZeroEngine, str] | None":
    """The engine whose model contains ``module``, and the module's name in that model."""
    for engine in list(_ENGINES.values()):
        for name, candidate in engine.model.named_modules():
            if candidate is module:
                return engine, name
    return None


def _refuse_step_after_unshard(*_: Any) -> None:
    raise RuntimeError(
        "This optimizer was rebuilt over ZeRO shards, and engine.unshard() gave the model back: its state no "
        "longer matches the model's parameters. Make a new optimizer over model.parameters()."
    )


def _model_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for tensor in list(model.parameters()) + list(model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ZeroEngine(CheckpointMethods):
    """Shard ``model`` and ``optimizer`` in place and drive them.

    Typical loop (launched with torchrun, process group initialised)::

        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3))
        for batch in loader:
            loss = loss_fn(model(batch.x), batch.y)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()

    Gradient accumulation: call ``backward`` per micro-batch and ``step`` at
    the boundary; wrap non-boundary micro-batches in ``engine.no_sync()`` so
    stage 1 skips their communication (stages 2 and 3 reduce every
    micro-batch by design).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: ZeroConfig | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        param_init_fn: ParamInitFn | None = None,
    ):
        self.config = config = config if config is not None else ZeroConfig()
        if not isinstance(config, ZeroConfig):
            raise ValueError("config must be a zero_core.ZeroConfig, for example ZeroConfig(stage=3).")
        if engine_of(model) is not None:
            raise ValueError(
                "This model is already sharded by a ZeroEngine. Reuse it (zero_core.engine_of(model)), "
                "or call its unshard() first to shard it again with other settings."
            )
        if optimizer is not None:
            check_optimizer_supported(optimizer)
        on_meta = model_is_on_meta(model)
        if on_meta:
            check_meta_initialisable(model, param_init_fn)
        self.model = model
        self.optimizer: torch.optim.Optimizer | None = None
        self._groups: OptimizerGroups | None = None  # the optimizer's groups by name, and which view they show
        self.comm = CommContext.create(process_group, _model_device(model, device))
        plans = plan_units(model, config.wrap_policy, config.bucket_numel)
        # Before any other collective: ranks that built different models, configs
        # or optimizers would hang, abort in the backend or train wrong values.
        setup_agreement.agree_on_setup(self.comm, setup_agreement.describe_setup(model, plans, config, optimizer))
        if config.shard_group_size is not None:  # agreed above: every rank creates the same subgroups
            self.comm.split(config.shard_group_size)
        self._optimizer_agreed_at_setup = optimizer  # attach_optimizer need not ask again
        units: dict[int, FlatUnit] = {}
        # Children first: a parameter owned by an ancestor (shared between
        # children) is materialised with the children before the ancestor flattens.
        for plan in reversed(plans):
            if on_meta:
                materialize_modules(plan.modules, self.comm.device, param_init_fn)
            numel = sum(p.numel() for p in plan.params)
            units[plan.index] = FlatUnit(plan, config.unit_plan(numel), config.mixed_precision, self.comm)
        self.units = [units[i] for i in range(len(plans))]
        self._canonical_names = canonical_names(self.units)
        self._digests = ParameterDigests(self.units)
        for unit in self.units:
            unit.guard.digests = self._digests
        cast_buffers(model, config.mixed_precision)
        broadcast_buffers(self.model, self.comm)
        self.loss_scaler = (
            DynamicLossScaler(config.mixed_precision) if config.mixed_precision.uses_loss_scaling else None
        )
        self._grads_unscaled = False
        self.auto_prefetch: AutoPrefetch | None = None
        if config.prefetch == "auto":
            self.auto_prefetch = AutoPrefetch.for_units(self.units, config.prefetch_cap_mb, self.comm.device)
        self.runtime = StepRuntime(self.units, config.plan, UNTUNED_DEPTH if self.auto_prefetch else config.prefetch)
        self.runtime.auto_prefetch = self.auto_prefetch
        self.runtime.requires_scaled_backward = self.loss_scaler is not None
        self.comm.position = lambda: Position(self.runtime.state.name.lower().replace("_", "-"), self.steps_taken)
        self.runtime.before_outermost_forward.append(RegisteredParameters(model, self.units, self.runtime).check)
        self.runtime.before_root_forward.append(self._before_root_forward)
        if config.mixed_precision.compute_dtype != torch.float32:
            self.runtime.input_cast = self._cast_inputs
        self.runtime.after_root_forward.append(self._after_root_forward)
        self._sync_buffers_next_forward = True
        self._hooks = self.runtime.install()
        self.state_dict_hooks = StateDictHooks(self)
        self._hooks += self.state_dict_hooks.install()
        # An export that raised midway must not outlive the next forward.
        self.runtime.before_outermost_forward.append(self.state_dict_hooks.clear_exports)
        self._optimizer_hooks: list[Any] = []
        if optimizer is not None:
            self.attach_optimizer(optimizer)
        self._skip_refresh = False
        self.steps_taken = 0  # optimizer steps applied (overflow-skipped ones not counted)
        self._step_calls = 0  # optimizer steps called (overflow-skipped ones too), compared across ranks
        self._traffic_at_last_step = self.comm.stats.snapshot()
        self.last_step_traffic = CommStats.difference(self._traffic_at_last_step, self._traffic_at_last_step)
        self._span_traffic_at_last_step = self.comm.stats.span_snapshot()
        self.last_step_traffic_by_span = CommStats.difference(
            self._span_traffic_at_last_step, self._span_traffic_at_last_step
        )
        _ENGINES[model] = self

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebuild ``optimizer`` (made over the model's parameters) over this rank's shards.

        The constructor does this for the optimizer it is given; call it to
        train an engine built without one, or with a fresh optimizer.
        """
        check_optimizer_supported(optimizer)
        for handle in _RETIRED_OPTIMIZERS.pop(optimizer, []):  # never stepped (checked above): usable again
            handle.remove()
        if optimizer is not self._optimizer_agreed_at_setup:
            described = setup_agreement.describe_optimizer(optimizer, self._canonical_names)
            setup_agreement.agree_on_setup(self.comm, described)
        self._optimizer_agreed_at_setup = None
        for handle in self._optimizer_hooks:
            handle.remove()
        groups = OptimizerGroups(optimizer, self.units)  # refuses foreign or repeated tensors
        groups.show_pieces()
        reset_optimizer_state(optimizer)
        groups.show_model_parameters()
        self._groups = groups
        self.optimizer = optimizer
        self._optimizer_hooks = [
            optimizer.register_step_pre_hook(lambda _, args, kwargs: self._before_optimizer_step(args, kwargs)),
            optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step()),
            *groups.install_hooks(),
        ]

    # --------------------------------------------------------------- facts
    @property
    def param_group_names(self) -> list[list[str]]:
        """Each optimizer group's parameters by name (every rank alike): how checkpoints
        refer to them. Read from the groups as they are now, so a save or load right
        after ``optimizer.add_param_group`` sees the new group."""
        return self._read_param_groups()

    def _read_param_groups(self) -> list[list[str]]:
        return self._groups.read() if self._groups is not None else []

    def _agree_on_changed_param_groups(self, settings_differ: bool) -> None:
        """Groups added or replaced since they were last compared (progressive unfreezing), or
        hyperparameters that differ between ranks (the step agreement's checksum), are compared
        across ranks field by field: the same ValueError on every rank names the difference.
        Every rank decides alike: the step agreement found the same group names everywhere."""
        if self._groups is not None and (settings_differ or self._groups.changed_since_compared):
            self._compare_param_groups()

    def _compare_param_groups(self) -> None:
        """Every rank's groups (by name) and hyperparameters alike, or the same ValueError everywhere.
        Every rank must call it together."""
        assert self.optimizer is not None and self._groups is not None
        setup_agreement.agree_on_setup(
            self.comm, setup_agreement.describe_optimizer(self.optimizer, {}, self._groups.names)
        )
        self._groups.mark_compared()

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def prefetch_report(self) -> PrefetchReport | None:
        """With ``prefetch="auto"``: the measured gather and compute times and the chosen depth."""
        return self.auto_prefetch.report() if self.auto_prefetch is not None else None

    @property
    def persistent_units(self) -> list[str]:
        """Stage 3: the units kept gathered between steps (``persistence_threshold``), by module path."""
        plan = self.config.plan
        return [unit.name for unit in self.units if unit.stage_plan != plan]

    @property
    def shard_group_size(self) -> int:
        """How many ranks share one copy of the model state (the world size unless hybrid sharding)."""
        return self.comm.shard_size

    @property
    def num_parameters(self) -> int:
        """Unique parameters of the model (its true size, also in stage 3)."""
        return sum(unit.layout.total_numel for unit in self.units)

    @property
    def num_trainable_parameters(self) -> int:
        return sum(s.numel for u in self.units for s, p in zip(u.layout.slots, u.params) if p.requires_grad)

    @property
    def comm_stats(self) -> CommStats:
        """Collective calls, elements and bytes since creation (or ``comm_stats.reset()``).

        ``last_step_traffic`` holds the same per kind for the last optimizer
        step alone (everything since the step before it), and
        ``last_step_traffic_by_span`` per :class:`~zero_core.collectives.Span`
        (inside the shard group, across shard groups, every rank).
        """
        return self.comm.stats

    @property
    def peak_live_units(self) -> int:
        """Most units gathered (or gathering) at once since the last reset (stage 3)."""
        return self.runtime.peak_live_units

    def reset_peak_live_units(self) -> None:
        self.runtime.peak_live_units = 0

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # ------------------------------------------------ adapters and reports
    # What the Lightning and Accelerate adapters and the tests need from the engine, so that none
    # of them reaches into its parts (the step runtime, the loss scaler, the units), whose shape
    # may change. The reports are read-only.
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (``loss`` itself without loss scaling): for adapters
        that scale the loss in one place and run the backward in another (Lightning's
        ``pre_backward``); ``backward_scaled`` or ``expect_scaled_backward`` then runs it."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    def expect_scaled_backward(self) -> None:
        """The next backward, which the caller runs itself (a LightningModule's own ``backward``),
        starts from a loss ``scale_loss`` scaled. Under fp16 a backward nobody announced is
        refused (``UnscaledBackwardError``): its gradients would be off by the loss scale."""
        self.runtime.announce_scaled_backward()

    def discard_failed_pass(self) -> None:
        """After a forward or backward that raised was caught: release what it gathered and forget
        it now rather than at the next forward or step, which would do the same (with the same
        warning if stage 1 had to discard the gradients accumulated since the last step).
        Nothing happens when no pass failed. Every rank whose pass failed calls it."""
        self.runtime.settle()

    @property
    def training_state(self) -> TrainingState:
        """Where the step is: ``IDLE`` between passes, ``PRE_BACKWARD`` after a forward with grad
        whose backward has not run yet, ``FORWARD``/``BACKWARD`` inside one."""
        return self.runtime.state

    @property
    def prefetch_depth(self) -> int:
        """Stage 3: how many units are all-gathered ahead of the running one now. With
        ``prefetch="auto"`` it changes at optimizer steps (``prefetch_report()`` says why)."""
        return self.runtime.prefetch

    @property
    def execution_order_changes(self) -> int:
        """How many forwards or backwards ran the units in another order than the pass before
        (stage 3 prefetches in the last order seen, so each change costs exposed gathers)."""
        return self.runtime.order.changes

    def unit_reports(self) -> list[UnitReport]:
        """Each unit as it is now, in unit order: its size, padded size (what its collectives
        move), whether it persists (stage 3) and whether its post-step all-gather may still be
        writing its parameters (stages 1/2 with ``overlap_param_refresh``; waited for when touched)."""
        return [
            UnitReport(
                name=unit.name,
                numel=sum(slot.numel for slot in unit.layout.slots),
                padded_numel=unit.layout.padded_numel,
                persistent=unit.stage_plan != self.config.plan,  # as persistent_units
                refreshing=unit.refreshing,
            )
            for unit in self.units
        ]

    # ------------------------------------------------------------- forward
    def _before_root_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._groups is not None:
            self._groups.show_model_parameters()  # an optimizer.step() that raised midway left the pieces in
        if self.config.broadcast_buffers and self._sync_buffers_next_forward:
            broadcast_buffers(self.model, self.comm)
        return args, kwargs

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Floating inputs of every unit arrive in the compute dtype (as FSDP2's cast_forward_inputs)."""
        dtype = self.config.mixed_precision.compute_dtype
        cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
        return pytree.tree_map(cast, (args, kwargs))

    def _after_root_forward(self) -> None:
        # DDP's rule: the next forward syncs buffers only if this one was a
        # synchronising training forward (not no_grad, not inside no_sync).
        self._sync_buffers_next_forward = torch.is_grad_enabled() and self.runtime.require_grad_sync

    def sync_buffers_for_export(self) -> None:
        """Exports hold rank 0's buffers (DDP's rule), which the next forward would broadcast anyway."""
        if self.config.broadcast_buffers:
            broadcast_buffers(self.model, self.comm)

    # ------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, with fp16 loss scaling when enabled."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        self.backward_scaled(loss, **kwargs)

    def backward_scaled(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` for a loss the caller already scaled (adapters that scale themselves)."""
        self.runtime.announce_scaled_backward()
        if "inputs" in kwargs:
            loss.backward(**kwargs)
            return
        # Stage 3: unit outputs that other ranks' losses use and this one does
        # not get zero gradients, so every rank gathers the same units in the
        # same order (forward_records.py).
        roots, grads = self.runtime.backward_roots(loss)
        grads[0] = kwargs.pop("gradient", None)
        torch.autograd.backward(roots, grads, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip gradient communication where the stage allows (stage 1)."""
        previous = self.runtime.require_grad_sync
        self.runtime.require_grad_sync = False
        try:
            yield
        finally:
            self.runtime.require_grad_sync = previous

    def set_gradient_sync(self, enabled: bool) -> None:
        self.runtime.require_grad_sync = enabled

    # ----------------------------------------------------------- gradients
    def _settle_gradients(self, *, drop_pending_forward: bool = False) -> None:
        """Before the accumulated gradients are read or changed: clean up after a pass that raised,
        and (hybrid sharding) all-reduce across groups what was reduced only inside each group
        since the last synchronising backward. Every rank calls it at the same points."""
        self.runtime.settle(drop_pending_forward=drop_pending_forward)
        self.runtime.reduce_across_groups()

    def _unscale_grads_once(self) -> None:
        if self.loss_scaler is None or self._grads_unscaled:
            return
        grad_ops.scale_grads(self.units, 1.0 / self.loss_scaler.scale)
        self._grads_unscaled = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over all shards, as ``torch.nn.utils.clip_grad_norm_`` on the full model."""
        self._settle_gradients()
        self._unscale_grads_once()
        return grad_ops.clip_grad_norm(self.units, self.comm, max_norm, float(norm_type))

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
        """Gradient norms as Lightning's ``grad_norm`` reports them, from the shards.

        ``{"grad_2.0_norm/<name>": ..., "grad_2.0_norm_total": ...}`` over every
        parameter some rank has a gradient for, by its canonical name, for the
        gradients reduced since the last step (after a synchronising backward;
        unscaled under fp16, without touching the gradients). ``param.grad``
        does not hold them (see the README): every rank must call this.
        """
        self._settle_gradients()
        scaled = self.loss_scaler is not None and not self._grads_unscaled
        factor = 1.0 / self.loss_scaler.scale if scaled else 1.0
        norm_type = float(norm_type)
        norms = grad_ops.grad_norms(self.units, self.comm, norm_type, factor)
        prefix = f"grad_{norm_type}_norm"
        result = {f"{prefix}/{name}": value for name, value in norms.items()}
        if norms:
            result[f"{prefix}_total"] = grad_ops.total_norm(list(norms.values()), norm_type)
        return result

    def canonical_name(self, param: torch.Tensor) -> str | None:
        """The name ``grad_norms`` and checkpoints use for a parameter (its first name in the model)."""
        return self._canonical_names.get(id(param))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_``."""
        self._settle_gradients()
        self._unscale_grads_once()
        grad_ops.clip_grad_value(self.units, clip_value)

    def zero_grad(self) -> None:
        """Discard accumulated gradients without stepping."""
        self.runtime.settle()
        for unit in self.units:
            unit.reset_grads()
        self._grads_unscaled = False

    # ---------------------------------------------------------------- step
    def step(self) -> None:
        """``optimizer.step()``: the optimizer's own step runs the same ZeRO logic."""
        if self.optimizer is None:
            raise RuntimeError("This engine was built without an optimizer; pass one to attach_optimizer().")
        self.optimizer.step()

    def _before_optimizer_step(self, args: tuple = (), kwargs: dict | None = None) -> None:
        # torch hands step pre-hooks the step's own arguments, the optimizer first.
        closure = (kwargs or {}).get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:
            # The step's agreement and reductions run before the optimizer's own step, which
            # would then call the closure's forward and backward too late for this update.
            raise ValueError(
                "optimizer.step(closure) is not supported under ZeRO: run the closure first "
                "(loss = closure(), which calls engine.backward), then optimizer.step()."
            )
        # A forward whose backward never ran (a skipped batch) ends here.
        self._settle_gradients(drop_pending_forward=True)
        self._finish_refresh()  # a step with no forward since the last: its all-gathers still read the shards
        self._skip_refresh = False
        self._step_calls += 1
        # Groups added or replaced since the last step train from this one. A refused group is reported
        # after the step agreement, so a rank that alone added one does not leave the others waiting.
        assert self._groups is not None
        refused_group = None
        try:
            self._groups.read()
        except ValueError as error:
            refused_group = error
        if self.loss_scaler is not None:
            self._unscale_grads_once()
        counters = {
            "forwards with grad": self.runtime.forwards,
            "backwards": self.runtime.backwards,
            "optimizer steps": self._step_calls,
            "units reduced, as a sum of unit numbers (ranks froze different parameters?)": (
                self.runtime.reduces.issued_fingerprint
            ),
            "optimizer param groups (add_param_group on some ranks only?)": len(self._groups.names),
            "optimizer param groups, as a checksum of their parameter names": self._groups.fingerprint,
            "refused add_param_group calls": int(refused_group is not None),
        }
        # Hyperparameters only report a difference; the comparison below then names it.
        settings = {"optimizer hyperparameters": self._groups.settings_fingerprint}
        agreement = grad_ops.agree_on_step(
            self.units, self.comm, counters, check_finite=self.loss_scaler is not None, checks=settings
        )
        if refused_group is not None:
            raise refused_group
        self._agree_on_changed_param_groups(settings_differ=agreement.checks_differ)
        if self.auto_prefetch is not None:
            depth = self.auto_prefetch.on_optimizer_step(self.comm)
            if depth is not None:
                self.runtime.prefetch = depth
        if self.loss_scaler is not None:
            self.loss_scaler.update(agreement.found_inf)
            if agreement.found_inf:
                # With no .grad anywhere the optimizer leaves every parameter alone.
                for unit in self.units:
                    unit.attach_master_grads([False] * len(unit.slot_has_grad))
                self._skip_refresh = True
        if not self._skip_refresh:
            for unit, flags in zip(self.units, agreement.slot_flags):
                unit.attach_master_grads(flags)
        # Last, once nothing can raise: the optimizer's own step updates this rank's pieces.
        self._groups.show_pieces()

    def refresh_parameters(self) -> None:
        """Bring the compute copies (full parameters in stages 1/2) up to date with the master shards."""
        for unit in self.units:
            unit.start_refresh(guard=False)
        self._finish_refresh()

    def _finish_refresh(self) -> None:
        """Stages 1/2: wait for the post-step all-gathers still writing the parameters. Every
        path that writes master shards or parameters (or swaps their data) calls it first; a
        forward waits per unit, and any other touch of a parameter through its guard."""
        for unit in self.units:
            if unit.refreshing:
                unit.wait_gathered()

    def _after_optimizer_step(self) -> None:
        assert self._groups is not None
        self._groups.show_model_parameters()
        if not self._skip_refresh:
            # With overlap_param_refresh, issued and not waited for: each unit's next forward
            # waits for its own all-gather, so the later ones run while the first units compute.
            # Not while a torch profiler records: a collective issued under it and waited for
            # after it stopped crashes the process (torch 2.13, gloo; a profiler schedule stops
            # at a step boundary, exactly where these would still be in flight).
            overlap = self.config.overlap_param_refresh and not torch.autograd._profiler_enabled()
            for unit in self.units:
                unit.start_refresh(guard=overlap)
            if not overlap:
                self._finish_refresh()
            self.steps_taken += 1
        for unit in self.units:
            unit.reset_grads()
        self._grads_unscaled = False
        now = self.comm.stats.snapshot()
        self.last_step_traffic = CommStats.difference(now, self._traffic_at_last_step)
        self._traffic_at_last_step = now
        now = self.comm.stats.span_snapshot()
        self.last_step_traffic_by_span = CommStats.difference(now, self._span_traffic_at_last_step)
        self._span_traffic_at_last_step = now

    # ----------------------------------------------------- full parameters
    def gathered_parameters(
        self, module: nn.Module | None = None, writeback: bool = True
    ) -> "contextlib.AbstractContextManager[None]":
        """Inside, the parameters of ``module`` (default: the model) are full fp32 master values.

        Every rank must enter together. With ``writeback``, in-place edits are
        written back to the shards on exit (every rank should make the same edit).
        """
        return full_params.gathered_parameters(self, module, writeback)

    def comparable_parameters(self) -> "contextlib.AbstractContextManager[None]":
        """Inside, ``torch.equal`` between two stage-3 parameters at rest is answered exactly
        (the first such comparison gathers the model once, unit by unit); outside it is
        refused. Every rank must enter together and make the same comparisons."""
        return self._digests.comparable()

    def full_state_dict(self, *, to_cpu: bool = True, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict with full fp32 parameters, gathered one unit at a time.

        Keys and order are those of ``model.state_dict()``; tied parameters
        appear under each of their names. Every rank must call it.
        """
        self.sync_buffers_for_export()
        return full_params.full_state_dict(self, to_cpu=to_cpu, rank0_only=rank0_only)

    def unshard(self) -> None:
        """Give the model back as an ordinary module: full fp32 parameters, no hooks.

        The optimizer's state belongs to the shards: its ``step()`` raises from
        now on (stepping the model's parameters with fresh moments would
        silently train differently); make a new optimizer.
        """
        full_params.unshard(self)
        _ENGINES.pop(self.model, None)
        if self.optimizer is not None and self._groups is not None:
            _RETIRED_OPTIMIZERS[self.optimizer] = [
                self.optimizer.register_step_pre_hook(_refuse_step_after_unshard),
                *self._groups.install_hooks(),  # state_dict() still reads the shards' state
            ]

    # ---------------------------------------------------------- accounting
    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state held by this rank now."""
        counter = StorageCounter()
        params = counter.count([u.gathered_params for u in self.units] + [u.compute_shard for u in self.units])
        grads = counter.count(
            [u.full_grads for u in self.units]
            + [u.sharded_grads for u in self.units]
            + [u.group_grads for u in self.units]
            + [p.grad for p in self.model.parameters()]
            + [m.param.grad for u in self.units for m in u.master_pieces]
        )
        optimizer_state = self.optimizer.state if self.optimizer is not None else {}
        state_tensors = [
            value for state in optimizer_state.values() for value in state.values() if isinstance(value, torch.Tensor)
        ]
        optimizer = counter.count([u.master_shard for u in self.units] + state_tensors)
        return MemoryReport(params, grads, optimizer)

    def remove_hooks(self) -> None:
        for handle in self._hooks + self._optimizer_hooks + self.runtime.late_handles:
            handle.remove()
        self.runtime.late_handles.clear()
        self._hooks.clear()
        self._optimizer_hooks.clear()
