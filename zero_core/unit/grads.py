"""One unit's gradients: how they are accumulated, reduce-scattered and kept until the step.

Two strategies, chosen once from the stage (no stage branches inside them):

- :class:`LocalGrads` (stage 1): ``full_grads`` (P, reduce dtype) is kept
  across steps and the model's ``.grad`` are views of it when dtypes allow;
  at the accumulation boundary it is reduce-scattered in place, and this
  rank's slice of it becomes the reduced shard.
- :class:`ShardedGrads` (stages 2/3): ``full_grads`` is allocated per
  backward and dropped once sent. What the running backward reduced is its
  ``backward_shard`` (S), added to the reduced shard only when that backward
  completes (``commit_backward``), so a backward that raises leaves no trace
  (``discard_backward``).

Where the reduced shards gather until the step is a :class:`ShardSum`: the
shard itself or, under hybrid sharding, :class:`AcrossGroupsShardSum`: ``group_grads`` holds what was reduced inside
the shard group; the end of a synchronising backward (or the step)
all-reduces it across groups once and adds it to the shard, so the slow
link carries Ψ/k per optimizer step, not per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from ..collectives import (
    CommContext,
    Handle,
    Span,
    all_reduce,
    all_reduce_quantized,
    reduce_scatter,
    reduce_scatter_quantized,
)
from ..config import MixedPrecision
from ..host_memory import advise_huge_pages
from ..wire_plan import WirePlan
from .dtensor_params import is_dtensor, local_grad
from .layout import FlatLayout, shard_view, slot_view

AllReduce = Callable[..., Handle]  # (comm, tensor, label=, span=) -> Handle


def _sum_into(total: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    """``total + more``, in ``total``'s storage when there is one."""
    return more if total is None else total.add_(more)


class PendingReduce(NamedTuple):
    sharded_out: torch.Tensor
    full_in: torch.Tensor  # kept alive until the collective has read it
    handle: Handle


class ShardSum:
    """This rank's averaged gradient shard (S, reduce dtype), accumulated until the optimizer step.
    One shard group: what the reduce-scatter gives is final."""

    def __init__(self) -> None:
        self.sharded_grads: torch.Tensor | None = None

    def add(self, reduced: torch.Tensor) -> None:
        self.sharded_grads = _sum_into(self.sharded_grads, reduced)

    def set(self, reduced: torch.Tensor) -> None:
        """Stage 1: ``reduced`` is this rank's slice of ``full_grads``, reduced in place."""
        self.sharded_grads = reduced

    @property
    def waiting_across_groups(self) -> bool:
        """Hybrid sharding: reduced inside the group, not yet across groups."""
        return False

    def start_across_groups(self, comm: CommContext, label: str) -> Handle | None:
        return None

    def finish_across_groups(self, handle: Handle) -> None:
        raise AssertionError("nothing is reduced across groups without hybrid sharding")

    def clear(self) -> None:
        self.sharded_grads = None

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.sharded_grads]


class AcrossGroupsShardSum(ShardSum):
    """Hybrid sharding: reduced inside the shard group only, until the next reduce across groups."""

    def __init__(self, all_reduce_across: AllReduce) -> None:
        super().__init__()
        self.group_grads: torch.Tensor | None = None
        self._all_reduce = all_reduce_across  # exact, or quantized (qgZ)

    def add(self, reduced: torch.Tensor) -> None:
        self.group_grads = _sum_into(self.group_grads, reduced)

    def set(self, reduced: torch.Tensor) -> None:
        self.group_grads = reduced  # this rank's slice of full_grads, reduced in its group

    @property
    def waiting_across_groups(self) -> bool:
        return self.group_grads is not None

    def start_across_groups(self, comm: CommContext, label: str) -> Handle | None:
        """All-reduce ``group_grads`` with the other groups' ranks holding this shard."""
        if self.group_grads is None:
            return None
        return self._all_reduce(comm, self.group_grads, label=label, span=Span.ACROSS_GROUPS)

    def finish_across_groups(self, handle: Handle) -> None:
        handle.wait()
        reduced, self.group_grads = self.group_grads, None
        if self.sharded_grads is reduced:
            return  # stage 1: this rank's slice of full_grads, reduced in place
        self.sharded_grads = _sum_into(self.sharded_grads, reduced)

    def clear(self) -> None:
        super().clear()
        self.group_grads = None

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.sharded_grads, self.group_grads]


