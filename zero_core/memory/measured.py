"""Per-rank bytes of model state, measured from live tensors and predicted by
the README's formulas ("Memory and communication")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .config import MixedPrecision, StagePlan
from .unit import FlatUnit


@dataclass(frozen=True)
class MemoryReport:
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int  # includes the fp32 master shard when it is a separate tensor
    nvme_bytes: int = 0  # in the NVMe tier's files now, not in memory: optimizer state, parameter shards
    # Of the three above, what the offloaded units keep in host memory: their master shards, optimizer state
    # and gradient copies (offload_optimizer) and their parameter shards at rest (offload_params). The rest
    # is on the device.
    host_bytes: int = 0

    @property
    def model_state_bytes(self) -> int:
        """In memory, device and host together (not the NVMe files)."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def device_bytes(self) -> int:
        return self.model_state_bytes - self.host_bytes


@dataclass(frozen=True)
class UnitReport:
    """One unit (the parameters gathered, reduced and sharded together) as ``engine.unit_reports()`` sees it now."""

    name: str  # the module path of the unit's root module ("" for the model's root)
    numel: int  # parameter elements (each shared parameter once)
    trainable_numel: int  # of those, the elements of parameters that require grad now
    padded_numel: int  # elements one all-gather or reduce-scatter of the whole unit moves
    persistent: bool  # stage 3: kept gathered between steps (persistence_threshold)
    refreshing: bool  # stages 1/2: the post-step all-gather may still be writing its parameters
    offloaded: bool = False  # offload_optimizer: its master shard and optimizer state live on the host
    params_offloaded: bool = False  # offload_params: its parameter shard rests on the host between gathers
    shard_numel: int = 0  # this rank's shard of it (padded_numel / shard group size)
    trainable_shard_numel: int = 0  # of this rank's shard, the elements of parameters that require grad now


def unit_reports(units: Sequence[FlatUnit], plan: StagePlan) -> list[UnitReport]:
    """``plan``: the configured stage's; a unit with another plan persists (stage 3's threshold)."""
    return [
        UnitReport(
            name=unit.name,
            numel=unit.layout.total_numel,
            trainable_numel=sum(s.numel for s, p in zip(unit.layout.slots, unit.params) if p.requires_grad),
            padded_numel=unit.layout.padded_numel,
            persistent=unit.stage_plan != plan,
            refreshing=unit.refreshing,
            offloaded=unit.offloaded,
            params_offloaded=unit.params_offloaded,
            shard_numel=unit.resting_master.numel(),
            trainable_shard_numel=sum(
                m.piece.numel for m in unit.master_pieces if unit.params[m.piece.slot.index].requires_grad
            ),
        )
        for unit in units
    ]


class StorageCounter:
    """Counts each storage once, in the first category that claims it."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def count(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self._seen:
                continue
            self._seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def _bytes_in_memory(tensor: torch.Tensor) -> int:
    """A tensor's own bytes (not those of a larger storage it is a slice of); 0 while a file holds them."""
    return min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())


def measure_model_state(
    model: nn.Module, units: Sequence[FlatUnit], optimizer: torch.optim.Optimizer | None, nvme_bytes: int = 0
) -> MemoryReport:
    """What this rank holds now, each storage counted once: every tensor the units, the model's
    ``.grad`` and the optimizer's state really keep alive, not what the formulas expect."""
    counter = StorageCounter()
    params = counter.count(
        [u.gathered_params for u in units] + [u.compute_shard for u in units] + [u.host_shard for u in units]
    )
    grads = counter.count(
        [grad for u in units for grad in u.grads.tensors()]
        + [u.host_grads for u in units]
        + [p.grad for p in model.parameters()]
        + [m.param.grad for u in units for m in u.master_pieces]
    )
    optimizer_state = optimizer.state if optimizer is not None else {}

    def state_of(pieces: Iterable[nn.Parameter] | None = None) -> list[torch.Tensor]:
        keys = optimizer_state.keys() if pieces is None else [p for p in pieces if p in optimizer_state]
        return [value for key in keys for value in optimizer_state[key].values() if isinstance(value, torch.Tensor)]

    # The masters as they rest (nothing read back): with the NVMe optimizer tier their files may hold them.
    optimizer_bytes = counter.count([u.resting_master for u in units] + state_of())
    offloaded = [u for u in units if u.offloaded]
    # The master shard by its own bytes (on a CPU device it can be a slice of the full parameters' storage),
    # while in memory. offload_params: the parameter shards at rest, unless one is an offloaded master itself
    # (counted already); with "nvme" only while in memory (read for a gather, or waiting for its write).
    on_host = sum(_bytes_in_memory(u.resting_master) for u in offloaded)
    masters_on_host = {u.resting_master.untyped_storage().data_ptr() for u in offloaded}
    on_host += sum(
        _bytes_in_memory(u.host_shard)
        for u in units
        if u.host_shard is not None and u.host_shard.untyped_storage().data_ptr() not in masters_on_host
    )
    on_host += StorageCounter().count(
        [u.host_grads for u in offloaded] + state_of(m.param for u in offloaded for m in u.master_pieces)
    )
    nvme_bytes += sum(u.param_bytes_on_disk for u in units)  # offload_params="nvme"
    return MemoryReport(params, grads, optimizer_bytes, nvme_bytes, host_bytes=on_host)


