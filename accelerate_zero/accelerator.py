"""``ZeroAccelerator``: Accelerate's ``Accelerator`` with ZeRO in place of DDP.

``prepare`` shards the model and rebuilds its optimizer (no DDP wrapper: the
engine computes in the policy's dtype with fp32 master weights, and under
mixed precision the forward runs in Accelerate's autocast and returns fp32
outputs, as Accelerate's own DDP and FSDP do); ``backward``, ``no_sync``/``accumulate``, clipping, state dicts and
``save_state``/``load_state`` go through the engine. Accelerate keeps
everything else: dataloaders, schedulers, RNG state, ``gather``, logging.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.logging import get_logger
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import broadcast_object_list, convert_outputs_to_fp32, gather_object, recursively_apply
from accelerate.utils.modeling import get_mixed_precision_context_manager
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from zero_core import CheckpointError, ZeroEngine, meeting, setup_summary
from zero_core.checkpoint import is_sharded_checkpoint
from zero_core.sharding import shard_module, single_optimizer

from .deepspeed_batch import ConfigBatch
from .deepspeed_sections import ConfigScheduler, SectionBuilder
from .plain_training import zero_model_prepared
from .plugin import MIXED_PRECISION_OF_DEEPSPEED, MIXED_PRECISION_POLICIES, ZeroPlugin
from .tensor_parallel_mesh import (
    DataParallelRanks,
    DataParallelScheduler,
    accelerate_without_its_parallelism,
    build_mesh,
    tensor_parallel_size,
)

MODEL_DIR = "pytorch_model_zero_{}"  # beside Accelerate's own files, as its FSDP layout does
OPTIMIZER_DIR = "optimizer_zero_{}"


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose ``step_was_skipped`` is the engine's (an fp16 overflow)."""

    def __init__(self, optimizer: Optimizer, engine: ZeroEngine, device_placement: bool):
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self.engine = engine
        self.config_scheduler: Any = None  # a DeepSpeed config's schedule: stepped here, as DeepSpeed's engine does
        self.config_clipping: float | None = None  # a DeepSpeed config's clipping: applied here, likewise

    def step(self, closure: Any = None) -> None:
        if self.config_clipping and self.gradient_state.sync_gradients:
            self.engine.clip_grad_norm_(self.config_clipping)
        super().step(closure)
        if self.config_scheduler is not None and self.gradient_state.sync_gradients and not self.step_was_skipped:
            self.config_scheduler.step()

    @property
    def step_was_skipped(self) -> bool:
        return self.engine.last_step_skipped


