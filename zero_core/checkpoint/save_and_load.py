"""Saving and loading a sharded model's whole training state: model, optimizer, loss scale, steps.

The engine hands these functions a :class:`CheckpointTarget`, the explicit parts they work on (no
engine import: arrows point one way). Reading is all or nothing and agreed on every rank
(``loading.py``); only once every rank has read everything is the result applied, here, so a failed
load changes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import socket
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..collectives import CommContext, meeting
from ..host_memory import release_freed_memory
from ..memory.machine_memory import available_host_memory_bytes
from ..offload.nvme_load import NvmeLoad
from ..offload.nvme_save import FrozenNvmeReads
from ..optim.attachment import OptimizerAttachment
from ..optim.loss_scaling import LossScaler
from ..optim.rebuild import install_optimizer_state
from ..sizes import human_bytes
from ..unit import FlatUnit
from .agreed_steps import RankAgreement
from .background_save import BackgroundSave, staged
from .checkpoint_error import CheckpointError
from .checkpoint_records import MODEL_KEY, OPTIMIZER_KEY, EngineRecord, LoadedWeights, ShardedModel
from .directory import CheckpointDirs
from .full_optimizer import read_full_optimizer_state
from .full_weights import load_full_weights
from .loading import LoadedCheckpoint, load_checkpoint, open_checkpoint
from .saving import save_checkpoint, serialize_meta, sharded_state


@dataclass(frozen=True)
class CheckpointTarget:
    """What a save or load works on. The callables are the step's own barriers and resets."""

    model: nn.Module
    units: Sequence[FlatUnit]
    comm: CommContext
    attachment: OptimizerAttachment  # the optimizer, if one is attached, and its param-group view
    loss_scaler: LossScaler | None
    stage: int
    steps_taken: Callable[[], int]
    quiesce: Callable[[], None]  # the runtime's entry barrier
    quiesce_for_load: Callable[[bool], None]  # the same for a load (of the model and the optimizer's state?)
    sync_buffers: Callable[[], None]  # exports hold rank 0's buffers
    discard_grads: Callable[[], None]
    refresh_parameters: Callable[[], None]
    background: BackgroundSave  # asynchronous saves' writes (the optimizer step collects them too)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.attachment.optimizer


class Resumed(NamedTuple):
    extra: dict[str, Any]
    steps: int


def sharded_view(target: CheckpointTarget, operation: str | None = None, streaming: bool = False) -> ShardedModel:
    """What the checkpoint code sees. With ``operation`` (every rank is in it together), the
    param groups are read and compared first, agreed on every rank, so a group added,
    replaced or refused on one rank only fails everywhere alike. ``streaming`` (a save): what
    rests in the NVMe tier's files is read from there a few units at a time when written."""
    if operation is not None and target.optimizer is not None:
        groups = target.attachment
        RankAgreement(target.comm, operation).run("reading the optimizer's param groups", groups.read_groups)
        groups.compare_groups()
    return ShardedModel(
        target.model,
        target.units,
        target.comm,
        target.optimizer,
        target.attachment.group_names(),
        target.attachment.nvme_save_reads() if streaming else None,
    )


def sharded_model_state_dict(target: CheckpointTarget) -> dict[str, Any]:
    target.quiesce()
    return sharded_state(sharded_view(target), with_optimizer=False)[MODEL_KEY]


def sharded_optimizer_state_dict(target: CheckpointTarget) -> dict[str, Any]:
    with meeting("sharded_optimizer_state_dict()"):
        # Views of the state in memory: DCP may load into them as well as save them.
        target.attachment.make_state_resident()
        view = sharded_view(target, "collecting the optimizer's state")
        return sharded_state(view, with_model=False)[OPTIMIZER_KEY]


class _Directory(NamedTuple):
    """One directory a save writes, and what goes into it."""

    path: str | os.PathLike
    with_model: bool
    with_optimizer: bool


class SaveTiming(enum.Enum):
    """When a save's files are written, read by ``_save``: before it returns, or in the background (staged in
    host memory first), and what happens where host memory cannot hold the staged copy."""

    SYNCHRONOUS = "synchronous"
    ASYNCHRONOUS = "asynchronous"  # refused where host memory cannot stage it
    ASYNCHRONOUS_OR_SYNCHRONOUS = "asynchronous, else synchronous"  # asynchronous_checkpoints_fallback

    @classmethod
    def of(cls, asynchronous: bool, fallback: bool) -> SaveTiming:
        if not asynchronous:
            return cls.SYNCHRONOUS
        return cls.ASYNCHRONOUS_OR_SYNCHRONOUS if fallback else cls.ASYNCHRONOUS


