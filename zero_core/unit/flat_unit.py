"""One unit: its parameter storage, its gradients and its guard, composed.

A unit knows nothing of the step or the engine: the pass (``passes/``) drives
it through these methods, each a thin forward to the part that owns the
state (``storage.py``, ``grads.py``, ``guard.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..collectives import CommContext, Handle
from ..config import MixedPrecision
from ..host_memory import host_zeros
from ..offload.shard_files import ShardFiles
from ..offload.state_files import StateFiles
from ..offload_plan import UnitOffload
from ..stage_plan import StagePlan
from ..wire_plan import WirePlan
from .dtensor_params import local_shape, place_in_whole
from .grads import LocalGrads, PendingReduce, ShardedGrads, UnitGrads
from .guard import Comparisons, ParameterGuard
from .layout import FlatLayout, ShardPiece, shard_view, slot_view
from .storage import ParamStorage, StorageState
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
        comparisons: Comparisons | None = None,
        param_files: ShardFiles | None = None,
        state_files: StateFiles | None = None,
        wire: WirePlan = WirePlan(),
    ):
        """``offload``: where its tensors rest (the offload plan's); ``param_files``, ``state_files``: the file
        tiers it names (offload_params and offload_optimizer "nvme"); ``wire``: how its gathers travel."""
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
            MasterPiece(piece, nn.Parameter(shard_view(self.resting_master, piece)))
            for piece in self.layout.pieces(comm.shard_rank)
        ]
        grads_class = ShardedGrads if stage_plan.grads_sharded else LocalGrads
        self.grads: UnitGrads = grads_class(self.layout, self.params, precision, comm, self.label, wire)
        if stage_plan.params_sharded_at_rest:
            self.reshard()

    # ---------------------------------------------------------------- storage
    @property
    def gathered_params(self) -> torch.Tensor:
        return self.storage.gathered_params

    @property
    def compute_shard(self) -> torch.Tensor:
        return self.storage.compute_shard

    @property
    def master_shard(self) -> torch.Tensor:
        """Its values in memory: with the NVMe optimizer tier, read back now if its file holds them."""
        return self.storage.master_shard

    @property
    def master_rests_on_disk(self) -> bool:
        """offload_optimizer="nvme": the master rests in the optimizer tier's file between steps."""
        return self.offload.master_in_file

    @property
    def resting_master(self) -> torch.Tensor:
        """As it is now, nothing read (its storage empty while the NVMe tier's file holds it)."""
        return self.storage.resting_master

    @property
    def compute_copy_current(self) -> bool:
        """The compute copy holds the master's values already (the NVMe optimizer tier copied them)."""
        return self.storage.compute_copy_current

    @compute_copy_current.setter
    def compute_copy_current(self, current: bool) -> None:
        self.storage.compute_copy_current = current

    def copy_master_to_compute(self, values: torch.Tensor | None = None) -> None:
        """The NVMe optimizer tier: the compute copy takes the master's values (or ``values``) now."""
        self.storage.copy_master_to_compute(values)

    @property
    def params_offloaded(self) -> bool:
        """offload_params (stage 3, sharded units): the parameter shard rests in host memory between gathers."""
        return self.storage.host_shard is not None

    @property
    def params_on_disk(self) -> bool:
        """offload_params="nvme": the parameter shard rests in a file between gathers."""
        return self.storage.shard_file is not None

    @property
    def param_bytes_on_disk(self) -> int:
        return self.storage.bytes_on_disk

    def read_ahead(self) -> None:
        """offload_params="nvme": start reading the parameter shard back, for a gather predicted soon."""
        self.storage.read_ahead()

    @property
    def host_shard(self) -> torch.Tensor | None:
        """offload_params: the parameter shard at rest in host memory (None: it rests in ``compute_shard``)."""
        return self.storage.host_shard

    @property
    def state(self) -> StorageState:
        return self.storage.state

    @property
    def refreshing(self) -> bool:
        """Stages 1/2: the post-step all-gather may still be writing the parameters."""
        return self.storage.refreshing

    def start_gather(self, backward: bool = False) -> None:
        """For a ``backward``: from the secondary pieces (hpZ) when they were kept."""
        self.storage.start_gather(backward)

    def wait_gathered(self, backward: bool = False) -> None:
        self.storage.wait_gathered(backward)

    def reshard(self, keep_secondary: bool = False) -> None:
        """Stage 3: any state -> SHARDED, the full parameters freed (FSDP2's reshard); ``keep_secondary``:
        after a forward with a backward to come, hpZ keeps this rank's piece (FSDP2's int reshard_after_forward)."""
        self.storage.reshard(keep_secondary)

    def forget_secondary(self) -> None:
        self.storage.forget_secondary()

    @property
    def secondary_piece(self) -> torch.Tensor | None:
        """hpZ: this rank's piece kept from the last forward for the backward (None: none kept)."""
        return self.storage.secondary.piece if self.storage.secondary is not None else None

    @property
    def wire_buffers(self) -> tuple[torch.Tensor, ...]:
        """ZeRO++: the packed buffers of this unit's quantized gather (qwZ) and reduce (qgZ) while in flight."""
        return self.storage.wire_buffers + self.grads.wire_buffers

    def start_refresh(self, guard: bool) -> None:
        self.storage.start_refresh(guard)

    def gather_full_master(self) -> torch.Tensor:
        return self.storage.gather_full_master()

    def load_full_master(self, full: torch.Tensor) -> None:
        self.storage.load_full_master(full)

    def load_master_shard(self, shard: torch.Tensor) -> None:
        self.storage.load_master_shard(shard)

    def full_param_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [slot_view(full, slot) for slot in self.layout.slots]

    # -------------------------------------------------------------- the guard
    def set_guard(self, on: bool) -> None:
        """Stage 3: parameters without storage refuse reads (on) or are ordinary again (off)."""
        self.guard.guard(on)

    def stop_guarding(self) -> None:
        """The parameters are ordinary tensors of their own for good (``unshard``)."""
        self.guard.stop_guarding()

    def slot_of(self, param: nn.Parameter) -> int:
        return self._slot_of_param[id(param)]

    def name_of(self, param: nn.Parameter) -> str:
        return self.layout.slots[self.slot_of(param)].fqns[0]

    def write_param(self, param: nn.Parameter, full_value: torch.Tensor) -> bool:
        """Take this rank's part of a new full value of ``param`` into the shards (no communication)."""
        return self.storage.write_param(self.slot_of(param), full_value)

    # -------------------------------------------------------------- gradients
    @property
    def trainable(self) -> bool:
        """Read when a backward starts: freezing and unfreezing are allowed between steps
        (every rank alike; the step's agreement compares which units each reduced)."""
        with torch._C.DisableTorchFunctionSubclass():
            return any(param.requires_grad for param in self.params)

    @property
    def slot_has_grad(self) -> list[bool]:
        return self.grads.slot_has_grad

    @property
    def has_every_grad(self) -> bool:
        """Every parameter of the unit that requires grad has a gradient on this rank."""
        return self.grads.has_every_grad()

    @property
    def sharded_grads(self) -> torch.Tensor | None:
        """This rank's reduced gradient shard (S, reduce dtype), or None before any reduce."""
        return self.grads.sharded_grads

    def accumulate_grad(self, slot_index: int, param: nn.Parameter) -> None:
        self.grads.accumulate(slot_index, param)

    def start_reduce(self) -> PendingReduce | None:
        """Issue the reduce-scatter of this backward's gradients; zeros if no gradient arrived.

        Every rank reduces the same units in the same order whatever its
        local gradients were, so collectives always match across ranks.
        """
        return self.grads.start_reduce() if self.trainable else None

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for a reduce-scatter ``start_reduce`` issued and keep its averaged shard."""
        self.grads.finish_reduce(pending)

    def prepare_backward(self) -> None:
        self.grads.prepare_backward()

    def commit_backward(self) -> None:
        self.grads.commit_backward()

    def start_reduce_across_groups(self) -> Handle | None:
        """Hybrid sharding: all-reduce what was reduced inside the shard group only."""
        return self.grads.shards.start_across_groups(self.comm, self.label)

    def finish_reduce_across_groups(self, handle: Handle) -> None:
        self.grads.shards.finish_across_groups(handle)

    def discard_backward(self) -> bool:
        """The backward raised: drop what it produced. True if earlier gradients went too."""
        return self.grads.discard_backward()

    def reset_grads(self) -> None:
        """After the optimizer step: gradients are consumed."""
        self.grads.reset()
        for piece in self.master_pieces:
            piece.param.grad = None

    @property
    def holds_grads(self) -> bool:
        return self.grads.holds_grads

    def zero_grads(self, slots: frozenset[int] | None, set_to_none: bool) -> None:
        """``zero_grad``: drop the gradients of ``slots`` (None: all) accumulated since the last step."""
        self.grads.zero_grads(slots, set_to_none)

    def attach_master_grads(self, slot_has_grad: list[bool]) -> None:
        """Point each master piece's ``.grad`` at its slice of the gradient shard.

        Pieces of parameters no rank produced a gradient for get ``None``, so
        the optimizer skips them exactly as it would without sharding.
        """
        sharded_grads = self.sharded_grads
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
