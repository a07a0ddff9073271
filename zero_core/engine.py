"""``ZeroEngine``: the plain-PyTorch entry point to ZeRO stages 1, 2 and 3, and a facade over its parts.

The model is sharded in place and keeps being called as before; the optimizer object is rebuilt in place over
this rank's fp32 shard, so ``optimizer.step()`` and schedulers keep working. The parts (``build.py``) do the
work; the engine only forwards to them (its checkpoint methods to ``checkpoint/save_and_load.py``, with the
``CheckpointTarget`` the builder made). What each stage communicates: ``config.StagePlan``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .build import build_parts, model_device
from .checkpoint import save_and_load
from .collectives import CollectiveCount, CommContext, CommStats
from .config import ZeroConfig
from .engine_plans import EnginePlans
from .memory.fit import FitResult, fit_at_setup
from .memory.measured import measure_model_state, unit_reports
from .memory.memory_reports import MemoryReport, UnitReport
from .mesh import DeviceMesh, engine_comm
from .model import full_params
from .model.meta_init import ParamInitFn
from .optim.rebuild import check_optimizer_supported
from .passes.gradient_reads import Parameters
from .passes.prefetch_tuning import PrefetchReport
from .passes.state import TrainingState

Owner = TypeVar("Owner")


class ModelOwners(Generic[Owner]):
    """Which engine has sharded which model, so a model is never sharded twice.

    Both held weakly: a model dropped by the user takes its entry with it, and the entry never keeps an engine
    (which holds its model) alive by itself. What keeps an engine alive is the user's reference, or its model's
    hooks while they are installed (the runtime's ``owner``)."""

    def __init__(self) -> None:
        self._owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Owner]] = weakref.WeakKeyDictionary()

    def register(self, model: nn.Module, owner: Owner) -> None:
        self._owners[model] = weakref.ref(owner)

    def forget(self, model: nn.Module) -> None:
        """``model`` has no owner any more (its engine gave it back): another may shard it."""
        self._owners.pop(model, None)

    def owner_of(self, model: nn.Module) -> Owner | None:
        """The owner of ``model`` itself, if any (and still alive)."""
        owner = self._owners.get(model)
        return owner() if owner is not None else None

    def owner_containing(self, module: nn.Module) -> tuple[Owner, str] | None:
        """The owner whose model contains ``module``, and the module's name in that model."""
        for model, owner_ref in list(self._owners.items()):
            owner = owner_ref()
            if owner is None:
                continue
            for name, candidate in model.named_modules():
                if candidate is module:
                    return owner, name
        return None


_ENGINES: ModelOwners[ZeroEngine] = ModelOwners()
engine_of = _ENGINES.owner_of  # the engine that sharded this model, if any
engine_owning = _ENGINES.owner_containing  # the engine whose model contains this module, and its name there