class _SaveRequest(NamedTuple):
    """What one ``save`` call asked for."""

    path: str | os.PathLike
    extra: dict[str, Any]
    directories: list[_Directory]
    timing: SaveTiming
    when_done: Callable[[Path, BaseException | None], None] | None


def save(
    target: CheckpointTarget,
    path: str | os.PathLike,
    extra: dict[str, Any] | None,
    *,
    include_optimizer: bool,
    include_model: bool,
    optimizer_path: str | os.PathLike | None = None,
    timing: SaveTiming = SaveTiming.SYNCHRONOUS,
    when_done: Callable[[Path, BaseException | None], None] | None = None,
) -> Path:
    """``optimizer_path``: the optimizer into this other directory, written first (the larger write: if it fails,
    the model's directory is as it was), the model into ``path``; both hold ``extra`` and the step count, as
    ``load``'s ``optimizer_path`` checks. ``timing`` asynchronous: return once the state is staged in host
    memory; the files are written in the background (``background_save.py``), each directory appearing once
    every rank's write of it succeeded. ``when_done(path, error)``: on every rank once the save ended, ``error``
    None once every directory is on disk, else the error about to be raised (before a synchronous save returns
    or raises; where an asynchronous one's write is collected)."""
    if not (include_model or include_optimizer):
        raise ValueError("Nothing to save: include the model, the optimizer or both.")
    if optimizer_path is not None and not (include_model and include_optimizer and target.optimizer is not None):
        raise ValueError(
            "optimizer_path= writes the optimizer apart from the model: it needs an attached optimizer and "
            "include_model and include_optimizer left True."
        )
    if optimizer_path is None:
        directories = [_Directory(path, include_model, include_optimizer and target.optimizer is not None)]
    else:
        directories = [_Directory(optimizer_path, False, True), _Directory(path, True, False)]
    with meeting("save_checkpoint()"):
        target.background.wait()  # the previous asynchronous save first: its error is raised here
        try:
            written, in_background = _save(
                target, _SaveRequest(path, dict(extra or {}), directories, timing, when_done)
            )
        except CheckpointError as error:
            if when_done is not None:
                when_done(CheckpointDirs.of(path).path, error)
            raise
    if not in_background and when_done is not None:
        when_done(written, None)
    return written


def wait_for_background_save(target: CheckpointTarget) -> Path | None:
    with meeting("wait_for_checkpoint()"):
        return target.background.wait()


def _save(target: CheckpointTarget, request: _SaveRequest) -> tuple[Path, bool]:
    """The path written, and whether it is being written in the background."""
    target.quiesce()
    target.sync_buffers()
    target.attachment.refuse_while_stepped("state_dict() (or saving it)")
    scaler = dataclasses.replace(target.loss_scaler.state) if target.loss_scaler is not None else None
    record = EngineRecord(target.stage, target.comm.world_size, target.steps_taken(), scaler)
    view = sharded_view(target, f"saving checkpoint {request.path}", streaming=True)
    try:
        if request.timing is not SaveTiming.SYNCHRONOUS:
            started = _start_background_save(target, request, record, view)
            if started is not None:
                return started, True
            # Host memory cannot stage it (agreed: every rank falls back alike): written now.
        for directory in request.directories:

            def collect(directory: _Directory = directory) -> dict[str, Any]:
                return sharded_state(view, directory.with_model, directory.with_optimizer)

            written = save_checkpoint(
                target.comm, directory.path, request.extra, record, collect, in_order=view.resting is not None
            )
        return written, False  # the last directory: the model's, at ``path``
    finally:
        release_freed_memory()  # the pieces the save copied out: else the heap keeps them


def _start_background_save(
    target: CheckpointTarget, request: _SaveRequest, record: EngineRecord, view: ShardedModel
) -> Path | None:
    """Stage the state of every directory and the extra state (a copy: nothing aliases what training changes
    next), agreed on every rank, then start the write. The extra state is checked now, as a synchronous save
    would refuse it. Where host memory cannot hold the copy: refused, or under ``ASYNCHRONOUS_OR_SYNCHRONOUS``
    None (nothing staged; the caller writes it synchronously)."""
    agreement = RankAgreement(target.comm, f"saving checkpoint {request.path} asynchronously")
    # The NVMe tier's resting files linked, not read: the writer reads the links (none where they cannot be).
    frozen = view.resting.frozen() if view.resting is not None else None
    if frozen is not None:
        view = dataclasses.replace(view, resting=frozen)
    try:
        started = _stage_and_start(target, request, record, view, agreement, frozen)
    except BaseException:
        if frozen is not None:
            frozen.close()
        raise
    if started is None and frozen is not None:  # not staged: the links are not read
        frozen.close()
    return started


