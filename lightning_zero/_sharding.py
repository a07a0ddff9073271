"""What the Trainer and Fabric strategies share: their arguments turned into the
core's config (DeepSpeed's keywords and config too), the precision plugin they
coerce to, building the engine, teardown, and registration."""

from __future__ import annotations

import inspect
import tempfile
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from zero_core import ZeroConfig, ZeroEngine, setup_summary, tensor_parallel_mesh, user_settings
from zero_core.deepspeed import DeepSpeedSettings
from zero_core.sharding import shard_module

from .deepspeed_arguments import settings_with_deepspeed, take_deepspeed_keywords
from .deepspeed_config import Config
from .precision_plugins import ZeroPrecisionSettings

PrecisionT = TypeVar("PrecisionT", bound=ZeroPrecisionSettings)
InitT = TypeVar("InitT", bound=Callable[..., None])
ClassT = TypeVar("ClassT", bound=type)


def zero_settings(settings: Mapping[str, Any]) -> ZeroConfig:
    """The Trainer's and Fabric's ZeRO keyword arguments (any of the schema's settings; the others
    take their defaults) as the core's config, validated when the strategy is built, before
    Lightning launches any process."""
    by_name = {s.name: s for s in user_settings()}
    return ZeroConfig(**{name: by_name[name].keyword.to_config(value) for name, value in settings.items()})


def strategy_settings(
    owner: type, config: Config, args: tuple[Any, ...], settings: dict[str, Any]
) -> tuple[ZeroConfig, DeepSpeedSettings | None]:
    """A strategy's ZeRO config from its arguments (``stage`` by position, the schema's keywords, Lightning's
    ``DeepSpeedStrategy`` keywords, a DeepSpeed ``config``), and what the DeepSpeed config says besides (None
    without one): validated when the strategy is built, before Lightning launches any process."""
    deepspeed_keywords = take_deepspeed_keywords(settings)  # DeepSpeedStrategy's own (deepspeed_arguments.py)
    explicit, deepspeed = settings_with_deepspeed(
        owner.__name__, config, deepspeed_keywords, bind_settings(owner, args, settings)
    )
    return zero_settings(explicit), deepspeed


def zero_precision(plugin: Any, precision_class: type[PrecisionT]) -> PrecisionT:
    """The strategy's precision plugin read as ``precision_class`` (the default one when none was given)."""
    return as_zero_precision(plugin, precision_class) or precision_class()


def settings_parameters(positional: tuple[str, ...] = ("stage",)) -> list[inspect.Parameter]:
    """The schema's settings as keyword parameters (those named in ``positional`` may also be
    passed by position, first, as ``ZeroStrategy(3)``)."""
    kinds = {True: inspect.Parameter.POSITIONAL_OR_KEYWORD, False: inspect.Parameter.KEYWORD_ONLY}
    settings = sorted(user_settings(), key=lambda s: s.name not in positional)  # stable: schema order otherwise
    return [
        inspect.Parameter(
            s.name, kinds[s.name in positional], default=s.keyword.default, annotation=s.keyword.annotation
        )
        for s in settings
    ]


