"""ZeRO stages 1-3 for Lightning Fabric: ``Fabric(strategy="zero3")`` after
``import lightning_zero``, or ``Fabric(strategy=ZeroFabricStrategy(stage=3, ...))``.

As for the Trainer, it is DDP's process management with the ZeRO engine in
place of the DDP wrapper; ``fabric.save``/``fabric.load`` write and read
sharded DCP directories, at any world size and stage; ``fabric.load`` also
reads a file a DDP (or one-process) run saved, weights and optimizer state.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from zero_core import ZeroEngine, meeting
from zero_core.sharding import refuse_optimizer_before_split, single_optimizer

from ._sharding import (
    TensorParallelMesh,
    as_zero_precision,
    build_engine,
    register_zero_strategies,
    strategy_settings,
    teardown_keeping_module,
    with_settings_doc,
    with_settings_signature,
    zero_precision,
)
from .deepspeed_arguments import with_deepspeed_keywords
from .deepspeed_config import Config, check_precision, refuse_loop_keys_under_fabric
from .precision_plugins import ZeroPrecisionSettings


class ZeroFabricPrecision(ZeroPrecisionSettings, Precision):
    """No autocast (the engine computes in the policy's dtype); fp16 loss scaling in backward."""

    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.engine is None:
            raise RuntimeError("Set up the model with fabric.setup(...) before calling fabric.backward.")
        self.engine.backward(tensor, *args, **kwargs)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    def __init__(self, strategy: "ZeroFabricStrategy"):
        self._strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        engine = self._strategy.engine
        return engine.no_sync() if enabled and engine is not None else nullcontext()


@with_deepspeed_keywords
@with_settings_doc
class ZeroFabricStrategy(TensorParallelMesh, DDPStrategy):
    """ZeRO for Fabric. Arguments as for :class:`lightning_zero.ZeroStrategy`: the ZeRO
    settings, generated from ``zero_core.user_settings()``, then DDP's; the precision comes
    from ``Fabric(precision=...)``. Lightning's ``DeepSpeedStrategy`` keyword arguments are taken
    too, as by ``ZeroStrategy``.

    Args:
    """

    @with_settings_signature
    def __init__(
        self,
        *args: Any,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        config: Config = None,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
        **settings: Any,
    ) -> None:
        # ``config``: a DeepSpeed config (dict or JSON file); its loop keys are the loop's business here.
        # ``parallelize_fn(module, mesh)``: with tensor_parallel_size, splits the module over
        # mesh["tensor_parallel"] in fabric.setup, as Fabric's ModelParallelStrategy takes it.
        self.zero_config, self._deepspeed = strategy_settings(type(self), config, args, settings)
        refuse_loop_keys_under_fabric(self._deepspeed)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self.engine: ZeroEngine | None = None
        self._parallelize_fn = parallelize_fn

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_zero_strategies(cls, strategy_registry)

    @property
    def precision(self) -> ZeroFabricPrecision:
        self._precision = zero_precision(self._precision, ZeroFabricPrecision)
        return self._precision

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._precision = as_zero_precision(plugin, ZeroFabricPrecision)

    # ---------------------------------------------------------------- setup
    def _shard(self, module: nn.Module, optimizer: Optimizer | None) -> nn.Module:
        check_precision(self._deepspeed, self.precision.precision, "Fabric")
        if self._device_mesh is not None:
            module = self._parallelize(module, optimizer)
        self.engine = build_engine(
            module, optimizer, self.zero_config, self.precision, self.root_device, device_mesh=self._device_mesh
        )
        return module

    def _parallelize(self, module: nn.Module, optimizer: Optimizer | None) -> nn.Module:
        """Split the module over the mesh before sharding it (parallelize_module replaces the parameters, so
        an optimizer made before would hold the old ones: refused, as Fabric's ModelParallelStrategy does)."""
        if self._parallelize_fn is None:
            raise ValueError(
                "ZeroFabricStrategy(tensor_parallel_size=...) needs parallelize_fn=fn, where fn(module, mesh) "
                "splits the module over mesh['tensor_parallel'] (torch's parallelize_module) and returns it."
            )
        refuse_optimizer_before_split(optimizer)
        return self._parallelize_fn(module, self._device_mesh)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        return self._shard(module, single_optimizer(optimizers)), optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._shard(module, None)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.engine is None:
            raise RuntimeError("Set up the model first: fabric.setup(model, optimizer) or fabric.setup_module(model).")
        self.engine.attach_optimizer(optimizer)
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        pass  # the engine places the shards on the root device

    @contextmanager
    def module_sharded_context(self) -> Generator[None, None, None]:
        with self.on_meta_device():
            yield

    def barrier(self, name: str | None = None) -> None:
        # A meeting: a rank that is in state_dict() or a save meanwhile (on one rank only) is named at once.
        with meeting("barrier"):
            super().barrier(name)

    # ------------------------------------------------------------ gradients
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        assert self.engine is not None
        norm = self.engine.clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of the gradients is {norm}; pass error_if_nonfinite=False to clip anyway."
            )
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        assert self.engine is not None
        self.engine.clip_grad_value_(float(clip_val))

    # ---------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("ZeroFabricStrategy.save_checkpoint does not support storage_options or filter.")
        assert self.engine is not None
        path = Path(self.broadcast(str(path)))
        # Stateful objects (schedulers, ...) as their state dicts, as Fabric's other strategies store them.
        extra = {
            k: v.state_dict() if _is_stateful(v) else v
            for k, v in state.items()
            if not isinstance(v, (nn.Module, Optimizer))
        }
        has_optimizer = any(isinstance(v, Optimizer) for v in state.values())
        self.engine.save_checkpoint(path, extra, include_optimizer=has_optimizer)  # asynchronous_checkpoints

    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        assert self.engine is not None
        path = Path(self.broadcast(str(path)))
        if path.is_file():
            return self._load_full_file(path, state, strict)
        if isinstance(state, nn.Module):
            state = {"model": state}
        state = state if isinstance(state, dict) else {}
        has_optimizer = any(isinstance(v, Optimizer) for v in state.values())
        requested = [k for k, v in state.items() if not isinstance(v, (nn.Module, Optimizer))]

        def check_requested(extra: dict[str, Any]) -> None:  # before anything is applied
            missing = [key for key in requested if key not in extra]
            if missing and strict:
                raise KeyError(f"{path} holds no entries {missing}; pass strict=False to skip them.")

        extra = self.engine.load_checkpoint(path, load_optimizer=has_optimizer, check_extra=check_requested)
        for key in requested:
            if key not in extra:
                continue
            if _is_stateful(state[key]):
                state[key].load_state_dict(extra.pop(key))
            else:
                state[key] = extra.pop(key)
        return extra

    def _load_full_file(self, path: Path, state: nn.Module | Optimizer | dict[str, Any] | None, strict: bool) -> Any:
        """A file of full state dicts (``fabric.save`` under DDP or one process): the module's weights and the
        optimizer's state are read by every rank for its own parts, both or neither applied."""
        assert self.engine is not None
        file = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not state:
            return file
        if isinstance(state, nn.Module):  # the file is the module's state dict itself
            self.engine.load_full_state_dict(file, strict=strict)
            return {}
        if isinstance(state, Optimizer) or not isinstance(file, dict):
            raise TypeError(
                f"{path} holds a bare state dict; load it with the model: fabric.load(path, model), or save "
                "{'model': model, 'optimizer': optimizer} together and pass the same dict to fabric.load."
            )
        missing = [key for key in state if key not in file]
        if missing and strict:
            raise KeyError(f"{path} holds no entries {missing}; pass strict=False to skip them.")
        present = {key: value for key, value in state.items() if key in file}
        modules = [key for key, value in present.items() if isinstance(value, nn.Module)]
        optimizers = [key for key, value in present.items() if isinstance(value, Optimizer)]
        if len(modules) > 1 or len(optimizers) > 1 or (optimizers and not modules):
            raise ValueError(
                f"fabric.load({path}, ...) under ZeRO restores one model and its optimizer together; "
                f"got models {modules} and optimizers {optimizers}."
            )
        if modules:
            optimizer_state = file.pop(optimizers[0]) if optimizers else None
            self.engine.load_full_state_dict(file.pop(modules[0]), strict=strict, optimizer_state_dict=optimizer_state)
        for key in present.keys() - {*modules, *optimizers}:
            if _is_stateful(state[key]):
                state[key].load_state_dict(file.pop(key))
            else:
                state[key] = file.pop(key)
        return file

    def teardown(self) -> None:
        teardown_keeping_module(self, self.precision)


def _is_stateful(value: Any) -> bool:
    """Fabric's notion of a stateful object: it has ``state_dict`` and ``load_state_dict``."""
    return (
        not isinstance(value, type)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )
