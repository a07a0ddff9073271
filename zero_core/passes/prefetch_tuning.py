"""``ZeroConfig(prefetch="auto")``: the stage-3 prefetch depth chosen from measured times.

The first optimizer step warms up (first-time allocations distort its
times) with the default depth, which also serves an engine that never
steps (inference). During the next ``MEASURED_STEPS`` steps prefetch is off, so every
unit's all-gather is exposed: each forward's wall time splits into time
spent waiting for gathers and time spent computing. The depth that hides a
gather behind the compute of the units ahead is

    k* = ceil(T_gather / T_compute)   (per unit, so the totals' ratio)

capped so that the units gathered ahead fit in ``prefetch_cap_mb`` (and
never more than the other units). Prefetch depth changes only when gathers
are issued, never their values or order across ranks, but every rank must
issue them alike: the depth is agreed (the largest any rank measured) in one
small all-reduce at the optimizer step that ends the measurement, which
every rank reaches together (the step agreement just compared step counts).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives import CommContext

if TYPE_CHECKING:
    from ..unit import FlatUnit

MEASURED_STEPS = 2
UNTUNED_DEPTH = 1  # ZeroConfig's default prefetch, until a depth is chosen (and if none ever is)


class PrefetchTuning(Enum):
    WARMING_UP = auto()  # until the first optimizer step: the default depth, nothing timed
    MEASURING = auto()  # prefetch off, gathers and forwards timed
    CHOSEN = auto()  # the agreed depth is in use


@dataclass(frozen=True)
class PrefetchReport:
    """What ``prefetch="auto"`` measured (this rank) and chose (every rank alike)."""

    state: PrefetchTuning
    depth: int | None  # None until chosen
    gather_seconds: float  # mean exposed all-gather time per unit, with prefetch off
    compute_seconds: float  # mean forward compute time per unit (the forward minus its gathers)
    gathers: int  # unit gathers measured
    cap_units: int  # the most units the memory cap allows ahead


class AutoPrefetch:
    """``synchronize``: waits for the device's queued work (CUDA), called around each timed
    span while measuring, so that times are of the work and not of queuing it."""

    def __init__(self, unit_bytes: list[int], cap_bytes: float, synchronize: Callable[[], None] = lambda: None):
        largest = max(unit_bytes, default=0)
        if not largest:
            by_memory = 0
        else:
            by_memory = len(unit_bytes) if math.isinf(cap_bytes) else int(cap_bytes // largest)
        self.cap_units = max(0, min(len(unit_bytes) - 1, by_memory))
        self.state = PrefetchTuning.WARMING_UP
        self.depth: int | None = None
        self._synchronize = synchronize
        self._steps_seen = 0
        # Totals over the forwards that completed while measuring.
        self._gather_time = 0.0
        self._forward_time = 0.0
        self._gathers = 0
        # The running forward's, added to the totals only if it completes: a forward that
        # raises (and is abandoned) must not count its gathers without its time.
        self._forward_started: float | None = None
        self._running_gather_time = 0.0
        self._running_gathers = 0

    @classmethod
    def for_units(cls, units: list["FlatUnit"], cap_mb: float, device: torch.device) -> "AutoPrefetch":
        """Over the units sharded at rest (the only ones gathered), synchronizing CUDA while timing."""
        sharded = [u for u in units if u.stage_plan.params_sharded_at_rest]
        unit_bytes = [u.layout.padded_numel * u.storage.gathered_params.element_size() for u in sharded]
        synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        return cls(unit_bytes, cap_mb * 2**20, synchronize)

    @property
    def measuring(self) -> bool:
        return self.state is PrefetchTuning.MEASURING

    # ---------------------------------------------------------- measuring
    def forward_started(self) -> None:
        self._running_gather_time, self._running_gathers = 0.0, 0
        self._forward_started = None
        if self.measuring:
            self._synchronize()
            self._forward_started = time.perf_counter()

    def forward_ended(self) -> None:
        if self.measuring and self._forward_started is not None:
            self._synchronize()
            self._forward_time += time.perf_counter() - self._forward_started
            self._gather_time += self._running_gather_time
            self._gathers += self._running_gathers
        self._forward_started = None

    def forward_abandoned(self) -> None:
        """The forward raised: none of it counts."""
        self._forward_started = None

    def wait_timed(self, wait: Callable[[], None]) -> None:
        """``wait()`` (a unit's gather, prefetch off) inside a forward; timed while measuring."""
        if not (self.measuring and self._forward_started is not None):
            wait()
            return
        self._synchronize()
        started = time.perf_counter()
        wait()
        self._synchronize()
        self._running_gather_time += time.perf_counter() - started
        self._running_gathers += 1

    # ----------------------------------------------------------- choosing
    def local_choice(self) -> int:
        compute = self._forward_time - self._gather_time
        if self._gather_time <= 0.0:
            return 0
        if compute <= 0.0:
            return self.cap_units
        return min(self.cap_units, math.ceil(self._gather_time / compute))

    def on_optimizer_step(self, comm: CommContext) -> int | None:
        """Called at every optimizer step by every rank together: the depth to use from now on
        when it changes (0 while measuring, then the agreed one), else None."""
        self._steps_seen += 1
        if self.state is PrefetchTuning.WARMING_UP:
            self.state = PrefetchTuning.MEASURING
            return 0
        if self.state is PrefetchTuning.MEASURING and self._steps_seen > MEASURED_STEPS:
            agreed = torch.tensor([float(self.local_choice())], dtype=torch.float64, device=comm.device)
            collectives.all_reduce(comm, agreed, dist.ReduceOp.MAX, label="the prefetch depth").wait()
            self.depth = int(agreed.item())
            self.state = PrefetchTuning.CHOSEN
            return self.depth
        return None

    def report(self) -> PrefetchReport:
        gathers = max(self._gathers, 1)
        compute = max(self._forward_time - self._gather_time, 0.0)
        return PrefetchReport(
            self.state, self.depth, self._gather_time / gathers, compute / gathers, self._gathers, self.cap_units
        )
