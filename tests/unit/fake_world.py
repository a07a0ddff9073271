"""Several ranks in one process: a thread per rank, collectives combined in memory.

The agreements (``true_on_any_rank``, ``agree_on_step``, ``agree_on_setup``)
are small packings around one or two all-reduces or all-gathers. Run once per
simulated rank, each in its own thread, with ``collectives.all_reduce``,
``all_gather`` and ``all_gather_objects`` replaced by in-memory versions that
meet at a barrier, they show what every rank computes from what every other
rank contributed, without spawning a process group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_core import collectives
from zero_core.collectives import CommContext, Handle, Span

_REDUCE: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.MAX: lambda stacked: stacked.max(dim=0).values,
    dist.ReduceOp.SUM: lambda stacked: stacked.sum(dim=0),
}


class FakeWorld:
    """``world_size`` ranks that exchange tensors through shared slots and a barrier."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=10)
        self._slots: list[Any] = [None] * world_size
        self.calls: list[tuple[str, str]] = []  # (kind, label) as rank 0 issued them

    def comm(self, rank: int) -> CommContext:
        return CommContext(None, rank, self.world_size, torch.device("cpu"))

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (after every rank has read, slots are reusable)."""
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()
        return values

    def all_reduce(
        self,
        comm: CommContext,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        label: str = "",
        span: Span = Span.WORLD,
    ) -> Handle:
        if comm.rank == 0:
            self.calls.append(("all_reduce", label))
        values = self._exchange(comm.rank, tensor.clone())
        tensor.copy_(_REDUCE[op](torch.stack(values)))
        return Handle()

    def all_gather(
        self, comm: CommContext, gathered_out: torch.Tensor, shard_in: torch.Tensor, label: str = "", span: Any = None
    ) -> Handle:
        if comm.rank == 0:
            self.calls.append(("all_gather", label))
        gathered_out.copy_(torch.cat(self._exchange(comm.rank, shard_in.clone())))
        return Handle()

    def all_gather_objects(self, comm: CommContext, obj: object, label: str) -> list:
        if comm.rank == 0:
            self.calls.append(("all_gather_objects", label))
        return self._exchange(comm.rank, obj)

    def run(self, fn: Callable[[CommContext], Any]) -> list[Any]:
        """``fn(comm)`` on every rank at once; the results (or raised exceptions) by rank."""

        def outcome(rank: int) -> Any:
            try:
                return fn(self.comm(rank))
            except Exception as error:  # noqa: BLE001 - compared by the tests, rank by rank
                return error

        with ThreadPoolExecutor(self.world_size) as pool:
            return list(pool.map(outcome, range(self.world_size)))


def install(monkeypatch: pytest.MonkeyPatch, world_size: int) -> FakeWorld:
    """A fake world whose collectives replace the real ones for the rest of the test."""
    world = FakeWorld(world_size)
    monkeypatch.setattr(collectives, "all_reduce", world.all_reduce)
    monkeypatch.setattr(collectives, "all_gather", world.all_gather)
    monkeypatch.setattr(collectives, "all_gather_objects", world.all_gather_objects)
    return world
