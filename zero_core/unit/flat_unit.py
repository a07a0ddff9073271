"""One unit: its parameter storage, its gradients and its guard, composed.

A unit knows nothing of the step or the engine: the pass (``passes/``) drives
its parts directly (``unit.storage``, ``unit.grads``, ``unit.guard``: the
state each owns, in ``storage.py``, ``grads.py``, ``guard.py``); the unit
itself keeps only what spans them: its layout's slots, the master pieces the
optimizer sees, and whether it trains this backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..collectives import CommContext
from ..config import MixedPrecision
from ..host_memory import host_zeros
from ..offload.shard_files import ShardFiles
from ..offload.state_files import StateFiles
from ..offload_plan import UnitOffload
from ..stage_plan import StagePlan
from ..wire_plan import WirePlan
from .dtensor_params import local_shape, place_in_whole
from .grads import LocalGrads, PendingReduce, ShardedGrads, UnitGrads
from .guard import ParameterDigests, ParameterGuard
from .layout import FlatLayout, ShardPiece, shard_view, slot_view
from .storage import ParamStorage
from .unit_selection import UnitPlan


class MasterPiece(NamedTuple):
    """What the optimizer sees: a 1-D fp32 view of one parameter's piece of the master shard."""

    piece: ShardPiece
    param: nn.Parameter


class FlatUnit:
    def __init__(
        self,
        plan: UnitPlan,
        stage_plan: StagePlan,
        precision: MixedPrecision,
        comm: CommContext,
        offload: UnitOffload,
        comparisons: ParameterDigests | None = None,
        param_files: ShardFiles | None = None,
        state_files: StateFiles | None = None,
        wire: WirePlan = WirePlan(),
        polled_reduces: bool = False,
    ):
        """``offload``: where its tensors rest (the offload plan's); ``param_files``, ``state_files``: the file
        tiers it names (offload_params and offload_optimizer "nvme"); ``wire``: how its gathers travel;
        ``polled_reduces``: its gradient reduces are asked whether they landed (``UnitGrads``)."""
        self.index, self.name, self.module = plan.index, plan.name, plan.module
        self.stage_plan, self.precision, self.comm = stage_plan, precision, comm
        self.label = f"unit '{plan.name}'" if plan.name else "the root unit"
        self.params: list[nn.Parameter] = plan.params
        self.layout = FlatLayout.build(
            [(fqns, local_shape(p), p.requires_grad) for p, fqns in zip(plan.params, plan.param_fqns)],
            comm.shard_size,
            places=[place_in_whole(p) for p in plan.params],
        )
        self._slot_of_param = {id(p): i for i, p in enumerate(self.params)}
        # Stage 3 at rest: parameters take a guard class (guard.py) instead of their own.
        self.guard = ParameterGuard(self, self.params, stage_plan.params_sharded_at_rest, comparisons)
        # Offloaded (offload_optimizer): the master shard, the optimizer state and a copy of the reduced
        # gradient shard live in host memory, and the optimizer steps the unit there.
        self.offload = offload
        self.offloaded = offload.offloaded
        self.host_grads: torch.Tensor | None = None  # (S, fp32) pinned, made at the first step (GPU devices)
        self.storage = ParamStorage(
            self.layout,
            self.params,
            stage_plan.params_sharded_at_rest,
            precision,
            comm,
            self.guard,
            self.label,
            offload,
            param_files=param_files,
            state_files=state_files,
            wire=wire,
        )
        # Where each parameter's data starts in the gathered buffer (model/changes.py checks it).
        element_size = self.storage.gathered_params.element_size()
        self.slot_byte_offsets = [s.flat_offset * element_size for s in self.layout.slots]
        self.master_pieces = [
            # Every parameter, frozen ones too: unfreezing one later trains it from its shard.
            MasterPiece(piece, nn.Parameter(shard_view(self.storage.resting_master, piece)))
            for piece in self.layout.pieces(comm.shard_rank)
        ]
        grads_class = ShardedGrads if stage_plan.grads_sharded else LocalGrads
        self.grads: UnitGrads = grads_class(
            self.layout, self.params, precision, comm, self.label, wire, polled_reduces=polled_reduces
        )
        if stage_plan.params_sharded_at_rest:
            self.storage.reshard()

    # ------------------------------------------------------ across its parts
    @property
    def master_rests_on_disk(self) -> bool:
        """offload_optimizer="nvme": the master rests in the optimizer tier's file between steps."""
        return self.offload.master_in_file

    @property
    def wire_buffers(self) -> tuple[torch.Tensor, ...]:
        """ZeRO++: the packed buffers of this unit's quantized gather (qwZ) and reduce (qgZ) while in flight."""
        return self.storage.wire_buffers + self.grads.wire_buffers

    def full_param_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [slot_view(full, slot) for slot in self.layout.slots]

    def slot_of(self, param: nn.Parameter) -> int:
        return self._slot_of_param[id(param)]

    def name_of(self, param: nn.Parameter) -> str:
        return self.layout.slots[self.slot_of(param)].fqns[0]

    def write_param(self, param: nn.Parameter, full_value: torch.Tensor) -> bool:
        """Take this rank's part of a new full value of ``param`` into the shards (no communication)."""
        return self.storage.write_param(self.slot_of(param), full_value)

    @property
    def trainable(self) -> bool:
        """Read when a backward starts: freezing and unfreezing are allowed between steps
        (every rank alike; the step's agreement compares which units each reduced)."""
        with torch._C.DisableTorchFunctionSubclass():
            return any(param.requires_grad for param in self.params)

    def start_reduce(self) -> PendingReduce | None:
        """Issue the reduce-scatter of this backward's gradients; zeros if no gradient arrived.

        Every rank reduces the same units in the same order whatever its
        local gradients were, so collectives always match across ranks.
        """
        return self.grads.start_reduce() if self.trainable else None

    def reset_grads(self) -> None:
        """After the optimizer step: gradients are consumed."""
        self.grads.reset()
        for piece in self.master_pieces:
            piece.param.grad = None

    def attach_master_grads(self, slot_has_grad: list[bool]) -> None:
        """Point each master piece's ``.grad`` at its slice of the gradient shard.

        Pieces of parameters no rank produced a gradient for get ``None``, so
        the optimizer skips them exactly as it would without sharding.
        """
        sharded_grads = self.grads.sharded_grads
        if self.offloaded and sharded_grads is not None:
            sharded_grads = self._copy_grads_to_host(sharded_grads)
        for master in self.master_pieces:
            if sharded_grads is None or not slot_has_grad[master.piece.slot.index]:
                master.param.grad = None
                continue
            grad = shard_view(sharded_grads, master.piece)
            master.param.grad = grad if grad.dtype == torch.float32 else grad.float()

    def _copy_grads_to_host(self, sharded_grads: torch.Tensor) -> torch.Tensor:
        """The reduced shard (after unscaling and clipping) into the unit's host buffer, in the optimizer's
        fp32; from a GPU asynchronously: the step waits once for every unit's copy (wait_for_host_copies).
        On a CPU device the shard is in host memory already: no copy, no second buffer."""
        if sharded_grads.device.type == "cpu":
            return sharded_grads
        if self.host_grads is None:
            self.host_grads = host_zeros(sharded_grads.numel(), torch.float32, sharded_grads.device)
        self.host_grads.copy_(sharded_grads, non_blocking=self.host_grads.is_pinned())
        return self.host_grads