class ZeroAccelerator(Accelerator):
    """``ZeroAccelerator(zero_plugin=ZeroPlugin(stage=3), mixed_precision="bf16", ...)``;
    every other argument is Accelerate's. Without ``zero_plugin`` the settings
    come from the ``ACCELERATE_ZERO_*`` variables ``accelerate-zero launch`` sets."""

    def __init__(self, *, zero_plugin: ZeroPlugin | None = None, mixed_precision: str | None = None, **kwargs: Any):
        """With tensor parallelism (``ZeroPlugin(tensor_parallel_size=n)`` or Accelerate's
        ``ParallelismConfig(tp_size=n)``), ``self.device_mesh`` is the 2-D mesh to split the model over
        before ``prepare`` (tensor_parallel_mesh.py)."""
        requested = (mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION") or "no").lower()
        if requested not in MIXED_PRECISION_POLICIES:
            raise ValueError(
                f"mixed_precision={requested!r} is not supported with ZeRO; "
                f"use one of {sorted(MIXED_PRECISION_POLICIES)}."
            )
        self.zero_plugin = zero_plugin if zero_plugin is not None else ZeroPlugin()
        tensor_parallel = tensor_parallel_size(self.zero_plugin, kwargs)
        check_deepspeed_precision(self.zero_plugin, requested)  # before Accelerate's state is made
        with accelerate_without_its_parallelism(kwargs) as accelerate_kwargs:
            super().__init__(mixed_precision=requested, **accelerate_kwargs)
        self.device_mesh = build_mesh(tensor_parallel, self.device)
        self._data_parallel = DataParallelRanks(self.device_mesh) if self.device_mesh is not None else None
        # A DeepSpeed config's train_batch_size: the accumulation derived from it (or its three numbers refused
        # where they disagree), the DataLoader's batch size checked when it is prepared.
        ranks = self._data_parallel.size if self._data_parallel is not None else self.num_processes
        self._config_batch = ConfigBatch(
            getattr(self.zero_plugin, "deepspeed_loop", None),
            ranks,
            self.gradient_accumulation_steps,
            self.split_batches,
            _on_every_rank,
        )
        self.gradient_accumulation_steps = self._config_batch.accumulation
        # Against what Accelerate settled on (the keyword, a GradientAccumulationPlugin or its variable).
        check_deepspeed_accumulation(self.zero_plugin, self.gradient_accumulation_steps)
        check_step_in_backward_accumulation(
            self.zero_plugin, self.gradient_accumulation_steps, self.gradient_state.plugin_kwargs
        )
        # Accelerate's autocast stays (``accelerator.autocast()``, and the forward's in prepare_model);
        # its GradScaler does not: the engine scales fp16 losses and unscales its own gradient shards.
        self.scaler = None
        self.engine: ZeroEngine | None = None
        self._saving_state = False  # inside save_state: the weights Accelerate collects are dropped
        # A DeepSpeed config's optimizer and scheduler sections, built in place of DummyOptim/DummyScheduler.
        sections = getattr(self.zero_plugin, "deepspeed_loop", None)
        self._sections = SectionBuilder(sections, self.num_processes, self.split_batches)
        # Its clipping, applied in each optimizer step as DeepSpeed's engine applies it under Accelerate (the
        # loop's clip_grad_norm_ then only measures); None: the loop clips. ZeroTrainer clears it (it clips).
        self.config_clipping: float | None = (sections.loop.get("gradient_clipping") or None) if sections else None
        check_step_in_backward_clipping(self.zero_plugin, self.config_clipping)
        self._told_clipping = False

    def _require_engine(self) -> ZeroEngine:
        if self.engine is None:
            raise RuntimeError("Call accelerator.prepare(model, optimizer, ...) first.")
        return self.engine

    # -------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        self._config_batch.see_prepared(args)  # before any work: the batch the config asks for, or refused
        self.gradient_accumulation_steps = self._config_batch.accumulation
        args = self._sections.replace_dummies(args)
        models = [a for a in args if isinstance(a, nn.Module)]
        optimizers = [a for a in args if isinstance(a, Optimizer)]
        if len(models) > 1:
            raise ValueError("ZeroAccelerator shards one model; prepare it with its optimizer.")
        optimizer = single_optimizer(optimizers)
        if models:
            policy = MIXED_PRECISION_POLICIES[self.mixed_precision]
            config = self.zero_plugin.zero_config(policy, models[0])
            self.engine = shard_module(models[0], optimizer, config, self.device, device_mesh=self.device_mesh)
            zero_model_prepared()  # accelerate-zero launch's check: this process trains with ZeRO
            # At INFO, as Accelerate logs: shown where the user turned its logging on.
            get_logger(__name__).info(setup_summary(self.engine), main_process_only=True)
            deepspeed = getattr(self.zero_plugin, "deepspeed_loop", None)  # ZeroPlugin.from_deepspeed's reading
            if deepspeed is not None and deepspeed.without_effect:
                get_logger(__name__).info(deepspeed.without_effect_line(), main_process_only=True)
        elif optimizer is not None:
            self._require_engine().attach_optimizer(optimizer)
        prepared = super().prepare(*args, device_placement=device_placement)
        for scheduler in self._sections.config_schedulers:  # the config's, also where the script passed none
            if all(known.scheduler is not scheduler for known in self._schedulers):
                self.prepare_scheduler(scheduler)
        return prepared

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> Optimizer:
        """Accelerate's wrapper, told by the engine when a step was skipped: the engine's fp16 loss scaler,
        not Accelerate's GradScaler, skips steps, and Accelerate's schedulers (and Trainer) read this to skip
        theirs as under Accelerate's own fp16."""
        if self.engine is None or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        placement = self.device_placement if device_placement is None else device_placement
        wrapped = ZeroAcceleratedOptimizer(optimizer, self.engine, device_placement=placement)
        wrapped.config_clipping = self.config_clipping
        self._optimizers.append(wrapped)  # where Accelerate's own prepare_optimizer registers it
        return wrapped

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        # Sharded in prepare(): no DDP wrapper, no device move. Accelerate has no public way to
        # register a model it does not wrap; its private _models list is what save_state/load_state
        # hand their pre-hooks (pinned in tests/adapters/accelerate/test_accelerate.py).
        if all(model is not known for known in self._models):
            self._models.append(model)
            if self.native_amp:
                _autocast_forward(model, get_mixed_precision_context_manager(True, self.autocast_handler))
        return model

    # ------------------------------------------- data, per data-parallel rank
    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ) -> DataLoader:
        """With tensor parallelism: divided among the data-parallel ranks (Accelerate's own call, with the
        data-parallel size and rank in place of the process count and index)."""
        if self._data_parallel is None:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        ranks = self._data_parallel
        dispatched = self.dispatch_batches or (
            self.dispatch_batches is None and isinstance(data_loader.dataset, IterableDataset)
        )
        if dispatched:
            raise ValueError(
                "Dispatched batches (Accelerate's default for an IterableDataset) are not supported with tensor "
                "parallelism: pass dataloader_config=DataLoaderConfiguration(dispatch_batches=False), so each "
                "data-parallel rank reads its own share."
            )
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=ranks.size,
            process_index=ranks.rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=False,
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    def gather(self, tensor: Any) -> Any:
        gathered = super().gather(tensor)
        return gathered if self._data_parallel is None else self._data_parallel.first_of_each_group(gathered)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        if self._data_parallel is not None and (use_gather_object or not _all_tensors(input_data)):
            raise ValueError(
                "gather_for_metrics of objects is not supported with tensor parallelism (each data-parallel "
                "rank's objects would come once per tensor-parallel rank): gather tensors."
            )
        return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        if self._data_parallel is None or reduction == "none":
            return super().reduce(tensor, reduction, scale)
        return self._data_parallel.reduce(tensor, reduction)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        prepared = super().prepare_scheduler(scheduler)
        if any(scheduler is built for built in self._sections.config_schedulers):
            prepared.__class__ = ConfigScheduler  # its step() does nothing: the optimizer's step steps it
            for optimizer in self._optimizers:
                if isinstance(optimizer, ZeroAcceleratedOptimizer) and optimizer.optimizer is scheduler.optimizer:
                    optimizer.config_scheduler = scheduler
            return prepared
        if self._data_parallel is not None:
            prepared.__class__ = DataParallelScheduler  # Accelerate's wrapper, stepping per data-parallel rank
            prepared.data_parallel_size = self._data_parallel.size
        return prepared

    # ------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """As Accelerate: the loss is divided by the accumulation steps; fp16 scaling by the engine."""
        self._config_batch.before_backward()
        self._require_engine().backward(loss / self.gradient_accumulation_steps, **kwargs)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None) -> Iterator[None]:
        with self._require_engine().no_sync():
            yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """The norm over all shards, as ``torch.nn.utils.clip_grad_norm_`` on the full model (or on the
        model's parameters given: ``model.head.parameters()`` clips the head alone, as under DDP). With a
        DeepSpeed config the optimizer step clips at the config's norm, as DeepSpeed's engine does under
        Accelerate, and this call only measures (said once, at INFO)."""
        if self.config_clipping is not None:
            if not self._told_clipping:
                self._told_clipping = True
                get_logger(__name__).info(
                    f"clip_grad_norm_(max_norm={max_norm}): the DeepSpeed config's gradient_clipping "
                    f"({self.config_clipping}) clips in the optimizer step, as DeepSpeed does under Accelerate; "
                    "this call returns the norm only.",
                    main_process_only=True,
                )
            max_norm = float("inf")
        return self._require_engine().clip_grad_norm_(max_norm, norm_type, parameters=parameters)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        self._require_engine().clip_grad_value_(clip_value, parameters=parameters)

    # ---------------------------------------------------- meetings of every rank
    def wait_for_everyone(self) -> None:
        # A meeting: a process in get_state_dict or a state_dict() of the stage-3 model meanwhile (on the
        # main process only) is named within milliseconds, on every process, instead of the timeout.
        with meeting("wait_for_everyone()"):
            super().wait_for_everyone()

    def end_training(self) -> None:
        """Also waits for a save_state still being written in the background (its error raised here)."""
        if self.engine is not None:
            self.engine.wait_for_checkpoint()
        with meeting("end_training()"):
            super().end_training()

    # --------------------------------------------------------------- export
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full fp32 weights, gathered unit by unit (every process must call it)."""
        if self._saving_state and not unwrap:
            # Accelerate's save_state collecting the weights its pre-hook list hands over; ours
            # (save_state below) drops them for the sharded directories, so gathering the whole
            # model onto every process here would only cost memory and time.
            return {}
        return self._require_engine().full_state_dict()

    # ---------------------------------------------------------- checkpoints
    @contextlib.contextmanager
    def _accelerate_skips_the_optimizer(self) -> Iterator[None]:
        """Accelerate saves RNG, schedulers, dataloaders and custom objects; the engine, the model
        (through the documented pre-hook route: the hook empties ``weights`` / ``models``) and the
        optimizer. For the optimizer Accelerate has no public route: its ``save_state`` writes
        ``optimizer.state_dict()`` of every optimizer in the private ``_optimizers`` list, which
        for a rebuilt optimizer is rank 0's share only, and ``load_state`` would load that share
        on every rank. So the list is emptied around the call; the optimizer stays registered
        for everything else (schedulers, ``optimizer_step_was_skipped``).
        ``tests/adapters/accelerate/test_accelerate.py`` pins this assumption (and the others ``save_state`` makes)."""
        optimizers, self._optimizers = self._optimizers, []
        try:
            yield
        finally:
            self._optimizers = optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Our model and optimizer first (each directory atomic, both tagged with one token so
        ``load_state`` refuses a mixed pair), then Accelerate's own files.

        Under automatic checkpoint naming, old checkpoints beyond ``total_limit``
        are pruned only once this save succeeded (Accelerate prunes first), and
        a failed save removes its new folder: the previous checkpoint stays the
        latest, loadable one. With ``asynchronous_checkpoints`` the model and
        optimizer are written in the background: the pruning waits until they
        are on disk (the engine runs it where it collects the write).
        """
        engine = self._require_engine()
        # A previous save still being written first, before Accelerate makes this save's folder: its pruning must
        # not count the new, unwritten checkpoint among those it keeps.
        engine.wait_for_checkpoint()
        config = self.project_configuration
        limit, config.total_limit = config.total_limit, None
        created: list[Path] = []
        succeeded = False  # read where an asynchronous write is collected, always after save_state returned

        def written_in_background(_: Path, error: BaseException | None) -> None:
            if not (config.automatic_checkpoint_naming and self.is_main_process):
                return
            if error is None and succeeded and limit is not None:
                _prune_automatic_checkpoints(created[0].parent, keep=limit)
            elif error is not None:  # the folder it was to complete: the previous one stays the latest
                shutil.rmtree(created[0], ignore_errors=True)

        def save_shards(models: list, weights: list, location: str) -> None:
            created.append(Path(location))
            pair = {"save_state": broadcast_object_list([uuid.uuid4().hex])[0]}
            optimizer_dir = Path(location) / OPTIMIZER_DIR.format(0) if engine.optimizer is not None else None
            engine.save_checkpoint(
                Path(location) / MODEL_DIR.format(0),
                pair,
                optimizer_path=optimizer_dir,
                # Synchronous: pruned below, once Accelerate's own files are written too.
                when_done=written_in_background if engine.config.asynchronous_checkpoints else None,
            )
            weights.clear()  # saved above: Accelerate writes no model file of its own

        handle = self.register_save_state_pre_hook(save_shards)
        failure: Exception | None = None
        self._saving_state = True
        try:
            with self._accelerate_skips_the_optimizer():
                location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        except Exception as error:  # noqa: BLE001 - ours or Accelerate's own files; agreed on below
            failure = error
        finally:
            self._saving_state = False
            handle.remove()
            config.total_limit = limit
        # Accelerate writes its files per process: every process learns whether all succeeded.
        failures = [
            f for f in gather_object([None if failure is None else f"{type(failure).__name__}: {failure}"]) if f
        ]
        if failures:
            self._discard_failed_save(engine, created if config.automatic_checkpoint_naming else [])
            if isinstance(failure, CheckpointError):
                raise failure
            raise CheckpointError(f"save_state failed: {failures[0]}") from failure
        succeeded = True
        if engine.checkpoint_being_written is None and config.automatic_checkpoint_naming and limit is not None:
            if self.is_main_process:
                _prune_automatic_checkpoints(Path(location).parent, keep=limit)
        self.wait_for_everyone()
        return location

    def _discard_failed_save(self, engine: ZeroEngine, created: list[Path]) -> None:
        """A failed save_state's new folder removed (a folder of its own: nothing else in it), once no write
        into it goes on: a background write of its model and optimizer is waited for (its own error, if any, is
        the lesser one: the save failed already)."""
        if engine.checkpoint_being_written is not None:
            with contextlib.suppress(CheckpointError):
                engine.wait_for_checkpoint()
        if created and self.is_main_process:
            shutil.rmtree(created[0], ignore_errors=True)
        self.wait_for_everyone()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """Also with another number of processes: the shards are read for the current layout.

        The folder is the one Accelerate resolves (``input_dir``, or the latest
        automatic checkpoint), handed to its load-state pre-hook. Our model and
        optimizer load there, all or nothing (a pair from two different saves is
        refused), before Accelerate restores its own files. Under automatic
        naming a newer folder whose save never finished (its processes killed
        while writing in the background: no model directory) is skipped, with a
        warning, for the latest one that did.
        """
        engine = self._require_engine()
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            input_dir = self._latest_finished_checkpoint()

        def load_shards(models: list, location: str) -> None:
            optimizer_dir = Path(location) / OPTIMIZER_DIR.format(0) if engine.optimizer is not None else None
            engine.load_checkpoint(Path(location) / MODEL_DIR.format(0), optimizer_path=optimizer_dir)
            models.clear()  # loaded above: Accelerate loads no model file of its own

        handle = self.register_load_state_pre_hook(load_shards)
        try:
            with self._accelerate_skips_the_optimizer():
                super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        finally:
            handle.remove()

    def _latest_finished_checkpoint(self) -> str | None:
        """The newest ``checkpoint_<n>``, past those a save of ours began and never finished (its processes
        stopped while writing in the background), which are removed with a warning: chosen by the main process
        for every process. None where no folder is left (Accelerate's own resolution then says so)."""
        chosen: str | None = None
        if self.is_main_process:
            root = Path(self.project_dir) / "checkpoints"
            unfinished = []
            for _, folder in reversed(_automatic_checkpoints(root) if root.is_dir() else []):
                if not _unfinished_save(folder):
                    chosen = str(folder)
                    break
                unfinished.append(folder)
            if chosen is not None and unfinished:
                for folder in unfinished:
                    shutil.rmtree(folder, ignore_errors=True)
                warnings.warn(
                    f"load_state(): removed {', '.join(f.name for f in unfinished)} under {root}, whose save never "
                    f"finished (its processes stopped while writing it); loading {Path(chosen).name}.",
                    stacklevel=3,
                )
        return broadcast_object_list([chosen])[0]