class UnitGrads:
    """What both strategies share: which slots got a gradient, and the reduce-scatter itself."""

    def __init__(
        self,
        layout: FlatLayout,
        params: list[nn.Parameter],
        precision: MixedPrecision,
        comm: CommContext,
        label: str,
        wire: WirePlan = WirePlan(),
        polled_reduces: bool = False,
    ):
        """``polled_reduces``: the reduce schedule asks each reduce whether it has landed before waiting for
        it (offload_step_in_backward), so the exact reduce-scatter takes a form that can answer."""
        self.layout, self.params, self.precision, self.comm, self.label = layout, params, precision, comm, label
        # qgZ: both reductions carry quantized blocks; otherwise both are exact.
        block, bits = wire.gradient_block_size, wire.gradient_bits
        if block is None:
            self._reduce_scatter, across = partial(reduce_scatter, polled=polled_reduces), all_reduce
        else:
            self._reduce_scatter = partial(reduce_scatter_quantized, block_size=block, bits=bits)
            across = partial(all_reduce_quantized, block_size=block, bits=bits)
        self.shards: ShardSum = AcrossGroupsShardSum(across) if comm.replicas > 1 else ShardSum()
        self.full_grads: torch.Tensor | None = None
        # The reduce issued and not yet waited for: its buffers are alive (the memory report counts them).
        self._in_flight: PendingReduce | None = None
        self.slot_has_grad = [False] * len(layout.slots)
        self._filled_this_backward: set[int] = set()

    @property
    def sharded_grads(self) -> torch.Tensor | None:
        return self.shards.sharded_grads

    def tensors(self) -> list[torch.Tensor | None]:
        """Every gradient tensor this unit holds now (the memory report counts them), a reduce's in flight too."""
        in_flight = [self._in_flight.full_in, self._in_flight.sharded_out] if self._in_flight is not None else []
        return [self.full_grads, *self.shards.tensors(), *in_flight]

    @property
    def wire_buffers(self) -> tuple[torch.Tensor, ...]:
        """qgZ: the packed rows of this unit's quantized reduce, sent and arriving, until it is waited for."""
        return self._in_flight.handle.wire_buffers if self._in_flight is not None else ()

    def _start_reduce_scatter(self, sharded_out: torch.Tensor) -> PendingReduce:
        if self.precision.reduce_dtype != torch.float32:
            self.full_grads.div_(self.comm.world_size)  # low precision: average (over every rank) before summing
        handle = self._reduce_scatter(self.comm, sharded_out, self.full_grads, label=self.label)
        self._in_flight = PendingReduce(sharded_out, self.full_grads, handle)
        return self._in_flight

    def _wait_averaged(self, pending: PendingReduce) -> torch.Tensor:
        try:
            pending.handle.wait()
        finally:
            self._in_flight = None  # landed, or raised (a failed collective is not waited for again)
        if self.precision.reduce_dtype == torch.float32:
            pending.sharded_out.div_(self.comm.world_size)
        return pending.sharded_out

    def start_reduce_across_groups(self) -> Handle | None:
        """Hybrid sharding: all-reduce what was reduced inside the shard group only."""
        return self.shards.start_across_groups(self.comm, self.label)

    def finish_reduce_across_groups(self, handle: Handle) -> None:
        self.shards.finish_across_groups(handle)

    def _shard_range(self) -> tuple[int, int]:
        return self.layout.shard_range(self.comm.shard_rank)

    def has_every_grad(self) -> bool:
        """Every parameter that requires grad has a gradient (accumulated, or from the running backward)."""
        with torch._C.DisableTorchFunctionSubclass():
            wanted = [i for i, param in enumerate(self.params) if param.requires_grad]
        return all(self.slot_has_grad[i] or i in self._filled_this_backward for i in wanted)

    def commit_backward(self) -> None:
        """The backward completed: its gradients join those accumulated before it."""
        for slot_index in self._filled_this_backward:
            self.slot_has_grad[slot_index] = True
        self._filled_this_backward.clear()

    def reset(self) -> None:
        """After the optimizer step: gradients are consumed."""
        self.shards.clear()
        self.slot_has_grad = [False] * len(self.layout.slots)
        self._filled_this_backward.clear()

    @property
    def holds_grads(self) -> bool:
        """Some gradient arrived since the last step (or ``zero_grad``): there is something to drop."""
        held = any(shard is not None for shard in self.shards.tensors())
        return held or any(self.slot_has_grad) or bool(self._filled_this_backward)

    def zero_grads(self, slots: frozenset[int] | None, set_to_none: bool) -> None:
        """``zero_grad`` between steps: drop the gradients of ``slots`` (None: every slot), as ``zero_grad``
        drops ``.grad`` under DDP. ``set_to_none``: the slots have no gradient any more (the step skips them,
        as torch's optimizers skip a ``None`` grad); otherwise they keep a gradient of zeros."""
        if not self.holds_grads:
            return
        if slots is None and set_to_none:
            self.reset()
            return
        wanted = range(len(self.layout.slots)) if slots is None else slots
        self._zero_slots(wanted)
        if set_to_none:
            for index in wanted:
                self.slot_has_grad[index] = False
                self._filled_this_backward.discard(index)

    def _zero_slots(self, wanted: Collection[int]) -> None:
        """Zero the gradients of the ``wanted`` slots, and the padding (a clip by a NaN norm left NaN there,
        which no later reduce would clear)."""
        if self.full_grads is not None:  # stage 1: the reduced shards (and the partial sums) are views of it
            for index in wanted:
                slot_view(self.full_grads, self.layout.slots[index]).zero_()
            self.full_grads[self.layout.total_numel :].zero_()
            return
        lo, _ = self._shard_range()
        for shard in self.shards.tensors():
            if shard is None:
                continue
            for piece in self.layout.pieces(self.comm.shard_rank):
                if piece.slot.index in wanted:
                    shard_view(shard, piece).zero_()
            shard[max(self.layout.total_numel - lo, 0) :].zero_()


