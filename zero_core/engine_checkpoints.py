"""The engine's checkpoint methods: sharded state dicts for DCP, a sharded checkpoint directory saved and
loaded atomically, and full weights loaded into the shards.

``ZeroEngine`` takes them from ``EngineCheckpoints``; each forwards to ``checkpoint/save_and_load.py``
with the engine's ``CheckpointTarget`` (``build.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .build import EngineParts
from .checkpoint import save_and_load
from .step.optimizer_step import OptimizerStep


class EngineCheckpoints:
    """``ZeroEngine``'s checkpoint methods, over the parts the engine built (``_parts.checkpoints``)."""

    _parts: EngineParts
    _optimizer_step: OptimizerStep

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
    ) -> Path:
        """Write model, optimizer and ``extra`` as a sharded DCP directory, atomically: every rank writes its own
        pieces; a failure anywhere raises the same ``CheckpointError`` everywhere and leaves the checkpoint at
        ``path`` as it was. Without the optimizer it is what ``accelerate merge-weights`` consolidates."""
        targets = {"include_optimizer": include_optimizer, "include_model": include_model}
        return save_and_load.save(self._parts.checkpoints, path, extra, **targets)

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