def _unfinished_save(folder: Path) -> bool:
    """A save_state of ours began in ``folder`` (a directory of its writes, or one's partial copy) and its model
    directory, written last, never got its final name. A folder of anything else is not one."""
    model = folder / MODEL_DIR.format(0)
    if is_sharded_checkpoint(model):
        return False
    ours = [model, folder / OPTIMIZER_DIR.format(0)]
    return any(path.exists() or path.with_name(f".{path.name}.partial").exists() for path in ours)


def _all_tensors(data: Any) -> bool:
    """As Accelerate's gather_for_metrics decides between gather and gather_object."""
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def _autocast_forward(model: nn.Module, autocast: contextlib.AbstractContextManager) -> None:
    """Accelerate's own wrapping of a prepared model's forward (``Accelerator.prepare_model``): autocast
    inside, fp16/bf16 outputs converted to fp32, the original kept where ``unwrap_model`` restores it."""
    model._original_forward = model.forward  # type: ignore[assignment]
    if not hasattr(model.forward, "__func__"):  # already a plain function (wrapped by someone else)
        model.forward = convert_outputs_to_fp32(autocast(model.forward))  # type: ignore[operator]
        return
    forward = MethodType(autocast(model.forward.__func__), model)  # type: ignore[operator]
    model.forward = MethodType(convert_outputs_to_fp32(forward.__func__), model)  # type: ignore[method-assign]


