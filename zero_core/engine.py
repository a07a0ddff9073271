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
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .accounting import MemoryReport, UnitReport, measure_model_state
from .build import build_parts, model_device
from .checkpoint import training_state
from .collectives import CollectiveCount, CommContext, CommStats
from .config import ZeroConfig
from .model import full_params
from .model.meta_init import ParamInitFn
from .optim import grad_ops
from .optim.attachment import OptimizerAttachment
from .optim.rebuild import check_optimizer_supported
from .step.prefetch_tuning import PrefetchReport
from .step.state import TrainingState

# Which engine has sharded a model, so a model is never sharded twice.
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, ZeroEngine]" = weakref.WeakKeyDictionary()


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


class ZeroEngine:
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
        self.model = model
        parts = build_parts(
            model, config, optimizer, CommContext.create(process_group, model_device(model, device)), param_init_fn
        )
        self.comm, self.units, self.runtime = parts.comm, parts.units, parts.runtime
        self.loss_scaler, self.auto_prefetch = parts.loss_scaler, parts.auto_prefetch
        self.buffer_sync, self.state_dict_hooks, self._hooks = parts.buffer_sync, parts.state_dict_hooks, parts.hooks
        self._digests, self._canonical_names = parts.digests, parts.canonical_names
        self._optimizer_step = parts.optimizer_step
        step = parts.optimizer_step
        self._optimizer = OptimizerAttachment(
            self.units, self.comm, self._canonical_names, (step.before, step.after), agreed_at_setup=optimizer
        )
        self.runtime.before_root_forward.append(self._before_root_forward)
        if optimizer is not None:
            self.attach_optimizer(optimizer)
        _ENGINES[model] = self

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebuild ``optimizer`` (made over the model's parameters) over this rank's shards.

        The constructor does this for the optimizer it is given; call it to
        train an engine built without one, or with a fresh optimizer.
        """
        self._optimizer.attach(optimizer)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The attached optimizer (rebuilt over this rank's shards), if any."""
        return self._optimizer.optimizer

    # --------------------------------------------------------------- facts
    @property
    def param_group_names(self) -> list[list[str]]:
        """Each optimizer group's parameters by name (every rank alike): how checkpoints
        refer to them. Read from the groups as they are now, so a save or load right
        after ``optimizer.add_param_group`` sees the new group."""
        return self._optimizer.read_groups()

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
        self._optimizer.show_model_parameters()
        self.buffer_sync.before_root_forward()
        return args, kwargs

    def sync_buffers_for_export(self) -> None:
        """Exports hold rank 0's buffers (DDP's rule), which the next forward would broadcast anyway."""
        self.buffer_sync.for_export()

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
    def _unscale_grads_once(self) -> None:
        self._optimizer_step.unscale_grads_once()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over all shards, as ``torch.nn.utils.clip_grad_norm_`` on the full model."""
        self.runtime.settle_gradients()
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
        self.runtime.settle_gradients()
        scaled = self.loss_scaler is not None and not self._optimizer_step.grads_unscaled
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
        self.runtime.settle_gradients()
        self._unscale_grads_once()
        grad_ops.clip_grad_value(self.units, clip_value)

    def zero_grad(self) -> None:
        """Discard accumulated gradients without stepping."""
        self.runtime.quiesce()
        self._optimizer_step.discard_grads()

    # ---------------------------------------------------------------- step
    def step(self) -> None:
        """``optimizer.step()``: the optimizer's own step runs the same ZeRO logic."""
        if self.optimizer is None:
            raise RuntimeError("This engine was built without an optimizer; pass one to attach_optimizer().")
        self.optimizer.step()

    def refresh_parameters(self) -> None:
        """Bring the compute copies (full parameters in stages 1/2) up to date with the master shards."""
        for unit in self.units:
            unit.start_refresh(guard=False)
        self.runtime.wait_for_refresh()

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied (overflow-skipped ones not counted)."""
        return self._optimizer_step.steps_taken

    @steps_taken.setter
    def steps_taken(self, steps: int) -> None:  # a loaded checkpoint continues its count
        self._optimizer_step.steps_taken = steps

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
        """Inside, the parameters of ``module`` (default: the model) are full fp32 master values.

        Every rank must enter together. With ``writeback``, in-place edits are
        written back to the shards on exit (every rank should make the same edit).
        """
        return full_params.gathered_parameters(full_params.units_of(self.units, module), self.runtime, writeback)

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
        return full_params.full_state_dict(self.model, self.units, to_cpu=to_cpu, keep=not rank0_only or self.rank == 0)

    def unshard(self) -> None:
        """Give the model back as an ordinary module: full fp32 parameters, no hooks.

        The optimizer's state belongs to the shards: its ``step()`` raises from
        now on (stepping the model's parameters with fresh moments would
        silently train differently); make a new optimizer.
        """
        self.runtime.quiesce()
        self.remove_hooks()
        full_params.unshard(self.units)
        _ENGINES.pop(self.model, None)
        self._optimizer.retire()

    # ---------------------------------------------------------- accounting
    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state held by this rank now."""
        return measure_model_state(self.model, self.units, self.optimizer)

    def remove_hooks(self) -> None:
        for handle in self._hooks + self.runtime.late_handles:
            handle.remove()
        self.runtime.late_handles.clear()
        self._hooks.clear()
        self._optimizer.remove_hooks()

    # --------------------------------------------------------- checkpoints
    def _checkpoint_target(self) -> training_state.CheckpointTarget:
        return training_state.CheckpointTarget(
            model=self.model,
            units=self.units,
            comm=self.comm,
            optimizer=self.optimizer,
            loss_scaler=self.loss_scaler,
            stage=self.stage,
            steps_taken=self.steps_taken,
            quiesce=self.runtime.quiesce,
            sync_buffers=self.sync_buffers_for_export,
            read_param_groups=self._optimizer.read_groups,
            compare_param_groups=self._optimizer.compare_groups,
            param_group_names=self._optimizer.group_names,
            discard_grads=self.zero_grad,
            refresh_parameters=self.refresh_parameters,
        )

    def sharded_model_state_dict(self) -> dict[str, Any]:
        """``model.state_dict()``'s keys, parameters as DCP-checkpointable views of this rank's fp32 shard
        (full logical shapes), buffers as they are: for ``torch.distributed.checkpoint.save``."""
        return training_state.sharded_model_state_dict(self._checkpoint_target())

    def sharded_optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict in FSDP's layout (state by parameter name, over this rank's shard).

        Every rank calls it: param groups added since the last step are compared across ranks first."""
        return training_state.sharded_optimizer_state_dict(self._checkpoint_target())

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        extra: dict[str, Any] | None = None,
        *,
        include_optimizer: bool = True,
        include_model: bool = True,
    ) -> Path:
        """Write model, optimizer and ``extra`` as a sharded DCP directory, atomically.

        Every rank calls it; each writes only its own pieces. Without the
        optimizer the directory holds the model alone, which is what
        ``accelerate merge-weights`` consolidates. A failure on any rank
        raises the same ``CheckpointError`` on every rank and leaves the
        previous checkpoint at ``path`` as it was.
        """
        return training_state.save(
            self._checkpoint_target(),
            path,
            extra,
            include_optimizer=include_optimizer,
            include_model=include_model,
        )

    def read_checkpoint_extra(self, path: str | os.PathLike) -> dict[str, Any]:
        """The ``extra`` state of ``save_checkpoint``'s directory, verified and read on every
        rank, without loading anything. Every rank calls it; a bad checkpoint raises the same
        ``CheckpointError`` everywhere."""
        return training_state.read_extra(self._checkpoint_target(), path)

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

        ``optimizer_path``: read the optimizer from this other directory (one saved
        with ``include_model=False``, as Accelerate keeps them apart); both must
        hold the same ``extra`` and step count, or the pair is refused.
        ``check_extra``: called with the loaded ``extra`` before anything is
        applied; what it raises leaves everything as it was (``extra`` is the
        same on every rank, so it raises on every rank alike).

        All or nothing: every file is verified and read on every rank before
        anything changes; a failure anywhere raises the same ``CheckpointError``
        everywhere and leaves model, optimizer, loss scale and step counter as
        they were. Gradients accumulated before the load are discarded.
        """
        resumed = training_state.load(
            self._checkpoint_target(),
            path,
            load_optimizer=load_optimizer,
            load_model=load_model,
            optimizer_path=optimizer_path,
            check_extra=check_extra,
        )
        self.steps_taken = resumed.steps
        return resumed.extra

    def load_full_state_dict(self, source: Mapping[str, torch.Tensor] | str | os.PathLike, strict: bool = True) -> None:
        """Load ordinary full weights (a state dict, or a .safetensors / torch file) into the shards.

        Each rank reads only the parts of each tensor its shard covers
        (safetensors slices, or memory-mapped torch files).
        """
        training_state.load_full_state_dict(self._checkpoint_target(), source, strict)
