"""``ZeroStrategy``: ZeRO stages 1-3 as a Lightning Trainer strategy.

It is DDP's process management (launcher, process group, sampler, reduce,
barrier) with the ZeRO core in place of the DDP wrapper. The LightningModule
itself is the engine's root module, so checkpoint keys are the module's own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from zero_core import ZeroEngine, engine_of, meeting
from zero_core.checkpoint import is_sharded_checkpoint, remove_checkpoint
from zero_core.deepspeed import GlobalBatch
from zero_core.sharding import move_real_tensors, single_optimizer

from ._sharding import (
    TensorParallelMesh,
    as_zero_precision,
    build_engine,
    check_sync_batchnorm_device,
    refuse_late_sync_batchnorm,
    register_zero_strategies,
    strategy_settings,
    teardown_keeping_module,
    wait_before_removing,
    with_settings_doc,
    with_settings_signature,
    zero_precision,
)
from .deepspeed_arguments import with_deepspeed_keywords
from .deepspeed_config import (
    Config,
    apply_to_trainer,
    check_precision,
    check_train_dataloader,
    configured_optimizers,
)
from .finetuning import finetuning_callbacks, make_parameters_comparable, param_groups_restored, without_callback_states
from .precision_plugins import ZeroPrecision
from .unsupported_callbacks import refuse_unsupported_callbacks


@with_deepspeed_keywords
@with_settings_doc
class ZeroStrategy(TensorParallelMesh, DDPStrategy):
    """ZeRO for the Lightning Trainer: ``Trainer(strategy=ZeroStrategy(stage=3, ...))``
    or ``Trainer(strategy="zero3")`` after ``import lightning_zero``.

    The ZeRO settings are keyword arguments (``stage`` may also come first by position),
    generated from ``zero_core.user_settings()``; ``wrap_policy`` takes a block class, a
    tuple of classes or a ``zero_core.WrapPolicy``. With hybrid sharding
    (``shard_group_size``) a group is usually ``devices``, one per node
    (``Trainer(num_nodes=...)``). The precision comes from ``Trainer(precision=...)``:
    "32-true", "bf16-mixed", "bf16-true" or "16-mixed". The other arguments are DDP's.

    Lightning's ``DeepSpeedStrategy`` keyword arguments are taken too: ``ZeroStrategy(stage=3,
    offload_optimizer=True, offload_parameters=True, ...)`` trains as ``DeepSpeedStrategy(<the same>)``
    would, its defaults included (stage 2; under 16-mixed DeepSpeed's loss scaling), and what cannot be
    honoured is refused by name (``lightning_zero.deepspeed_arguments``).

    Args:
    """

    strategy_name = "zero"

    @with_settings_signature
    def __init__(
        self,
        *args: Any,
        accelerator: "pl.accelerators.Accelerator | None" = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        config: Config = None,
        **settings: Any,
    ) -> None:
        # Validate now, before Lightning launches any process. ``config``: a DeepSpeed config (dict or JSON
        # file), as strategy="deepspeed_stage_3" takes it.
        self.zero_config, self._deepspeed = strategy_settings(type(self), config, args, settings)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._forward_redirection = _ForwardRedirection()
        self.engine: ZeroEngine | None = None
        self._global_batch: GlobalBatch | None = None  # a DeepSpeed config's train_batch_size, resolved at setup

    # ------------------------------------------------- tensor parallelism
    def setup_environment(self) -> None:
        """With ``tensor_parallel_size`` the 2-D mesh goes to the LightningModule for ``configure_model``
        (``self.device_mesh["tensor_parallel"]``), as ModelParallelStrategy hands it."""
        super().setup_environment()
        if self._device_mesh is not None:
            assert self.lightning_module is not None
            # LightningModule.device_mesh has no setter: Lightning's own ModelParallelStrategy sets this too.
            self.lightning_module._device_mesh = self._device_mesh

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_zero_strategies(cls, strategy_registry)

    # ------------------------------------------------------------ precision
    @property
    def precision_plugin(self) -> ZeroPrecision:
        self._precision_plugin = zero_precision(self._precision_plugin, ZeroPrecision)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = as_zero_precision(plugin, ZeroPrecision)

    # ---------------------------------------------------------------- setup
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        optimizer = None
        refuse_unsupported_callbacks(trainer.callbacks)
        check_precision(self._deepspeed, self.precision_plugin.precision, "Trainer")
        # With TP, the ranks of one tensor-parallel group see one batch: the data-parallel ranks are the rest.
        ranks = self.world_size // self.zero_config.tensor_parallel_size
        self._global_batch = apply_to_trainer(self._deepspeed, trainer, ranks)
        if self.zero_config.steps_in_backward and trainer.gradient_clip_val:
            # Refused before any work, on every rank alike (the clip itself would be refused at the first step).
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) cannot clip under offload_step_in_backward="
                "True: the offloaded units step during backward, before clipping. Turn one of them off."
            )
        make_parameters_comparable(finetuning_callbacks(trainer))
        if trainer.state.fn == TrainerFn.FITTING:
            if self._layer_sync is not None:
                # Trainer(sync_batchnorm=True), as DDP honours it; kept after fit (the
                # converted layers' parameters are sharded, so they are not reverted).
                check_sync_batchnorm_device(self.root_device)
                if engine_of(self.lightning_module) is not None:
                    refuse_late_sync_batchnorm(self.lightning_module)
                else:
                    self.model = self._layer_sync.apply(self.lightning_module)
            self.setup_optimizers(trainer)
            optimizer = single_optimizer(self.optimizers)
        self.engine = build_engine(
            self.lightning_module,
            optimizer,
            self.zero_config,
            self.precision_plugin,
            self.root_device,
            device_mesh=self._device_mesh,
        )
        # Lightning wrapped the optimizer before the engine routed its zero_grad (a class switch that each
        # wrapper takes when it is made): wrapped again, self.optimizers() and manual optimization reach it.
        self.optimizers = self.optimizers
        self.setup_precision_plugin()

    def on_train_start(self) -> None:
        """A DeepSpeed config's ``train_batch_size`` against the train DataLoader's batch size, now that the fit
        loop has it: before any step, the same error on every rank."""
        super().on_train_start()
        if self._global_batch is not None:
            assert self.lightning_module is not None
            check_train_dataloader(self._global_batch, self.lightning_module.trainer, self._every_rank)

    def _every_rank(self, value: int) -> list[int]:
        gathered = self.all_gather(torch.tensor([value], dtype=torch.int64, device=self.root_device))
        return [int(v) for v in gathered.reshape(-1).tolist()]

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        # configure_optimizers' return, or a DeepSpeed config's optimizer and scheduler sections built in its
        # place, as strategy="deepspeed" builds them (deepspeed_config.py).
        assert self.lightning_module is not None
        self.optimizers, self.lr_scheduler_configs = configured_optimizers(self._deepspeed, self.lightning_module)

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        move_real_tensors(self.lightning_module, self.root_device)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device, but under tensor parallelism (on_meta_device)."""
        with self.on_meta_device():
            yield

    # ------------------------------------------------------------ stepping
    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # Through the module's __call__, so the engine's root hooks run.
        module = self.lightning_module
        return self._forward_redirection(module, module, method, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    def barrier(self, name: str | None = None) -> None:
        # A meeting: a rank that is in state_dict() or a save meanwhile (on one rank only) is named at once.
        with meeting("barrier"):
            super().barrier(name)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.engine is not None
        with self.engine.no_sync():
            yield

    # ---------------------------------------------------------- checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.engine is not None
        return self.engine.sharded_model_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.engine is not None
        return self.engine.sharded_optimizer_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy.save_checkpoint(storage_options=...) is not supported: it writes DCP directories."
            )
        assert self.engine is not None
        path = Path(self.broadcast(str(filepath)))
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        # In the background with the setting, or where the Trainer was given Lightning's AsyncCheckpointIO.
        asynchronous = self.zero_config.asynchronous_checkpoints or isinstance(self.checkpoint_io, AsyncCheckpointIO)
        self.engine.save_checkpoint(
            path, extra, include_optimizer="optimizer_states" in checkpoint, asynchronous=asynchronous
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        wait_before_removing(self.engine, filepath)  # on every rank, as Lightning calls this
        if self.is_global_zero:
            remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory, or a consolidated file; both are read without running code from them
        (``weights_only`` cannot turn that off)."""
        assert self.engine is not None and self.lightning_module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if is_sharded_checkpoint(path):
            with_optimizer = fitting and self.engine.optimizer is not None
            checkpoint = self._restoring_finetuning_groups(
                with_optimizer,
                lambda: self.engine.read_checkpoint_extra(path).get("callbacks") or {},
                lambda: self.engine.load_checkpoint(path, load_optimizer=with_optimizer),
            )
            checkpoint["state_dict"] = {}  # already in place; Lightning's own restore has nothing to do
            if with_optimizer:
                checkpoint["optimizer_states"] = [{}]
            return checkpoint
        # A consolidated file (zero-consolidate's, or a DDP run's): its weights and, when fitting, its optimizer
        # state, each rank reading only its parts (agreed on every rank).
        file = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        optimizer_state = self._full_optimizer_state(file, path) if fitting else None

        def load() -> dict[str, Any]:
            strict = self.lightning_module.strict_loading
            self.engine.load_full_state_dict(path, strict=strict, optimizer_state_dict=optimizer_state)
            return file

        checkpoint = self._restoring_finetuning_groups(fitting, lambda: file.get("callbacks") or {}, load)
        checkpoint["state_dict"] = {}
        if optimizer_state is not None:
            checkpoint["optimizer_states"] = [{}]
        return checkpoint

    def _full_optimizer_state(self, file: dict[str, Any], path: Path) -> dict[str, Any] | None:
        """The file's one optimizer state, checked before anything is loaded: Lightning's own error for a
        weights-only file (raised after the weights are in place otherwise), ours for several optimizers."""
        if self.engine is None or self.engine.optimizer is None:
            return None
        states = file.get("optimizer_states")
        if states is None:
            raise KeyError(
                f"Trying to restore optimizer state but checkpoint {path} contains only the model. This is "
                "probably due to `ModelCheckpoint.save_weights_only` being set to `True`."
            )
        if not isinstance(states, list) or len(states) != 1:
            count = len(states) if isinstance(states, list) else "malformed"
            raise ValueError(f"{path} holds the state of {count} optimizers; ZeroStrategy trains with exactly one.")
        return states[0]

    def _restoring_finetuning_groups(
        self, fitting: bool, saved_callbacks: Callable[[], dict[str, Any]], load: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """``load()``; when fitting with BaseFinetuning callbacks, the param groups they had added
        come back first, as the checkpoint's optimizer state (or a fresh one) expects."""
        assert self.engine is not None and self.lightning_module is not None
        trainer, optimizer = self.lightning_module.trainer, self.engine.optimizer
        if not (fitting and optimizer is not None and finetuning_callbacks(trainer)):
            return load()
        with param_groups_restored(trainer, self.lightning_module, optimizer, saved_callbacks()) as restored:
            checkpoint = load()
        return without_callback_states(checkpoint, restored)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint already put the weights into the shards

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # likewise for the optimizer state

    def teardown(self) -> None:
        teardown_keeping_module(self, self.precision_plugin)