def with_settings_signature(init: InitT) -> InitT:
    """Give ``init(self, *args, <framework keywords>, **settings)`` the signature that lists the
    settings as real parameters, which is what LightningCLI/jsonargparse and ``help()`` read."""
    own = inspect.signature(init)
    kept = [p for p in own.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    init.__signature__ = own.replace(parameters=[kept[0], *settings_parameters(), *kept[1:]])  # type: ignore[attr-defined]
    return init


def bind_settings(owner: type, args: tuple[Any, ...], settings: dict[str, Any]) -> dict[str, Any]:
    """The settings passed to ``owner.__init__``, by name; a wrong name or one too many
    positional arguments raise the ``TypeError`` Python raises for a written-out signature."""
    signature = inspect.Signature(settings_parameters())
    try:
        return dict(signature.bind(*args, **settings).arguments)
    except TypeError as error:
        raise TypeError(f"{owner.__qualname__}.__init__() {error}") from None


def with_settings_doc(cls: ClassT) -> ClassT:
    """Append the settings' lines, from the schema's docs, to the "Args:" that ends ``cls``'s docstring."""
    lines = [f"        {s.name}: {s.doc} (default: {s.keyword.default!r})." for s in user_settings()]
    cls.__doc__ = "\n".join([(cls.__doc__ or "").rstrip(), *lines]) + "\n"
    return cls


# Lightning's DeepSpeed presets (DeepSpeedStrategy.register_strategies), by our names: the same settings.
# deepspeed_stage_3_offload_nvme writes to /local_nvme, which a fresh machine lacks: ours to the system's temporary
# directory (tempfile.gettempdir(), /tmp on Linux), which every machine has; name a fast disk with
# ZeroStrategy(stage=3, offload_optimizer="nvme", offload_params="nvme", offload_dir="/local_nvme").
OFFLOAD_PRESETS = {
    "zero2_offload": ("ZeRO stage 2, optimizer offloaded to the CPU", {"stage": 2, "offload_optimizer": "cpu"}),
    "zero3_offload": (
        "ZeRO stage 3, optimizer and parameters offloaded to the CPU",
        {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    ),
    "zero3_offload_nvme": (
        "ZeRO stage 3, optimizer and parameters offloaded to files (offload_dir: the temporary directory)",
        {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme", "offload_dir": tempfile.gettempdir()},
    ),
}


def register_zero_strategies(strategy_class: type, registry: Any) -> None:
    for stage in (1, 2, 3):
        registry.register(
            f"zero{stage}",
            strategy_class,
            description=f"ZeRO stage {stage} (lightning-zero)",
            stage=stage,
            override=True,
        )
    registry.register(
        "zero_auto",
        strategy_class,
        description="ZeRO with the stage, offload and checkpointing chosen for each rank's device memory at setup "
        "(memory_budget='auto', measured on the LightningModule's example_input_array; lightning-zero)",
        memory_budget="auto",
        override=True,
    )
    for name, (description, settings) in OFFLOAD_PRESETS.items():
        description = f"{description} (lightning-zero)"
        registry.register(name, strategy_class, description=description, override=True, **settings)


def as_zero_precision(plugin: Any, precision_class: type[PrecisionT]) -> PrecisionT | None:
    """Lightning hands every strategy its generic plugin for the precision flag;
    ZeRO owns the precision, so keep only the flag."""
    if plugin is None or isinstance(plugin, precision_class):
        return plugin
    return precision_class(getattr(plugin, "precision", "32-true"))


def build_engine(
    module: nn.Module,
    optimizer: Optimizer | None,
    config: ZeroConfig,
    precision: ZeroPrecisionSettings,
    device: torch.device,
    device_mesh: DeviceMesh | None = None,
) -> ZeroEngine:
    """Shard ``module`` in the precision's dtypes and hand the engine to the precision plugin."""
    config = replace(config, mixed_precision=precision.policy)
    engine = shard_module(module, optimizer, config, device, device_mesh=device_mesh)
    precision.engine = engine
    rank_zero_info(setup_summary(engine))  # one line, as Lightning logs its own strategies' setup
    return engine


class TensorParallelMesh:
    """What the Trainer's and Fabric's strategies do alike with ``tensor_parallel_size``: build the 2-D
    mesh once the process group is up, divide data over its data-parallel ranks only (a tensor-parallel
    group splits one batch), and build the model for real (the split needs its weights). Mixed in
    before the framework's DDP strategy."""

    zero_config: ZeroConfig
    root_device: torch.device
    _device_mesh: DeviceMesh | None = None  # tensor_parallel_size > 1: data_parallel × tensor_parallel

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        if self.zero_config.tensor_parallel_size > 1:
            self._device_mesh = tensor_parallel_mesh(self.zero_config.tensor_parallel_size, self.root_device.type)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._device_mesh is None:
            return super().distributed_sampler_kwargs  # type: ignore[misc]
        data_parallel = self._device_mesh["data_parallel"]
        return {"num_replicas": data_parallel.size(), "rank": data_parallel.get_local_rank()}

    def on_meta_device(self) -> AbstractContextManager[Any]:
        """Where the model is built inside the sharded context: the meta device (the engine materialises unit
        by unit), except under tensor parallelism, whose split needs the real weights first."""
        return torch.device("meta") if self._device_mesh is None else nullcontext()


def wait_before_removing(engine: ZeroEngine | None, filepath: Any) -> None:
    """A checkpoint an asynchronous save is still writing is waited for before it is removed (ModelCheckpoint
    removes the checkpoints it no longer keeps, on every rank); any other removal does not wait."""
    if engine is not None and engine.checkpoint_being_written == Path(filepath).absolute():
        engine.wait_for_checkpoint()


def teardown_keeping_module(strategy: Any, precision: Any) -> None:
    """DDP's teardown without moving the module: its parameters are views of the
    engine's buffers (``engine.unshard()`` gives an ordinary module back). An asynchronous save still being
    written is waited for first: the end of training is the last point its error can be raised."""
    if strategy.engine is not None:
        strategy.engine.wait_for_checkpoint()
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.teardown()
    precision.teardown()
    if strategy.accelerator is not None:
        strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()


def check_sync_batchnorm_device(device: torch.device) -> None:
    """torch's SyncBatchNorm trains on accelerators only; say so before training starts."""
    if device.type == "cpu":
        raise ValueError(
            "Trainer(sync_batchnorm=True) needs GPUs: torch's SyncBatchNorm trains only on CUDA, XPU or HPU "
            "devices. On CPU leave it off; ZeRO broadcasts rank 0's BatchNorm statistics before each "
            "training forward, as DDP does (broadcast_buffers=True)."
        )


def refuse_late_sync_batchnorm(module: nn.Module) -> None:
    """sync_batchnorm asked for on a module an earlier fit sharded without it: converting
    now would replace sharded layers."""
    if any(type(m) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) for m in module.modules()):
        raise ValueError(
            "Trainer(sync_batchnorm=True) on a module an earlier fit sharded without it: its BatchNorm layers "
            "cannot be converted once sharded. Use the same sync_batchnorm setting for every fit of a module, "
            "or call lightning_zero's engine.unshard() (zero_core.engine_of(module).unshard()) first."
        )