def _stage_and_start(
    target: CheckpointTarget,
    request: _SaveRequest,
    record: EngineRecord,
    view: ShardedModel,
    agreement: RankAgreement,
    frozen: FrozenNvmeReads | None,
) -> Path | None:
    states: list[dict[str, Any]] = []

    def measure() -> tuple[str, int, int]:
        states.extend(sharded_state(view, d.with_model, d.with_optimizer) for d in request.directories)  # views
        _, fresh = target.background.bytes_to_stage(states)
        return socket.gethostname(), fresh, available_host_memory_bytes()

    _, needs = agreement.run("measuring host memory for the staged copy", measure, share=True)
    if problem := staging_memory_problem(needs):  # every rank's figures alike: the same verdict everywhere
        if request.timing is SaveTiming.ASYNCHRONOUS_OR_SYNCHRONOUS:
            if target.comm.rank == 0:
                warnings.warn(
                    f"Saving checkpoint {request.path} synchronously: {problem} (asynchronous_checkpoints_fallback).",
                    stacklevel=2,
                )
            return None
        raise CheckpointError(
            f"Saving checkpoint {request.path} asynchronously was refused before staging: {problem} Save synchronously "
            "(asynchronous=False, or asynchronous_checkpoints off; asynchronous_checkpoints_fallback does so by "
            "itself), or free host memory. Nothing was written; training can go on."
        )

    def stage() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if target.comm.rank == 0:
            serialize_meta(request.extra)
        return target.background.stage(states), staged(request.extra)[0]

    (staged_states, staged_extra), _ = agreement.run("staging the state in host memory", stage)
    finals = [CheckpointDirs.of(d.path).path for d in request.directories]

    def write(comm: CommContext) -> Path:
        try:
            for final, state in zip(finals, staged_states):
                # In order where the state is read from the NVMe tier's links: a few units in memory at a time.
                in_order = frozen is not None
                save_checkpoint(comm, final, staged_extra, record, functools.partial(_given, state), in_order=in_order)
        finally:
            if frozen is not None:
                frozen.close()
        return finals[-1]

    target.background.start(finals[-1], write, request.when_done)
    return finals[-1]


def _given(state: dict[str, Any]) -> dict[str, Any]:
    return state


def staging_memory_problem(needs: list[tuple[str, int, int]]) -> str | None:
    """What is wrong with every rank's (host, bytes its staged copy allocates, host bytes available to it), or
    None: the ranks on one host share its memory, so their needs add up against the least any of them sees."""
    hosts: dict[str, list[int]] = {}
    for rank, (host, _, _) in enumerate(needs):
        hosts.setdefault(host, []).append(rank)
    for host, ranks in hosts.items():
        need = sum(needs[rank][1] for rank in ranks)
        available = min(needs[rank][2] for rank in ranks)
        if need > available:
            return (
                f"host {host} has {human_bytes(available)} of memory available and its ranks {ranks} need "
                f"{human_bytes(need)} more for their copies of the state."
            )
    return None


def read_extra(target: CheckpointTarget, path: str | os.PathLike) -> dict[str, Any]:
    with meeting("read_checkpoint_extra()"):
        target.background.wait()
        return open_checkpoint(RankAgreement(target.comm, f"reading the extra state of checkpoint {path}"), path).extra


def _read(
    view: ShardedModel,
    path: str | os.PathLike,
    optimizer_path: str | os.PathLike | None,
    load_model: bool,
    with_optimizer: bool,
    staging: NvmeLoad | None,
) -> LoadedCheckpoint:
    """The checkpoint at ``path``, its optimizer from ``optimizer_path`` when given (one save, two directories)."""
    loaded = load_checkpoint(
        view, path, load_model=load_model, load_optimizer=with_optimizer and optimizer_path is None, staging=staging
    )
    if with_optimizer and optimizer_path is not None:
        apart = load_checkpoint(view, optimizer_path, load_model=False, load_optimizer=True, staging=staging)
        if (apart.extra, apart.record.steps) != (loaded.extra, loaded.record.steps):
            raise CheckpointError(
                f"{optimizer_path} and {path} come from different saves ({apart.record.steps} and "
                f"{loaded.record.steps} steps, or other extra state): a save that failed between the two? "
                "Load an earlier pair."
            )
        loaded = loaded._replace(optimizer=apart.optimizer)
    return loaded