class LocalGrads(UnitGrads):
    """Stage 1: full local gradients across micro-batches, reduce-scattered in place at the boundary."""

    def __init__(self, *args: Any, **kwargs: Any):  # UnitGrads's
        super().__init__(*args, **kwargs)
        numel, dtype = self.layout.padded_numel, self.precision.reduce_dtype
        self.full_grads = torch.zeros(numel, dtype=dtype, device=self.comm.device)
        self._attach_model_grad_views()

    def _attach_model_grad_views(self) -> None:
        """Let autograd accumulate straight into ``full_grads`` (no copy)."""
        if self.precision.reduce_dtype != self.precision.compute_dtype:
            return
        for slot, param in zip(self.layout.slots, self.params):
            # A DTensor's .grad must be a DTensor: it takes its gradients by copy, as under mixed dtypes.
            viewable = param.requires_grad and not is_dtensor(param)
            param.grad = slot_view(self.full_grads, slot) if viewable else None

    def accumulate(self, slot_index: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook body: add ``param.grad`` into ``full_grads`` (unless it is a view of it)."""
        view = slot_view(self.full_grads, self.layout.slots[slot_index])
        grad = local_grad(param)
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.add_(grad)
            param.grad = view if view.dtype == param.dtype and not is_dtensor(param) else None
        self._filled_this_backward.add(slot_index)

    def start_reduce(self) -> PendingReduce:
        lo, hi = self._shard_range()
        return self._start_reduce_scatter(self.full_grads[lo:hi])

    def finish_reduce(self, pending: PendingReduce) -> None:
        self.shards.set(self._wait_averaged(pending))
        # The model's .grad views now mix this reduced slice with what the reduce left in
        # the others (partial sums): absent is better than wrong (re-attached after the step).
        for param in self.params:
            param.grad = None

    def prepare_backward(self) -> None:
        """A second synchronised backward before the step: reopen the reduced slice.

        After a reduce, this rank's slice of ``full_grads`` holds the average
        and the other slices stale local sums. Putting back the share of the sum
        this rank's reduce adds (all of it; under hybrid sharding one group's
        share, as every group holding the shard adds its own) and zeroing the
        rest makes the next reduce add exactly the new gradients to it.
        """
        if self.shards.sharded_grads is None:
            return
        assert not self.shards.waiting_across_groups, "a synchronising backward reduces across groups before the next"
        lo, hi = self._shard_range()
        self.full_grads[:lo].zero_()
        self.full_grads[hi:].zero_()
        self.full_grads[lo:hi].mul_(self.comm.shard_size)
        self.shards.clear()

    def discard_backward(self) -> bool:
        """The backward raised. Autograd accumulates into ``full_grads`` in place, so an
        interrupted backward cannot be told apart from earlier micro-batches: all go.
        True if earlier gradients went too."""
        had_earlier = any(self.slot_has_grad)
        self.reset()
        return had_earlier

    def reset(self) -> None:
        super().reset()
        self.full_grads.zero_()
        self._attach_model_grad_views()


class ShardedGrads(UnitGrads):
    """Stages 2/3: each backward reduce-scatters and keeps only the shard."""

    def __init__(self, *args: Any, **kwargs: Any):  # UnitGrads's
        super().__init__(*args, **kwargs)
        self.backward_shard: torch.Tensor | None = None  # what the running backward reduced

    def tensors(self) -> list[torch.Tensor | None]:
        return [*super().tensors(), self.backward_shard]

    def _new_full_grads(self) -> torch.Tensor:
        """Allocated for every backward: fault it in as huge pages."""
        full = torch.empty(self.layout.padded_numel, dtype=self.precision.reduce_dtype, device=self.comm.device)
        return advise_huge_pages(full)

    def accumulate(self, slot_index: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook body: move ``param.grad`` into ``full_grads``."""
        if self.full_grads is None:
            self.full_grads = self._new_full_grads()
        view = slot_view(self.full_grads, self.layout.slots[slot_index])
        grad = local_grad(param)
        if grad is not None and grad.data_ptr() != view.data_ptr():
            if slot_index not in self._filled_this_backward:
                view.copy_(grad)
            else:
                view.add_(grad)
            param.grad = None
        self._filled_this_backward.add(slot_index)

    def _zero_unfilled(self) -> None:
        """Zero the slots no gradient reached this backward, and the padding."""
        for slot in self.layout.slots:
            if slot.index not in self._filled_this_backward:
                slot_view(self.full_grads, slot).zero_()
        self.full_grads[self.layout.total_numel :].zero_()

    def start_reduce(self) -> PendingReduce:
        if self.full_grads is None:
            self.full_grads = self._new_full_grads().zero_()
        else:
            self._zero_unfilled()
        lo, hi = self._shard_range()
        pending = self._start_reduce_scatter(torch.empty_like(self.full_grads[lo:hi]))
        self.full_grads = None
        return pending

    def finish_reduce(self, pending: PendingReduce) -> None:
        self.backward_shard = self._wait_averaged(pending)

    def prepare_backward(self) -> None:
        """Nothing to reopen: each backward reduces into a fresh shard."""

    def commit_backward(self) -> None:
        super().commit_backward()
        if self.backward_shard is not None:
            self.shards.add(self.backward_shard)
            self.backward_shard = None

    def discard_backward(self) -> bool:
        """The backward raised: drop what it produced; the gradients accumulated before it stay."""
        self.full_grads = None
        self.backward_shard = None
        self._filled_this_backward.clear()
        for param in self.params:
            param.grad = None  # a gradient autograd set before the backward raised
        return False

    def reset(self) -> None:
        super().reset()
        self.backward_shard = None
        self.full_grads = None