class ZeroEngine:
    """Shard ``model`` and ``optimizer`` in place and drive them.

    Typical loop (launched with torchrun, process group initialised)::

        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3))
        for batch in loader:
            loss = loss_fn(model(batch.x), batch.y)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()

    Gradient accumulation: ``backward`` per micro-batch, ``step`` at the boundary, and the others inside
    ``engine.no_sync()`` so stage 1 skips their communication (stages 2/3 reduce every micro-batch).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: ZeroConfig | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        device_mesh: DeviceMesh | None = None,  # data_parallel × tensor_parallel (tensor parallelism: mesh.py)
        device: torch.device | str | None = None,
        param_init_fn: ParamInitFn | None = None,
        sample: Any = None,  # memory_budget: one batch as the model's forward takes it (model.example_input_array)
    ):
        config = config if config is not None else ZeroConfig()
        if not isinstance(config, ZeroConfig):
            raise ValueError("config must be a zero_core.ZeroConfig, for example ZeroConfig(stage=3).")
        if engine_of(model) is not None:
            raise ValueError(
                "This model is already sharded by a ZeroEngine. Reuse it (zero_core.engine_of(model)), "
                "or call its unshard() first to shard it again with other settings."
            )
        if optimizer is not None:
            check_optimizer_supported(optimizer)
        self.model = model
        self._requested_config = config  # as given; self.config is what runs (memory_budget's choice)
        plans = EnginePlans.of(config)
        tensor_parallel_size = plans.groups.tensor_parallel_size
        comm = engine_comm(model, tensor_parallel_size, process_group, device_mesh, model_device(model, device))
        # memory_budget: the settings chosen for it (memory/fit.py), agreed on every rank, before any state moves.
        self._fit: FitResult | None = None
        if config.memory_budget is not None:
            self._fit = fit_at_setup(model, sample, config, comm)
            self._fit.apply_activation_checkpointing(model)
            config = self._fit.config
            plans = EnginePlans.of(config)
        self.config = config
        # The runtime holds the engine: alive while the model's hooks are (the registry holds it weakly).
        self._parts = parts = build_parts(model, plans, config, optimizer, comm, param_init_fn, owner=self)
        self._units, self._runtime, self._loss_scaler = parts.units, parts.runtime, parts.loss_scaler
        self._optimizer, self._optimizer_step = parts.optimizer, parts.optimizer_step
        if optimizer is not None:
            self.attach_optimizer(optimizer)
        _ENGINES.register(model, self)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebuild ``optimizer`` (made over the model's parameters) over this rank's shards, as the constructor
        does for its own: to train an engine built without one, or with a fresh optimizer."""
        self._optimizer.attach(optimizer)

    @property
    def requested_config(self) -> ZeroConfig:
        """The config as given; ``config`` is the one that runs (under ``memory_budget``, the settings chosen)."""
        return self._requested_config

    @property
    def fit(self) -> FitResult | None:
        """Under ``memory_budget``: what was chosen, its predicted peak and the runner-up (None otherwise)."""
        return self._fit

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The attached optimizer (rebuilt over this rank's shards), if any."""
        return self._optimizer.optimizer

    # --------------------------------------------------------------- facts
    @property
    def param_group_names(self) -> list[list[str]]:
        """Each optimizer group's parameters by name (every rank alike), as checkpoints name them; read from
        the groups as they are now, so a save or load right after ``add_param_group`` sees the new group."""
        return self._optimizer.read_groups()

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def comm(self) -> CommContext:
        """The collectives context: this rank's process groups (``shard_group``), device, streams and counters."""
        return self._parts.comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def prefetch_report(self) -> PrefetchReport | None:
        """With ``prefetch="auto"``: the measured gather and compute times and the chosen depth."""
        return self._parts.auto_prefetch.report() if self._parts.auto_prefetch is not None else None

    @property
    def persistent_units(self) -> list[str]:
        """Stage 3: the units kept gathered between steps (``persistence_threshold``), by module path."""
        return [report.name for report in self.unit_reports() if report.persistent]

    @property
    def shard_group_size(self) -> int:
        """How many ranks share one copy of the model state (the world size unless hybrid sharding)."""
        return self.comm.shard_size

    @property
    def num_parameters(self) -> int:
        """Unique parameters of the model (its true size, also in stage 3; tensor parallelism: this rank's pieces)."""
        return sum(report.numel for report in self.unit_reports())

    @property
    def num_trainable_parameters(self) -> int:
        return sum(report.trainable_numel for report in self.unit_reports())

    @property
    def comm_stats(self) -> CommStats:
        """Collective calls, elements and bytes since creation (or ``comm_stats.reset()``); the last
        optimizer step's alone: ``last_step_traffic`` per kind, ``last_step_traffic_by_span`` per span."""
        return self.comm.stats

    @property
    def peak_live_units(self) -> int:
        """Most units gathered (or gathering) at once since the last reset (stage 3)."""
        return self._runtime.peak_live_units

    def reset_peak_live_units(self) -> None:
        self._runtime.peak_live_units = 0

    @property
    def loss_scale(self) -> float:
        return self._loss_scaler.scale if self._loss_scaler is not None else 1.0

    # ------------------------------------------------ adapters and reports (none reaches into the parts)
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (``loss`` itself without loss scaling): for adapters
        that scale the loss in one place and run the backward in another (Lightning's
        ``pre_backward``); ``backward_scaled`` or ``expect_scaled_backward`` then runs it."""
        return self._loss_scaler.scale_loss(loss) if self._loss_scaler is not None else loss

    def expect_scaled_backward(self) -> None:
        """The next backward, which the caller runs itself (a LightningModule's own ``backward``),
        starts from a loss ``scale_loss`` scaled. Under fp16 a backward nobody announced is
        refused (``UnscaledBackwardError``): its gradients would be off by the loss scale."""
        self._runtime.announce_scaled_backward()

    def discard_failed_pass(self) -> None:
        """After a forward or backward that raised was caught: reshard what it gathered and forget
        it now rather than at the next forward or step, which would do the same (with the same
        warning if stage 1 had to discard the gradients accumulated since the last step).
        Nothing happens when no pass failed. Every rank whose pass failed calls it."""
        self._runtime.settle()

    @property
    def training_state(self) -> TrainingState:
        """Where the step is: ``IDLE`` between passes, ``PRE_BACKWARD`` after a forward with grad
        whose backward has not run yet, ``FORWARD``/``BACKWARD`` inside one."""
        return self._runtime.state

    @property
    def prefetch_depth(self) -> int:
        """Stage 3: how many units are all-gathered ahead of the running one now. With
        ``prefetch="auto"`` it changes at optimizer steps (``prefetch_report()`` says why)."""
        return self._runtime.prefetch

    @property
    def execution_order_changes(self) -> int:
        """How many forwards or backwards ran the units in another order than the pass before
        (stage 3 prefetches in the last order seen, so each change costs exposed gathers)."""
        return self._runtime.order.changes

    def unit_reports(self) -> list[UnitReport]:
        """Each unit as it is now, in unit order: its size, padded size (what its collectives
        move), whether it persists (stage 3) and whether its post-step all-gather may still be
        writing its parameters (stages 1/2 with ``overlap_param_refresh``; waited for when touched)."""
        return unit_reports(self._units, self.config.plan)

    def sync_buffers_for_export(self) -> None:
        """Exports hold rank 0's buffers (DDP's rule), which the next forward would broadcast anyway."""
        self._parts.buffer_sync.for_export()

    # ------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, with fp16 loss scaling when enabled."""
        if self._loss_scaler is not None:
            loss = self._loss_scaler.scale_loss(loss)
        self.backward_scaled(loss, **kwargs)

    def backward_scaled(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` for a loss the caller already scaled (adapters that scale themselves)."""
        self._runtime.announce_scaled_backward()
        if "inputs" in kwargs:
            loss.backward(**kwargs)
            return
        # Stage 3: unit outputs that other ranks' losses use and this one does
        # not get zero gradients, so every rank gathers the same units in the
        # same order (forward_records.py).
        roots, grads = self._runtime.backward_roots(loss)
        grads[0] = kwargs.pop("gradient", None)
        torch.autograd.backward(roots, grads, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip gradient communication where the stage allows (stage 1)."""
        previous = self._runtime.require_grad_sync
        self._runtime.require_grad_sync = False
        try:
            yield
        finally:
            self._runtime.require_grad_sync = previous

    def set_gradient_sync(self, enabled: bool) -> None:
        self._runtime.require_grad_sync = enabled

    # ----------------------------------------------------------- gradients
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, parameters: Parameters = None) -> Tensor:
        """Clip by the norm over all shards, as ``torch.nn.utils.clip_grad_norm_`` on the full model (or on
        ``parameters``, some of the model's: every rank passes the same ones)."""
        return self._parts.gradients.clip_grad_norm(max_norm, float(norm_type), parameters)

    def clip_grad_value_(self, clip_value: float, *, parameters: Parameters = None) -> None:
        """Clamp every gradient element (of ``parameters``, if given) to ``[-clip_value, clip_value]``,
        as ``torch.nn.utils.clip_grad_value_``."""
        self._parts.gradients.clip_grad_value(clip_value, parameters)

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
        """Gradient norms as Lightning's ``grad_norm`` reports them (``grad_2.0_norm/<name>`` and
        ``grad_2.0_norm_total``), from the shards, for the gradients reduced since the last step
        (unscaled under fp16). ``param.grad`` does not hold them: every rank must call this."""
        return self._parts.gradients.norms(float(norm_type))

    def canonical_name(self, param: torch.Tensor) -> str | None:
        """The name ``grad_norms`` and checkpoints use for a parameter (its first name in the model)."""
        return self._parts.canonical_names.get(id(param))

    def zero_grad(self, set_to_none: bool = True, *, parameters: Parameters = None) -> None:
        """Drop the gradients accumulated since the last step (of ``parameters``, if given), as zero_grad under DDP."""
        self._parts.gradients.discard(parameters, set_to_none)

    # ---------------------------------------------------------------- step
    def step(self) -> None:
        """``optimizer.step()``: the optimizer's own step runs the same ZeRO logic."""
        if self.optimizer is None:
            raise RuntimeError("This engine was built without an optimizer; pass one to attach_optimizer().")
        self.optimizer.step()

    def refresh_parameters(self) -> None:
        """Bring the compute copies (full parameters in stages 1/2) up to date with the master shards."""
        self._optimizer_step.refresh_parameters()

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied (overflow-skipped ones not counted); a loaded checkpoint continues its count."""
        return self._optimizer_step.steps_taken

    @property
    def last_step_skipped(self) -> bool:
        """The last step was skipped on an fp16 overflow, as ``GradScaler`` skips one, or with
        ``skip_nonfinite_steps`` on an inf or NaN gradient (every rank agrees)."""
        return self._optimizer_step.last_step_skipped

    @property
    def last_step_traffic(self) -> dict[str, CollectiveCount]:
        """Collective traffic of the last optimizer step per kind (see ``comm_stats``)."""
        return self._optimizer_step.last_step_traffic

    @property
    def last_step_traffic_by_span(self) -> dict[str, CollectiveCount]:
        """Collective traffic of the last optimizer step per span (see ``comm_stats``)."""
        return self._optimizer_step.last_step_traffic_by_span

    # ----------------------------------------------------- full parameters
    def gathered_parameters(
        self, module: nn.Module | None = None, writeback: bool = True
    ) -> "contextlib.AbstractContextManager[None]":
        """Inside, the parameters of ``module`` (default: the model) are full fp32 master values. Every rank
        enters together; with ``writeback`` in-place edits (the same on every rank) reach the shards on exit."""
        return full_params.gathered_parameters(full_params.units_of(self._units, module), self._runtime, writeback)

    def comparable_parameters(self) -> "contextlib.AbstractContextManager[None]":
        """Inside, ``torch.equal`` between two stage-3 parameters at rest is answered exactly
        (the first such comparison gathers the model once, unit by unit); outside it is
        refused. Every rank must enter together and make the same comparisons."""
        return self._parts.digests.comparable()

    def full_state_dict(self, *, to_cpu: bool = True, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict with full fp32 parameters, gathered one unit at a time: ``model.state_dict()``'s
        keys and order (tied parameters under each of their names). Every rank must call it."""
        keep = not rank0_only or self.rank == 0
        self._runtime.quiesce()
        sync_buffers = self.sync_buffers_for_export
        return full_params.full_state_dict(self.model, self._units, sync_buffers, to_cpu=to_cpu, keep=keep)

    def unshard(self) -> None:
        """Give the model back as an ordinary module: full fp32 parameters, no hooks. The optimizer's state
        belongs to the shards: its ``step()`` raises from now on (fresh moments would silently train
        differently); make a new optimizer."""
        self._runtime.quiesce()
        self.wait_for_checkpoint()
        self.remove_hooks()
        full_params.unshard(self._units)
        _ENGINES.forget(self.model)
        self._optimizer.retire()

    # --------------------------------------------------------- checkpoints
    def sharded_model_state_dict(self) -> dict[str, Any]:
        """``model.state_dict()``'s keys, parameters as DCP-checkpointable views of this rank's fp32 shard
        (full logical shapes), buffers as they are: for ``torch.distributed.checkpoint.save``."""
        return save_and_load.sharded_model_state_dict(self._parts.checkpoints)

    def sharded_optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict in FSDP's layout (state by parameter name, over this rank's shard). Every
        rank calls it: param groups added since the last step are compared across ranks first."""
        return save_and_load.sharded_optimizer_state_dict(self._parts.checkpoints)

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        extra: dict[str, Any] | None = None,
        *,
        include_optimizer: bool = True,
        include_model: bool = True,
        optimizer_path: str | os.PathLike | None = None,
        asynchronous: bool | None = None,
        when_done: Callable[[Path, BaseException | None], None] | None = None,
    ) -> Path:
        """Write model, optimizer and ``extra`` as a sharded DCP directory, atomically: every rank writes its own
        pieces; a failure anywhere raises the same ``CheckpointError`` everywhere and leaves the checkpoint at
        ``path`` as it was. Without the optimizer it is what ``accelerate merge-weights`` consolidates.
        ``optimizer_path``: the optimizer into this other directory of the same save, written first (as
        Accelerate keeps them; ``load_checkpoint(path, optimizer_path=...)`` reads the pair).

        ``asynchronous`` (default: ``config.asynchronous_checkpoints``): return once the state is copied to host
        memory and write it in the background while training goes on; the next save, any load and
        ``wait_for_checkpoint()`` wait for it, and the first optimizer step after every rank's write finished
        raises its error, if any, on every rank alike. A save host memory cannot stage is refused, or with
        ``config.asynchronous_checkpoints_fallback`` written synchronously. ``when_done(path, error)``: called on
        every rank once the save ended, ``error`` None once it is on disk, else the ``CheckpointError`` about to
        be raised (before a synchronous save returns or raises; where an asynchronous one's write is collected)."""
        targets = {"include_optimizer": include_optimizer, "include_model": include_model}
        if asynchronous is None:
            asynchronous = self.config.asynchronous_checkpoints
        return save_and_load.save(
            self._parts.checkpoints,
            path,
            extra,
            **targets,
            optimizer_path=optimizer_path,
            timing=save_and_load.SaveTiming.of(asynchronous, self.config.asynchronous_checkpoints_fallback),
            when_done=when_done,
        )

    @property
    def checkpoint_being_written(self) -> Path | None:
        """The path an asynchronous save is still writing (or has written, not yet collected); None otherwise."""
        return self._parts.checkpoints.background.pending_path

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for an asynchronous save still being written: its path once on disk, None without one; its
        error raised on every rank alike. Every rank calls it (the end of training: the adapters do)."""
        return save_and_load.wait_for_background_save(self._parts.checkpoints)

    def read_checkpoint_extra(self, path: str | os.PathLike) -> dict[str, Any]:
        """The ``extra`` state of ``save_checkpoint``'s directory, verified and read on every rank, without
        loading anything. Every rank calls it; a bad checkpoint raises the same ``CheckpointError`` everywhere."""
        return save_and_load.read_extra(self._parts.checkpoints, path)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        *,
        load_optimizer: bool = True,
        load_model: bool = True,
        optimizer_path: str | os.PathLike | None = None,
        check_extra: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Resume from ``save_checkpoint``'s directory, at any world size and stage; returns ``extra``.

        All or nothing: every file is verified and read on every rank before anything changes; a failure
        anywhere raises the same ``CheckpointError`` everywhere and leaves the training state as it was.
        ``optimizer_path``: the optimizer from another directory of the same save (``include_model=False``).
        ``check_extra(extra)`` runs before anything is applied; what it raises changes nothing.
        """
        sources = {"load_optimizer": load_optimizer, "load_model": load_model, "optimizer_path": optimizer_path}
        resumed = save_and_load.load(self._parts.checkpoints, path, **sources, check_extra=check_extra)
        self._optimizer_step.steps_taken = resumed.steps
        return resumed.extra

    def load_full_state_dict(
        self,
        source: Mapping[str, torch.Tensor] | str | os.PathLike,
        strict: bool = True,
        *,
        optimizer_state_dict: Mapping[str, Any] | None = None,
    ) -> None:
        """Full weights (a state dict, .safetensors or torch file) into the shards, each rank reading its parts;
        with ``optimizer_state_dict`` (``optimizer.state_dict()`` of a DDP or one-process run, or
        ``zero-consolidate``'s) the optimizer's state too, as ``optimizer.load_state_dict`` matches it. All or
        nothing on every rank, at any stage and world size."""
        save_and_load.load_full_state(self._parts.checkpoints, source, strict, optimizer_state_dict)

    # ---------------------------------------------------------- accounting
    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state held by this rank now, and the host copies kept for
        asynchronous saves."""
        report = measure_model_state(
            self.model,
            self._units,
            self.optimizer,
            self._optimizer.bytes_on_disk(),
            exchanged=self._optimizer_step.whole_tensors.in_flight,
        )
        staging = self._parts.checkpoints.background.staging_bytes
        return dataclasses.replace(report, checkpoint_staging_bytes=staging)

    def remove_hooks(self) -> None:
        for handle in self._parts.hooks + self._runtime.late_handles:
            handle.remove()
        self._runtime.late_handles.clear()
        self._parts.hooks.clear()
        self._optimizer.remove_hooks()
