"""Tensor parallelism through ``ZeroAccelerator``: ZeRO over the data-parallel dimension of a 2-D mesh.

The size comes from ``ZeroPlugin(tensor_parallel_size=n)`` (its ``ACCELERATE_ZERO_TENSOR_PARALLEL_SIZE``
variable) or from Accelerate's own setting, ``ParallelismConfig(tp_size=n)`` (the deprecated
``TorchTensorParallelPlugin(tp_size=n)``, or ``PARALLELISM_CONFIG_TP_SIZE`` under
``ACCELERATE_USE_PARALLELISM_CONFIG``). Accelerate's own mesh serves its FSDP2 and refuses CPU processes, so
the setting is taken from it and the accelerator builds ours: ``accelerator.device_mesh``, data_parallel ×
tensor_parallel, consecutive ranks splitting a layer as Accelerate's "tp" dimension does. As under
Accelerate's own tensor parallelism, the model is split before ``prepare`` (over
``accelerator.device_mesh["tensor_parallel"]``), and its optimizer is made over the split parameters.

What Accelerate does per process is then done per data-parallel rank: dataloaders divide the data among the
data-parallel ranks (the ranks of one tensor-parallel group see the same batches), and ``gather``,
``gather_for_metrics`` and ``reduce`` count each data-parallel rank once, and schedulers step once per
data-parallel rank (``accelerator.num_processes`` stays the number of processes).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import recursively_apply
from torch.distributed.device_mesh import DeviceMesh

from zero_core import tensor_parallel_mesh

from .plugin import ZeroPlugin

_ACCELERATE_SWITCH = "ACCELERATE_USE_PARALLELISM_CONFIG"
_ACCELERATE_TP_SIZE = "PARALLELISM_CONFIG_TP_SIZE"


def tensor_parallel_size(plugin: ZeroPlugin, accelerator_kwargs: dict[str, Any]) -> int:
    """The one size both settings name (ours and Accelerate's), 1 when neither does; the others of
    Accelerate's parallelism (its FSDP dimensions, context parallelism) are refused: ZeRO shards the
    data-parallel ranks itself."""
    config = accelerator_kwargs.get("parallelism_config")
    plugin_tp = accelerator_kwargs.get("torch_tp_plugin")
    if config is None and os.environ.get(_ACCELERATE_SWITCH, "false").lower() == "true":
        from accelerate.parallelism_config import ParallelismConfig

        config = ParallelismConfig()  # its sizes from Accelerate's PARALLELISM_CONFIG_* variables
    theirs = 1
    if config is not None:
        others = {
            name: getattr(config, name, 1) or 1 for name in ("dp_replicate_size", "dp_shard_size", "cp_size", "sp_size")
        }
        set_others = {name: size for name, size in others.items() if size != 1}
        if set_others:
            raise ValueError(
                f"ParallelismConfig sets {set_others}: with ZeRO only tp_size applies (ZeRO shards over the "
                "data-parallel ranks itself: stage and shard_group_size in ZeroPlugin). Set only tp_size."
            )
        theirs = config.tp_size or 1
    elif plugin_tp is not None:
        theirs = plugin_tp.tp_size
    ours = plugin.tensor_parallel_size
    if ours != 1 and theirs != 1 and ours != theirs:
        raise ValueError(
            f"ZeroPlugin(tensor_parallel_size={ours}) and Accelerate's tp_size={theirs} differ: set one of them."
        )
    return max(ours, theirs)


@contextlib.contextmanager
def accelerate_without_its_parallelism(accelerator_kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Accelerate's ``__init__`` without its own parallelism (read above): it would build its FSDP2 mesh, and
    refuse CPU processes."""
    kwargs = {k: v for k, v in accelerator_kwargs.items() if k not in ("parallelism_config", "torch_tp_plugin")}
    switch = os.environ.pop(_ACCELERATE_SWITCH, None)
    try:
        yield kwargs
    finally:
        if switch is not None:
            os.environ[_ACCELERATE_SWITCH] = switch


def build_mesh(size: int, device: torch.device) -> DeviceMesh | None:
    return tensor_parallel_mesh(size, device_type=device.type) if size > 1 else None


class DataParallelRanks:
    """Accelerate's per-process data operations, per data-parallel rank of the mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.size = mesh["data_parallel"].size()
        self.rank = mesh["data_parallel"].get_local_rank()
        self.tensor_parallel_size = mesh["tensor_parallel"].size()
        self.group = mesh["data_parallel"].get_group()

    def first_of_each_group(self, gathered: Any) -> Any:
        """A world gather (every process's tensor, in rank order) less the copies: tensor-parallel ranks are
        consecutive, so every ``tensor_parallel_size``-th process's piece is kept."""
        world = dist.get_world_size()

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            return torch.cat(tensor.tensor_split(world)[:: self.tensor_parallel_size])

        return recursively_apply(keep, gathered)

    def reduce(self, data: Any, reduction: str) -> Any:
        """Accelerate's reduce over the data-parallel ranks (its ``scale`` is not applied on torch backends)."""
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if reduction not in ops:
            raise ValueError(f"reduction={reduction!r}: use one of {sorted(ops)} or 'none'.")

        def reduced(tensor: torch.Tensor) -> torch.Tensor:
            result = tensor.clone()
            dist.all_reduce(result, op=ops[reduction], group=self.group)
            return result / self.size if reduction == "mean" else result

        return recursively_apply(reduced, data)


class DataParallelScheduler(AcceleratedScheduler):
    """Accelerate steps a scheduler once per process per optimizer step (each process read 1/world of the
    data); with tensor parallelism each data-parallel rank reads 1/data-parallel of it: once per
    data-parallel rank."""

    data_parallel_size = 1

    def step(self, *args: Any, **kwargs: Any) -> None:
        skipped = any(optimizer.step_was_skipped for optimizer in self.optimizers)
        if not self.step_with_optimizer or self.split_batches or not self.gradient_state.sync_gradients or skipped:
            super().step(*args, **kwargs)
            return
        for _ in range(self.data_parallel_size):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycle, as Accelerate guards it
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)
