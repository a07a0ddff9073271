"""The engine's checkpoint methods: sharded state dicts, save, load, full weights.

A mixin of :class:`~zero_core.engine.ZeroEngine`, kept apart so the engine
reads as the training step. The checkpoint package sees only a narrow
:class:`ShardedModel` view and returns what it loaded; applying it to the
engine (shards, buffers, optimizer, loss scale, step counter) happens here,
once every rank has read everything, so a failed load changes nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint.agreement import RankAgreement
from .checkpoint.errors import CheckpointError
from .checkpoint.full_weights import load_full_weights
from .checkpoint.loading import load_checkpoint, open_checkpoint
from .checkpoint.records import MODEL_KEY, OPTIMIZER_KEY, EngineRecord, LoadedWeights, ShardedModel
from .checkpoint.saving import save_checkpoint, sharded_state
from .optim.rebuild import install_optimizer_state

if TYPE_CHECKING:
    from .engine import ZeroEngine


class CheckpointMethods:
    def _sharded_view(self: "ZeroEngine", operation: str | None = None) -> ShardedModel:
        """What the checkpoint code sees. With ``operation`` (every rank is in it together), the
        param groups are read and compared first, agreed on every rank, so a group added,
        replaced or refused on one rank only fails everywhere alike."""
        if operation is not None and self.optimizer is not None:
            RankAgreement(self.comm, operation).run("reading the optimizer's param groups", self._read_param_groups)
            self._compare_param_groups()
        names = self._groups.names if self._groups is not None else []  # as last read
        return ShardedModel(self.model, self.units, self.comm, self.optimizer, names)

    def sharded_model_state_dict(self: "ZeroEngine") -> dict[str, Any]:
        """``model.state_dict()``'s keys, parameters as DCP-checkpointable views of this rank's fp32 shard
        (full logical shapes), buffers as they are: for ``torch.distributed.checkpoint.save``."""
        return sharded_state(self._sharded_view(), with_optimizer=False)[MODEL_KEY]

    def sharded_optimizer_state_dict(self: "ZeroEngine") -> dict[str, Any]:
        """The optimizer's state dict in FSDP's layout (state by parameter name, over this rank's shard).

        Every rank calls it: param groups added since the last step are compared across ranks first."""
        return sharded_state(self._sharded_view("collecting the optimizer's state"), with_model=False)[OPTIMIZER_KEY]

    def save_checkpoint(
        self: "ZeroEngine",
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
        if not (include_model or include_optimizer):
            raise ValueError("Nothing to save: include the model, the optimizer or both.")
        self.runtime.quiesce()
        self.sync_buffers_for_export()
        scaler = dataclasses.replace(self.loss_scaler.state) if self.loss_scaler is not None else None
        record = EngineRecord(self.stage, self.world_size, self.steps_taken, scaler)
        return save_checkpoint(
            self._sharded_view(f"saving checkpoint {path}"),
            path,
            dict(extra or {}),
            record,
            include_model=include_model,
            include_optimizer=include_optimizer and self.optimizer is not None,
        )

    def read_checkpoint_extra(self: "ZeroEngine", path: str | os.PathLike) -> dict[str, Any]:
        """The ``extra`` state of ``save_checkpoint``'s directory, verified and read on every
        rank, without loading anything. Every rank calls it; a bad checkpoint raises the same
        ``CheckpointError`` everywhere."""
        return open_checkpoint(RankAgreement(self.comm, f"reading the extra state of checkpoint {path}"), path).extra

    def load_checkpoint(
        self: "ZeroEngine",
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
        self.runtime.quiesce()
        view, with_optimizer = (
            self._sharded_view(f"loading checkpoint {path}"),
            load_optimizer and self.optimizer is not None,
        )
        loaded = load_checkpoint(
            view, path, load_model=load_model, load_optimizer=with_optimizer and optimizer_path is None
        )
        if with_optimizer and optimizer_path is not None:
            apart = load_checkpoint(view, optimizer_path, load_model=False, load_optimizer=True)
            if (apart.extra, apart.record.steps) != (loaded.extra, loaded.record.steps):
                raise CheckpointError(
                    f"{optimizer_path} and {path} come from different saves ({apart.record.steps} and "
                    f"{loaded.record.steps} steps, or other extra state): a save that failed between the two? "
                    "Load an earlier pair."
                )
            loaded = loaded._replace(optimizer=apart.optimizer)
        if check_extra is not None:
            check_extra(loaded.extra)
        if loaded.weights is not None:
            self._install_weights(loaded.weights)
        if loaded.optimizer is not None:
            install_optimizer_state(self.optimizer, loaded.optimizer.group_settings, loaded.optimizer.state)
        self.refresh_parameters()
        if self.loss_scaler is not None and loaded.record.loss_scaler is not None:
            self.loss_scaler.state = loaded.record.loss_scaler
        self.steps_taken = loaded.record.steps
        return loaded.extra

    def load_full_state_dict(
        self: "ZeroEngine", source: Mapping[str, torch.Tensor] | str | os.PathLike, strict: bool = True
    ) -> None:
        """Load ordinary full weights (a state dict, or a .safetensors / torch file) into the shards.

        Each rank reads only the parts of each tensor its shard covers
        (safetensors slices, or memory-mapped torch files).
        """
        self.runtime.quiesce()
        self._install_weights(load_full_weights(self._sharded_view(), source, strict=strict))
        self.refresh_parameters()

    def _install_weights(self: "ZeroEngine", weights: LoadedWeights) -> None:
        """Put weights every rank loaded in place; gradients of the old weights are dropped."""
        self.zero_grad()
        for unit, shard in zip(self.units, weights.master_shards):
            unit.master_shard.copy_(shard)
        live = self.model.state_dict(keep_vars=True)
        for key, value in weights.buffers.items():
            live[key].detach().copy_(value)
