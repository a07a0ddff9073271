"""One unit's tensors and the transitions between its states.

Tensors of a unit (P = padded numel, S = P / shard group size, which is the
world size unless hybrid sharding splits the ranks into groups):

- ``gathered_params`` (P, compute dtype): the full flat parameters. Every
  module parameter of the unit is a view of it, set once at construction.
  Stage 3 frees and refills its *storage* (``resize_``) instead of swapping
  tensors, so the views (and whatever autograd saved of them) stay valid.
- ``compute_shard`` (S, compute dtype): what this rank contributes to the
  all-gather. Stages 1/2: this rank's slice of ``gathered_params``.
- ``master_shard`` (S, fp32): what the optimizer updates, through one
  parameter view per (parameter ∩ shard) piece. It is ``compute_shard``
  itself when computing in fp32.
- ``full_grads`` (P, reduce dtype): gradients before the reduce-scatter.
  Stage 1 keeps it across steps (the model's ``.grad`` are views of it when
  dtypes allow); stages 2/3 allocate it per backward and drop it once sent.
- ``sharded_grads`` (S, reduce dtype): this rank's averaged gradient slice,
  accumulated across micro-batches until the optimizer step.
- ``backward_shard`` (S, reduce dtype; stages 2/3): what the running
  backward reduced, added to ``sharded_grads`` only when that backward
  completes (``commit_backward``), so a backward that raises leaves no trace
  (``discard_backward``). Without accumulation it simply becomes
  ``sharded_grads``; with accumulation it is one extra shard while a
  backward runs.
- ``group_grads`` (S, reduce dtype; hybrid sharding only): gradients reduced
  inside the shard group and not yet across groups. Micro-batches add to it;
  the end of a synchronising backward (or the step) all-reduces it across
  groups once and adds it to ``sharded_grads`` (``start_reduce_across_groups``),
  so the slow link carries Ψ/k per optimizer step, not per micro-batch.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import NamedTuple

import torch
from torch import nn

from .collectives import CommContext, Handle, Span, all_gather, all_reduce, broadcast, reduce_scatter
from .config import MixedPrecision, StagePlan
from .host_memory import advise_huge_pages
from .layout import FlatLayout, ParamSlot, ShardPiece
from .param_guard import ParameterGuard, guard_class
from .units import UnitPlan


class UnitState(Enum):
    SHARDED = auto()  # stage 3 at rest: gathered_params has no storage
    # All-gather issued into gathered_params, not yet waited on: a stage-3 prefetch, or the
    # stages-1/2 refresh after a step, which the unit's next forward (or any other touch of
    # a parameter, through the guard) waits for.
    GATHERING = auto()
    GATHERED = auto()  # gathered_params holds valid full parameters


class MasterPiece(NamedTuple):
    """What the optimizer sees: a 1-D fp32 view of one parameter's piece of the master shard."""

    piece: ShardPiece
    param: nn.Parameter


