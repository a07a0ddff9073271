"""What this rank holds now, measured from the tensors the units, the model's ``.grad`` and the optimizer
really keep alive (``engine.memory_report()``), each storage counted once; and the units as the engine
sees them (``engine.unit_reports()``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..stage_plan import StagePlan
from ..unit import FlatUnit
from .memory_reports import MemoryReport, UnitReport


def unit_reports(units: Sequence[FlatUnit], plan: StagePlan) -> list[UnitReport]:
    """``plan``: the configured stage's; a unit with another plan persists (stage 3's threshold)."""
    return [
        UnitReport(
            name=unit.name,
            numel=unit.layout.total_numel,
            trainable_numel=sum(s.numel for s, p in zip(unit.layout.slots, unit.params) if p.requires_grad),
            padded_numel=unit.layout.padded_numel,
            persistent=unit.stage_plan != plan,
            refreshing=unit.storage.refreshing,
            offloaded=unit.offloaded,
            params_offloaded=unit.storage.params_offloaded,
            shard_numel=unit.storage.resting_master.numel(),
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
    model: nn.Module,
    units: Sequence[FlatUnit],
    optimizer: torch.optim.Optimizer | None,
    nvme_bytes: int = 0,
    exchanged: Sequence[torch.Tensor] = (),
) -> MemoryReport:
    """What this rank holds now, each storage counted once: every tensor the units, the model's
    ``.grad`` and the optimizer's state really keep alive, not what the formulas expect. ``exchanged``: the
    whole tensors a whole-tensor optimizer's owner holds during its step's round (communication bytes)."""
    counter = StorageCounter()
    params = counter.count(
        [u.storage.gathered_params for u in units]
        + [u.storage.compute_shard for u in units]
        + [u.storage.host_shard for u in units]
        + [u.storage.secondary_piece for u in units]  # hpZ: between a unit's forward and its backward
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
    optimizer_bytes = counter.count([u.storage.resting_master for u in units] + state_of())
    offloaded = [u for u in units if u.offloaded]
    # The master shard by its own bytes (on a CPU device it can be a slice of the full parameters' storage),
    # while in memory. offload_params: the parameter shards at rest, unless one is an offloaded master itself
    # (counted already); with "nvme" only while in memory (read for a gather, or waiting for its write).
    on_host = sum(_bytes_in_memory(u.storage.resting_master) for u in offloaded)
    masters_on_host = {u.storage.resting_master.untyped_storage().data_ptr() for u in offloaded}
    on_host += sum(
        _bytes_in_memory(u.storage.host_shard)
        for u in units
        if u.storage.host_shard is not None and u.storage.host_shard.untyped_storage().data_ptr() not in masters_on_host
    )
    on_host += StorageCounter().count(
        [u.host_grads for u in offloaded] + state_of(m.param for u in offloaded for m in u.master_pieces)
    )
    nvme_bytes += sum(u.storage.bytes_on_disk for u in units)  # offload_params="nvme"
    in_flight = counter.count([buffer for u in units for buffer in u.wire_buffers] + list(exchanged))
    return MemoryReport(params, grads, optimizer_bytes, nvme_bytes, host_bytes=on_host, communication_bytes=in_flight)
