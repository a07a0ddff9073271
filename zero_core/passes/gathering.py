"""Which units are gathered during a pass: the gather, reshard and prefetch policy.

Stage 3 gathers a unit right before it runs (forward, or its backward),
starts the all-gathers of the units the recorded order predicts next
(:class:`ExecutionOrder`, ``prefetch`` of them), and reshards whatever is
neither running nor predicted. Stages 1/2 keep parameters gathered: a unit
only waits for its post-step all-gather, if it is still running. Inside
:meth:`GatherPolicy.suspend` (full parameters swapped in by
``gathered_parameters``) nothing is gathered or resharded. With
``offload_params="nvme"`` the parameter shard of the unit after the
prefetched ones is read from its file meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

from ..stage_plan import StagePlan
from ..unit import FlatUnit, StorageState
from .execution_order import ExecutionOrder
from .prefetch_tuning import AutoPrefetch


class GatherPolicy:
    def __init__(self, units: list[FlatUnit], plan: StagePlan, prefetch: int, auto_prefetch: AutoPrefetch | None):
        self.units = units
        self.plan = plan
        self.prefetch = prefetch  # units gathered ahead of the one running; prefetch="auto" changes it
        self.auto_prefetch = auto_prefetch  # prefetch="auto": times gathers and forwards
        self.order = ExecutionOrder()
        # offload_params="nvme": the unit after the prefetched ones has its shard read from disk meanwhile.
        self.reads_ahead = 1 if any(unit.storage.params_on_disk for unit in units) else 0
        self._read_ahead: set[int] = set()  # the units whose shards were last read ahead
        self.peak_live_units = 0
        self._suspended = False

    @property
    def suspended(self) -> bool:
        """Inside :meth:`suspend`: units are neither gathered nor resharded."""
        return self._suspended

    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        """Full parameters are swapped in by the caller (``gathered_parameters``): no gather or reshard."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    # ---------------------------------------------------------------- gather
    def for_forward(self, unit: FlatUnit, keep: set[int], *, timed: bool) -> None:
        """``unit`` runs its forward now; ``timed`` when prefetch="auto" measures this forward."""
        predicted = self.order.forward.record(unit.index, self.prefetch + self.reads_ahead)
        self._gather(unit, predicted, keep, timed=timed, backward=False)

    def for_backward(self, unit: FlatUnit, keep: set[int]) -> None:
        """``unit``'s backward starts now; ``keep``: the units whose backward runs, and those still running
        (a backward inside a forward, as Lightning's manual optimization runs it, needs them gathered)."""
        predicted = self.order.backward.record(unit.index, self.prefetch + self.reads_ahead)
        self._gather(unit, predicted, keep, timed=False, backward=True)

    def _gather(self, unit: FlatUnit, predicted: list[int], keep: set[int], *, timed: bool, backward: bool) -> None:
        """Gather ``unit``, prefetch ``predicted`` (its last ``reads_ahead`` units only read from disk); reshard
        any other unit not in ``keep``. A ``backward``'s gathers come from the secondary pieces (hpZ) if kept."""
        if self._suspended:
            return
        if not self.plan.params_sharded_at_rest:
            unit.storage.wait_gathered()  # stages 1/2: the post-step all-gather, if it is still running
            return
        predicted, read_ahead = predicted[: self.prefetch], predicted[self.prefetch :]
        wanted = keep | {unit.index} | set(predicted)
        for other in self.units:
            if other.index not in wanted and other.storage.state is not StorageState.SHARDED:
                other.storage.reshard()  # prefetched for an order that did not happen
        if timed and self.auto_prefetch is not None:
            self.auto_prefetch.wait_timed(unit.storage.wait_gathered)
        else:
            unit.storage.wait_gathered(backward)
        for index in predicted:
            self.units[index].storage.start_gather(backward)
        for index in self._read_ahead - set(read_ahead) - wanted:
            self.units[index].storage.reshard()  # read ahead for an order that did not happen: its memory is freed
        self._read_ahead = set(read_ahead)
        for index in read_ahead:
            self.units[index].storage.read_ahead()
        live = sum(u.storage.state is not StorageState.SHARDED for u in self.units)
        self.peak_live_units = max(self.peak_live_units, live)

    def reshard(self, unit: FlatUnit, after_forward: bool = False) -> None:
        """``unit`` to SHARDED, its full parameters freed (FSDP2's reshard), unless the caller holds them;
        ``after_forward`` with a backward to come: hpZ keeps this rank's piece for the backward's gather."""
        if not self._suspended:
            unit.storage.reshard(keep_secondary=after_forward)

    def reshard_all(self, keep: Collection[int] = ()) -> None:
        """Every unit but those in ``keep``: the units still running when a backward inside their forward
        ends (Lightning's manual optimization), which the rest of that forward uses."""
        for unit in self.units:
            if unit.index not in keep:
                self.reshard(unit)

    # ---------------------------------------------------------------- passes
    def forward_started(self) -> None:
        if self.auto_prefetch is not None:
            self.auto_prefetch.forward_started()

    def forward_ended(self) -> None:
        self.reshard_all()  # prefetched units the forward did not use
        self.order.forward.end()
        if self.auto_prefetch is not None:
            self.auto_prefetch.forward_ended()

    def backward_ended(self) -> None:
        self.order.backward.end()
        for unit in self.units:
            unit.storage.forget_secondary()  # hpZ: a piece the backward did not gather from goes with it

    def abandoned(self) -> None:
        """A forward or backward raised: reshard everything and forget the orders it recorded."""
        self.reshard_all()
        if self.auto_prefetch is not None:
            self.auto_prefetch.forward_abandoned()
        self.order.forward.discard()
        self.order.backward.discard()