def _sum_into(total: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    """``total + more``, in ``total``'s storage when there is one."""
    return more if total is None else total.add_(more)


class PendingReduce(NamedTuple):
    unit: "FlatUnit"
    sharded_out: torch.Tensor
    full_in: torch.Tensor  # kept alive until the collective has read it
    handle: Handle


class FlatUnit:
    def __init__(self, plan: UnitPlan, stage_plan: StagePlan, precision: MixedPrecision, comm: CommContext):
        self.index, self.name, self.module = plan.index, plan.name, plan.module
        self.stage_plan, self.precision, self.comm = stage_plan, precision, comm
        self.label = f"unit '{plan.name}'" if plan.name else "the root unit"
        self.params: list[nn.Parameter] = plan.params
        self.layout = FlatLayout.build(
            [(fqns, p.shape, p.requires_grad) for p, fqns in zip(plan.params, plan.param_fqns)],
            comm.shard_size,
        )
        self.state = UnitState.GATHERED
        self._gather_handle: Handle | None = None
        self.full_grads: torch.Tensor | None = None
        self.sharded_grads: torch.Tensor | None = None
        self.backward_shard: torch.Tensor | None = None
        self.group_grads: torch.Tensor | None = None
        self.slot_has_grad = [False] * len(self.layout.slots)
        self._filled_this_backward: set[int] = set()
        self._flatten_parameters()
        self._own_pieces = {piece.slot.index: piece for piece in self.layout.pieces(comm.shard_rank)}
        # Where each parameter's data starts in the gathered buffer (model_changes.py checks it).
        self.slot_byte_offsets = [s.flat_offset * self.gathered_params.element_size() for s in self.layout.slots]
        # Stage 3 at rest: parameters take a guard class (param_guard.py) instead of their own.
        self.guard = ParameterGuard(self)
        self._param_classes = [type(p) for p in self.params]
        self._slot_of_param = {id(p): i for i, p in enumerate(self.params)}
        self.guard_classes = {cls: guard_class(cls, self.guard) for cls in set(self._param_classes)}
        self._guarding = stage_plan.params_sharded_at_rest
        self._classes_guarded = False  # the parameters have their own classes now
        self.master_pieces = [
            # Every parameter, frozen ones too: unfreezing one later trains it from its shard.
            MasterPiece(piece, nn.Parameter(self._shard_view(self.master_shard, piece)))
            for piece in self.layout.pieces(comm.shard_rank)
        ]
        if not stage_plan.grads_sharded:
            self.full_grads = torch.zeros(self.layout.padded_numel, dtype=precision.reduce_dtype, device=comm.device)
            self._attach_model_grad_views()
        if stage_plan.params_sharded_at_rest:
            self.release()

    # ----------------------------------------------------------------- layout
    def _flatten_parameters(self) -> None:
        """Copy the parameters into the flat buffers and make them views of it.

        Rank 0's values win, as in DDP, so ranks seeded differently still agree.
        """
        layout, comm = self.layout, self.comm
        padded_full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=comm.device)
        for slot, param in zip(layout.slots, self.params):
            self._slot_view(padded_full, slot).copy_(param.detach())
        broadcast(comm, padded_full, label=self.label).wait()
        lo, hi = layout.shard_range(comm.shard_rank)
        compute_dtype = self.precision.compute_dtype
        self.gathered_params = padded_full.to(compute_dtype)
        if self.stage_plan.params_sharded_at_rest:
            self.master_shard = padded_full[lo:hi].clone()
            self.compute_shard = self.master_shard.to(compute_dtype)
        else:
            self.compute_shard = self.gathered_params[lo:hi]
            self.master_shard = self.compute_shard if compute_dtype == torch.float32 else padded_full[lo:hi].clone()
        self._gathered_nbytes = self.gathered_params.untyped_storage().nbytes()
        for slot, param in zip(layout.slots, self.params):
            param.data = self._slot_view(self.gathered_params, slot)

    @staticmethod
    def _slot_view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        return flat[slot.flat_offset : slot.flat_offset + slot.numel].view(slot.shape)

    @staticmethod
    def _shard_view(shard: torch.Tensor, piece: ShardPiece) -> torch.Tensor:
        return shard[piece.shard_start : piece.shard_start + piece.numel]

    # ------------------------------------------------------ gather / release
    def start_gather(self) -> None:
        """SHARDED -> GATHERING: refill the storage and issue the all-gather."""
        if self.state is not UnitState.SHARDED:
            return
        self.gathered_params.untyped_storage().resize_(self._gathered_nbytes)
        advise_huge_pages(self.gathered_params)
        self._gather_handle = all_gather(self.comm, self.gathered_params, self.compute_shard, label=self.label)
        self.state = UnitState.GATHERING

    def wait_gathered(self) -> None:
        """Any state -> GATHERED."""
        self.start_gather()
        if self.state is UnitState.GATHERING:
            self._gather_handle.wait()
            self._gather_handle = None
            self.state = UnitState.GATHERED
            self.set_guard(False)

    def release(self) -> None:
        """Stage 3: GATHERED/GATHERING -> SHARDED, freeing the full parameters."""
        if not self.stage_plan.params_sharded_at_rest or self.state is UnitState.SHARDED:
            return
        self.wait_gathered()
        self.gathered_params.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.set_guard(True)

    # ---------------------------------------------------- parameters at rest
    def set_guard(self, on: bool) -> None:
        """Stage 3: parameters without storage refuse reads (on) or are ordinary again (off)."""
        self._switch_classes(on and self._guarding)

    def _switch_classes(self, guarded: bool) -> None:
        if guarded == self._classes_guarded:
            return  # nothing to switch: no loop over the parameters on the hot path
        for param, own_class in zip(self.params, self._param_classes):
            param.__class__ = self.guard_classes[own_class] if guarded else own_class
        self._classes_guarded = guarded

    @property
    def refreshing(self) -> bool:
        """Stages 1/2: the post-step all-gather may still be writing the parameters."""
        return self.state is UnitState.GATHERING and not self.stage_plan.params_sharded_at_rest

    def stop_guarding(self) -> None:
        """The parameters are ordinary tensors of their own for good (``unshard``)."""
        self.set_guard(False)
        self._guarding = False

    def slot_of(self, param: nn.Parameter) -> int:
        return self._slot_of_param[id(param)]

    def write_param(self, param: nn.Parameter, full_value: torch.Tensor) -> bool:
        """Take this rank's part of a new full value of ``param`` into the shards (no communication).

        False (nothing written) if the value does not have the parameter's shape.
        """
        slot = self.layout.slots[self.slot_of(param)]
        if not isinstance(full_value, torch.Tensor) or full_value.shape != slot.shape:
            return False
        if self.refreshing:
            self.wait_gathered()  # its all-gather still reads the shard this writes
        piece = self._own_pieces.get(slot.index)
        if piece is None:
            return True  # no part of it lies in this rank's shard
        source = full_value.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel]
        self._shard_view(self.master_shard, piece).copy_(source)
        if self.compute_shard.data_ptr() != self.master_shard.data_ptr():
            self._shard_view(self.compute_shard, piece).copy_(source)
        return True

    # ------------------------------------------------------------- gradients
    @property
    def trainable(self) -> bool:
        """Read when a backward starts: freezing and unfreezing are allowed between steps
        (every rank alike; the step's agreement compares which units each reduced)."""
        with torch._C.DisableTorchFunctionSubclass():
            return any(param.requires_grad for param in self.params)

    def _attach_model_grad_views(self) -> None:
        """Stage 1: let autograd accumulate straight into ``full_grads`` (no copy)."""
        if self.precision.reduce_dtype != self.precision.compute_dtype:
            return
        for slot, param in zip(self.layout.slots, self.params):
            param.grad = self._slot_view(self.full_grads, slot) if param.requires_grad else None

    def accumulate_grad(self, slot_index: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook body: move ``param.grad`` into ``full_grads``."""
        slot = self.layout.slots[slot_index]
        if self.full_grads is None:
            self.full_grads = self._new_full_grads()
        view = self._slot_view(self.full_grads, slot)
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            if self.stage_plan.grads_sharded and slot_index not in self._filled_this_backward:
                view.copy_(grad)
            else:
                view.add_(grad)
            keep_view = not self.stage_plan.grads_sharded and view.dtype == param.dtype
            param.grad = view if keep_view else None
        self._filled_this_backward.add(slot_index)

    def _new_full_grads(self) -> torch.Tensor:
        """Stages 2/3 allocate this for every backward: fault it in as huge pages."""
        full = torch.empty(self.layout.padded_numel, dtype=self.precision.reduce_dtype, device=self.comm.device)
        return advise_huge_pages(full)

    def _zero_unfilled(self) -> None:
        """Stages 2/3: zero the slots no gradient reached this backward, and the padding."""
        for slot in self.layout.slots:
            if slot.index not in self._filled_this_backward:
                self._slot_view(self.full_grads, slot).zero_()
        self.full_grads[self.layout.total_numel :].zero_()

    def start_reduce(self) -> PendingReduce | None:
        """Issue the reduce-scatter of ``full_grads``; zeros if no gradient arrived.

        Every rank reduces the same units in the same order whatever its
        local gradients were, so collectives always match across ranks.
        """
        if not self.trainable:
            return None
        if self.full_grads is None:
            self.full_grads = self._new_full_grads().zero_()
        elif self.stage_plan.grads_sharded:
            self._zero_unfilled()
        if self.precision.reduce_dtype != torch.float32:
            self.full_grads.div_(self.comm.world_size)  # low precision: average (over every rank) before summing
        lo, hi = self.layout.shard_range(self.comm.shard_rank)
        full_in = self.full_grads
        sharded_out = torch.empty_like(full_in[lo:hi]) if self.stage_plan.grads_sharded else full_in[lo:hi]
        handle = reduce_scatter(self.comm, sharded_out, full_in, label=self.label)
        if self.stage_plan.grads_sharded:
            self.full_grads = None
        return PendingReduce(self, sharded_out, full_in, handle)

    def finish_reduce(self, pending: PendingReduce) -> None:
        pending.handle.wait()
        if self.precision.reduce_dtype == torch.float32:
            pending.sharded_out.div_(self.comm.world_size)
        if self.stage_plan.grads_sharded:
            self.backward_shard = pending.sharded_out
            return
        if self.comm.replicas > 1:
            self.group_grads = pending.sharded_out  # this rank's slice of full_grads, reduced in its group
        else:
            self.sharded_grads = pending.sharded_out  # this rank's slice of full_grads, reduced in place
        # The model's .grad views now mix this reduced slice with what the reduce left in
        # the others (partial sums): absent is better than wrong (re-attached after the step).
        for param in self.params:
            param.grad = None

    def prepare_backward(self) -> None:
        """Stage 1, a second synchronised backward before the step: reopen the reduced slice.

        After a reduce, this rank's slice of ``full_grads`` holds the average
        and the other slices stale local sums. Putting back the share of the sum
        this rank's reduce adds (all of it; under hybrid sharding one group's
        share, as every group holding the shard adds its own) and zeroing the
        rest makes the next reduce add exactly the new gradients to it.
        """
        if self.stage_plan.grads_sharded or self.sharded_grads is None:
            return
        assert self.group_grads is None, "a synchronising backward reduces across groups before the next"
        lo, hi = self.layout.shard_range(self.comm.shard_rank)
        self.full_grads[:lo].zero_()
        self.full_grads[hi:].zero_()
        self.full_grads[lo:hi].mul_(self.comm.shard_size)
        self.sharded_grads = None

    def commit_backward(self) -> None:
        """The backward completed: its gradients join those accumulated before it."""
        for slot_index in self._filled_this_backward:
            self.slot_has_grad[slot_index] = True
        self._filled_this_backward.clear()
        if self.backward_shard is not None:
            if self.comm.replicas > 1:
                # Hybrid sharding: reduced inside the group only, until the next reduce across groups.
                self.group_grads = _sum_into(self.group_grads, self.backward_shard)
            else:
                self.sharded_grads = _sum_into(self.sharded_grads, self.backward_shard)
            self.backward_shard = None

    def start_reduce_across_groups(self) -> Handle | None:
        """Hybrid sharding: all-reduce ``group_grads`` with the other groups' ranks holding this
        shard; ``finish_reduce_across_groups`` adds the result to ``sharded_grads``."""
        if self.group_grads is None:
            return None
        return all_reduce(self.comm, self.group_grads, label=self.label, span=Span.ACROSS_GROUPS)

    def finish_reduce_across_groups(self, handle: Handle) -> None:
        handle.wait()
        reduced, self.group_grads = self.group_grads, None
        if self.sharded_grads is reduced:
            return  # stage 1: this rank's slice of full_grads, reduced in place
        self.sharded_grads = _sum_into(self.sharded_grads, reduced)

    def discard_backward(self) -> bool:
        """The backward raised: drop what it produced. True if earlier gradients went too.

        Stages 2/3 keep the gradients accumulated before it. Stage 1 lets
        autograd accumulate into ``full_grads`` in place, so an interrupted
        backward cannot be told apart from earlier micro-batches: all go.
        """
        if self.stage_plan.grads_sharded:
            self.full_grads = None
            self.backward_shard = None
            self._filled_this_backward.clear()
            for param in self.params:
                param.grad = None  # a gradient autograd set before the backward raised
            return False
        had_earlier = any(self.slot_has_grad)
        self.reset_grads()
        return had_earlier

    def reset_grads(self) -> None:
        """After the optimizer step: gradients are consumed."""
        self.sharded_grads = None
        self.backward_shard = None
        self.group_grads = None
        self.slot_has_grad = [False] * len(self.layout.slots)
        self._filled_this_backward.clear()
        for piece in self.master_pieces:
            piece.param.grad = None
        if self.stage_plan.grads_sharded:
            self.full_grads = None
        else:
            self.full_grads.zero_()
            self._attach_model_grad_views()

    # ------------------------------------------------------------------ step
    def attach_master_grads(self, slot_has_grad: list[bool]) -> None:
        """Point each master piece's ``.grad`` at its slice of the gradient shard.

        Pieces of parameters no rank produced a gradient for get ``None``, so
        the optimizer skips them exactly as it would without sharding.
        """
        for master in self.master_pieces:
            if self.sharded_grads is None or not slot_has_grad[master.piece.slot.index]:
                master.param.grad = None
                continue
            grad = self._shard_view(self.sharded_grads, master.piece)
            master.param.grad = grad if grad.dtype == torch.float32 else grad.float()

    def start_refresh(self, guard: bool) -> None:
        """After the step: bring the compute copy up to date with the master shard.

        Stages 1/2: GATHERED -> GATHERING; ``wait_gathered`` waits for the
        all-gather of the full parameters. With ``guard`` (overlap_param_refresh)
        the parameters get their guard class meanwhile, so any touch of one
        before the unit's next forward waits for it first.
        """
        if self.refreshing:
            self.wait_gathered()  # an earlier refresh: never two all-gathers into one buffer
        if self.compute_shard.data_ptr() != self.master_shard.data_ptr():
            self.compute_shard.copy_(self.master_shard)
        if self.stage_plan.params_sharded_at_rest:
            return
        self._gather_handle = all_gather(self.comm, self.gathered_params, self.compute_shard, label=self.label)
        self.state = UnitState.GATHERING
        if guard:
            self._switch_classes(True)

    # ------------------------------------------------------- full parameters
    def gather_full_master(self) -> torch.Tensor:
        """The unit's full fp32 flat parameters (padded), gathered from the master shards."""
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.comm.device)
        all_gather(self.comm, full, self.master_shard, label=self.label).wait()
        return full

    def load_full_master(self, full: torch.Tensor) -> None:
        """Take this rank's slice of new full fp32 flat parameters (no communication)."""
        lo, hi = self.layout.shard_range(self.comm.shard_rank)
        self.master_shard.copy_(full[lo:hi])
        if self.compute_shard.data_ptr() != self.master_shard.data_ptr():
            self.compute_shard.copy_(self.master_shard)
        if not self.stage_plan.params_sharded_at_rest:
            self.gathered_params.copy_(full)

    def full_param_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [self._slot_view(full, slot) for slot in self.layout.slots]