def _parameter_shards_moved(
    mode: str, shard: float, compute_bytes: int, offloaded: float, host_is_device: bool, master: float
) -> tuple[float, float]:
    """offload_params: (the parameter bytes that move to the host or the files, the master bytes after the
    move). "nvme": every shard is a copy in the compute dtype, and the master a tensor of its own (in fp32 it
    was the shard). "cpu": in fp32 an offloaded master on the host is the parameter shard itself (one tensor,
    counted as parameters); every other unit keeps its master where it was and gets a host copy of its shard."""
    if mode == "nvme":
        return shard * compute_bytes, 4 * shard
    if compute_bytes != 4:
        return shard * compute_bytes, master  # a host copy in the compute dtype; the master is unchanged
    # fp32: the offloaded share's host master is its shard; the rest gets a host copy, and on a GPU its
    # master (the shard until now) stays on the device as a tensor of its own.
    return 4 * (1 - offloaded) * shard, 0.0 if host_is_device else 4 * (1 - offloaded) * shard


def master_bytes_in_files(optimizer: str, low_precision: bool, host_is_device: bool, stage: int, params: str) -> int:
    """offload_optimizer="nvme": the master bytes per offloaded shard element that rest in the tier's files
    beside the moments: 4, unless in fp32 the master is the parameters' own memory (on a CPU device its
    parameters or shard, unless stage 3's shards rest in files of their own; at stage 3 with
    offload_params="cpu" the host shard). Units that stage 3's persistence_threshold keeps are not modelled."""
    if low_precision or (stage == 3 and params == "nvme"):
        stands_alone = True
    else:
        stands_alone = not host_is_device and not (stage == 3 and params == "cpu")
    return 4 if optimizer == "nvme" and stands_alone else 0


def expected_model_state_bytes(
    stage: int,
    numel: int,
    world_size: int,
    precision: MixedPrecision,
    optimizer_state_bytes_per_param: int,
    *,
    trainable_numel: int | None = None,
    gradient_numel: int | None = None,
    offload_optimizer: str = "none",
    offload_fraction: float = 1.0,
    host_is_device: bool = False,
    offload_params: str = "none",
) -> MemoryReport:
    """The README's formulas, padding aside. ``stage=0``: DDP; ``world_size``: the ranks a shard divides over.

    The fp32 master copy exists only when computing in lower precision, or for the offloaded share
    (its master lives on the host, the compute shard stays on the device); otherwise the parameters
    (or their shard) are the master. The master covers every parameter, frozen ones too (the engine
    keeps a master piece for each, so unfreezing one trains it from its shard); optimizer state
    covers the ``trainable_numel`` (default: all). Gradients: stage 1 keeps a full buffer for every
    parameter; stages 2/3 a shard for the ``gradient_numel`` (default: the trainable ones; the engine
    holds one for every element of a unit with any trainable parameter).

    ``offload_optimizer`` ("cpu" or "nvme", stages 1-3) moves ``offload_fraction`` of the elements' master
    and state into ``host_bytes``; "nvme" moves their state (over the ``gradient_numel``: a unit's file covers
    its whole shard) and master (``master_bytes_in_files``) on into ``nvme_bytes``. On a GPU the offloaded gradient
    shards get fp32 host copies; ``host_is_device`` (a CPU device) steps on the shard in place, and in fp32 the
    parameters' own shard is the master. ``offload_params`` (stage 3): ``_parameter_shards_moved``.
    """
    compute = torch.empty(0, dtype=precision.compute_dtype).element_size()
    reduce = torch.empty(0, dtype=precision.reduce_dtype).element_size()
    low_precision = precision.compute_dtype != torch.float32
    state_bytes = optimizer_state_bytes_per_param
    trainable = numel if trainable_numel is None else trainable_numel
    if stage == 0:  # the fp32 master is a copy of its own in lower precision
        return MemoryReport(numel * compute, trainable * compute, trainable * state_bytes + 4 * numel * low_precision)
    with_grads = trainable if gradient_numel is None else gradient_numel
    offloaded = 0.0 if offload_optimizer == "none" else offload_fraction
    shard, trainable_shard = numel / world_size, trainable / world_size
    params = numel * compute if stage < 3 else shard * compute
    grads = numel * reduce if stage == 1 else with_grads / world_size * reduce
    host_grads = 0.0 if host_is_device else 4 * offloaded * with_grads / world_size
    master = 4 * shard if low_precision else 0.0 if host_is_device else 4 * offloaded * shard
    state = trainable_shard * state_bytes
    # The NVMe tier writes a unit's state as one flat file per key over its whole shard (frozen
    # elements and padding too): as many elements as the gradient shard.
    on_disk = offloaded * with_grads / world_size * state_bytes if offload_optimizer == "nvme" else 0.0
    in_memory = (1 - offloaded) * state if offload_optimizer == "nvme" else state
    host = 4 * offloaded * shard + host_grads + (offloaded * state if offload_optimizer == "cpu" else 0.0)
    if offload_params != "none" and stage == 3:
        moved, master = _parameter_shards_moved(offload_params, shard, compute, offloaded, host_is_device, master)
        params, host, on_disk = (
            (params, host + moved, on_disk) if offload_params == "cpu" else (0, host, on_disk + moved)
        )
    filed = master_bytes_in_files(offload_optimizer, low_precision, host_is_device, stage, offload_params) * shard
    filed *= offloaded
    master, host, on_disk = master - filed, host - filed, on_disk + filed
    return MemoryReport(*(round(b) for b in (params, grads + host_grads, master + in_memory, on_disk, host)))