def _automatic_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The ``checkpoint_<n>`` folders (Accelerate's automatic names) under ``root``, oldest first."""
    return sorted(
        (int(match.group(1)), folder)
        for folder in root.iterdir()
        if (match := re.fullmatch(r"checkpoint_(\d+)", folder.name)) and folder.is_dir()
    )


def _prune_automatic_checkpoints(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest ``checkpoint_<n>`` folders under ``root``."""
    numbered = _automatic_checkpoints(root)
    for _, folder in numbered[: max(0, len(numbered) - keep)]:
        shutil.rmtree(folder, ignore_errors=True)


def _on_every_rank(value: int) -> list[int]:
    return [int(v) for v in gather_object([value])]


def check_deepspeed_precision(plugin: ZeroPlugin, mixed_precision: str) -> None:
    """``ZeroPlugin.from_deepspeed``: the config's precision is the Accelerator's argument, which must say
    the same (Accelerate's own DeepSpeed plugin takes it from there too)."""
    translated = getattr(plugin, "deepspeed_loop", None)
    if translated is not None and translated.precision is not None:
        if MIXED_PRECISION_OF_DEEPSPEED[translated.precision] != mixed_precision:
            raise ValueError(
                f"{translated.source} asks for {translated.precision}: pass ZeroAccelerator(mixed_precision="
                f"{MIXED_PRECISION_OF_DEEPSPEED[translated.precision]!r}, ...) (got {mixed_precision!r})."
            )


def check_deepspeed_accumulation(plugin: ZeroPlugin, accumulation: int) -> None:
    """Likewise for the micro-batches accumulated per step."""
    translated = getattr(plugin, "deepspeed_loop", None)
    if translated is None:
        return
    steps = translated.loop.get("gradient_accumulation_steps")
    if steps is not None and steps != accumulation:
        raise ValueError(
            f"{translated.source} accumulates {steps} micro-batches: pass "
            f"ZeroAccelerator(gradient_accumulation_steps={steps}, ...) (got {accumulation})."
        )


def check_step_in_backward_clipping(plugin: ZeroPlugin, clipping: float | None) -> None:
    """offload_step_in_backward steps each offloaded unit before the global norm is known, so it cannot clip; a
    DeepSpeed config clips in every step (at 1.0 where it names no gradient_clipping): refused here, before any
    work, rather than at the first step."""
    if clipping and plugin.offload_step_in_backward and plugin.offload_optimizer != "none":
        raise ValueError(
            f"The DeepSpeed config clips the gradient norm at {clipping} in each step (DeepSpeed's default 1.0 "
            "when it names no gradient_clipping), and offload_step_in_backward=True steps before the norm is "
            'known: set "gradient_clipping": 0 in the config, or drop offload_step_in_backward.'
        )


def check_step_in_backward_accumulation(plugin: ZeroPlugin, accumulation: int, plugin_kwargs: dict) -> None:
    """offload_step_in_backward steps each offloaded unit in a synchronising backward. With Accelerate's
    ``sync_each_batch`` every micro-batch's backward synchronises, and the second would be refused in the
    middle of the first step: refused here, before any work."""
    early = plugin.offload_step_in_backward and plugin.offload_optimizer != "none"
    if early and accumulation > 1 and plugin_kwargs.get("sync_each_batch", False):
        raise ValueError(
            "offload_step_in_backward=True steps in the backward that synchronises gradients, and "
            "GradientAccumulationPlugin(sync_each_batch=True) synchronises every micro-batch's: drop "
            "sync_each_batch (the micro-batches then accumulate without synchronising), or turn "
            "offload_step_in_backward off."
        )