def load(
    target: CheckpointTarget,
    path: str | os.PathLike,
    *,
    load_optimizer: bool,
    load_model: bool,
    optimizer_path: str | os.PathLike | None,
    check_extra: Callable[[dict[str, Any]], None] | None,
) -> Resumed:
    """``optimizer_path``: the optimizer from this other directory (one saved with ``include_model=False``, as
    Accelerate keeps them apart); both must hold the same ``extra`` and step count, or the pair is refused.
    ``check_extra``: called with the loaded ``extra`` before anything is applied; what it raises leaves
    everything as it was (``extra`` is the same on every rank, so it raises on every rank alike).
    All or nothing: model, optimizer, loss scale and step count change only once every rank has read
    everything. Gradients accumulated before the load are discarded."""
    with meeting("load_checkpoint()"):
        target.background.wait()  # an asynchronous save still being written, perhaps of this very checkpoint
        return _load(target, path, load_optimizer, load_model, optimizer_path, check_extra)


def _load(
    target: CheckpointTarget,
    path: str | os.PathLike,
    load_optimizer: bool,
    load_model: bool,
    optimizer_path: str | os.PathLike | None,
    check_extra: Callable[[dict[str, Any]], None] | None,
) -> Resumed:
    target.quiesce_for_load(load_model and load_optimizer)
    view = sharded_view(target, f"loading checkpoint {path}")
    staging = target.attachment.nvme_load()  # the NVMe tier's units: read one at a time into files
    try:
        with_optimizer = load_optimizer and target.optimizer is not None
        loaded = _read(view, path, optimizer_path, load_model, with_optimizer, staging)
        if check_extra is not None:
            check_extra(loaded.extra)
    except BaseException:
        if staging is not None:
            staging.discard()
        raise
    if loaded.weights is not None:
        _install_weights(target, loaded.weights)
    if loaded.optimizer is not None:
        install_optimizer_state(target.optimizer, loaded.optimizer.group_settings, loaded.optimizer.state)
        target.attachment.state_replaced()
    if staging is not None:
        staging.install(target.optimizer)
    target.refresh_parameters()
    if target.loss_scaler is not None and loaded.record.loss_scaler is not None:
        target.loss_scaler.state = loaded.record.loss_scaler
    return Resumed(loaded.extra, loaded.record.steps)


def load_full_state(
    target: CheckpointTarget,
    source: Mapping[str, torch.Tensor] | str | os.PathLike,
    strict: bool,
    optimizer_state: Mapping[str, Any] | None,
) -> None:
    """Full weights and, when given, a full optimizer state dict (torch's or FSDP's layout), all or nothing:
    both are read and agreed on every rank before either is installed."""
    if optimizer_state is not None and target.optimizer is None:
        raise ValueError("optimizer_state_dict was given, but no optimizer is attached to load it into.")
    with meeting("load_full_state_dict()"):
        target.background.wait()
        _load_full_state(target, source, strict, optimizer_state)


def _load_full_state(
    target: CheckpointTarget,
    source: Mapping[str, torch.Tensor] | str | os.PathLike,
    strict: bool,
    optimizer_state: Mapping[str, Any] | None,
) -> None:
    target.quiesce_for_load(optimizer_state is not None)
    where = "a state dict" if isinstance(source, Mapping) else str(source)
    view = sharded_view(target, None if optimizer_state is None else f"loading the optimizer state from {where}")
    weights = load_full_weights(view, source, strict=strict)
    optimizer = None if optimizer_state is None else read_full_optimizer_state(view, optimizer_state, where)
    _install_weights(target, weights)
    if optimizer is not None:
        install_optimizer_state(target.optimizer, optimizer.group_settings, optimizer.state)
        target.attachment.state_replaced()
    target.refresh_parameters()


def _install_weights(target: CheckpointTarget, weights: LoadedWeights) -> None:
    """Put weights every rank loaded in place; gradients of the old weights are dropped."""
    target.discard_grads()
    for unit, shard in zip(target.units, weights.master_shards):
        if shard is not None:  # None: the NVMe tier's file has it (NvmeLoad.install)
            unit.storage.load_master_shard(shard)
    live = target.model.state_dict(keep_vars=True)
    for key, value in weights.buffers.items():
        live[key].detach().copy_(value)
