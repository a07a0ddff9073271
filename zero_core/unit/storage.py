"""One unit's parameter storage and its states.

Tensors (P = padded numel, S = P / shard group size, which is the world size
unless hybrid sharding splits the ranks into groups):

- ``gathered_params`` (P, compute dtype): the full flat parameters. Every
  module parameter of the unit is a view of it, set once at construction.
  Stage 3 frees and refills its *storage* (``resize_``) instead of swapping
  tensors, so the views (and whatever autograd saved of them) stay valid.
- ``compute_shard`` (S, compute dtype): what this rank contributes to the
  all-gather. Stages 1/2: this rank's slice of ``gathered_params``.
- ``master_shard`` (S, fp32): what the optimizer updates, through one
  parameter view per (parameter ∩ shard) piece. It is ``compute_shard``
  itself when computing in fp32, unless the unit is offloaded
  (``offload_optimizer``) from a GPU: then it lives in pinned host memory
  and each refresh copies it to the device. With ``offload_optimizer="nvme"``
  a master that is a tensor of its own (``UnitOffload.master_in_file``) rests
  in the optimizer state's file between steps (offload/state_files.py), beside
  its moments: the tier copies it into the compute copy right after the unit's
  step, and any reader here (``master_shard``) has the tier bring it back first.
- ``host_shard`` (S, compute dtype), stage 3 with ``offload_params``: the
  parameter shard at rest, in host memory (pinned on a GPU; the master
  itself where that is a host fp32 shard). ``compute_shard`` is then only a
  staging buffer on the device: filled from ``host_shard`` on the
  all-gather's stream right before each gather, freed once the gather
  landed. On a CPU device the same path runs, host and device the same memory.
  With ``offload_params="nvme"`` it is never the master, and its bytes rest in a
  file (``shard_file``, offload/shard_files.py): read back for each gather,
  written after each refresh.

Where each tensor rests is the unit's ``UnitOffload`` (the offload plan's); the
file tiers it names are held here, typed from ``offload/`` below.

Each transition is one idempotent method (FSDP2's ``_to_sharded`` /
``_to_unsharded``): calling it in the state it leads to does nothing.
"""

from __future__ import annotations

from enum import Enum, auto
from functools import partial

import torch
from torch import nn

from ..collectives import CommContext, Handle, Span, all_gather, all_gather_quantized, broadcast
from ..config import MixedPrecision
from ..host_memory import advise_huge_pages, copy_to_device, host_zeros
from ..offload.shard_files import ShardFile, ShardFiles
from ..offload.state_files import StateFiles
from ..offload_plan import Rest, UnitOffload
from ..wire_plan import WirePlan
from .dtensor_params import local_piece_of, local_values, point_at
from .guard import ParameterGuard
from .layout import FlatLayout, shard_view, slot_view


class SecondaryShard:
    """ZeRO++'s secondary shard (hpZ): a unit's parameters kept between its forward and its backward in 1/k pieces over
    a group of k ranks (a node), so the backward's all-gather stays inside that group.

    When the forward frees a unit's full parameters (stage 3, with a backward to come) this rank keeps its piece of
    them, in the compute dtype: the values the forward computed with (dequantized ones under ``quantize_weights``), so
    the backward computes with the very same values and the numbers are those of a run without it. The backward's gather
    of the unit fills the full buffer from the group's pieces and lets the piece go. Any write of the parameters (a
    step, a load) forgets it, and so does the end of a backward that did not gather the unit: a piece never outlives the
    values it was cut from.

    Memory: P/k elements in the compute dtype per unit, between its forward and its backward. With k = 1 the piece is
    the whole unit: the gathered buffer itself stays allocated (no copy either way), the unit SHARDED and guarded as at
    rest; a reshard that keeps nothing, or a forget, frees it.
    """

    def __init__(self, comm: CommContext, label: str):
        self.comm, self.label = comm, label
        self.piece: torch.Tensor | None = None  # this rank's 1/k of the full parameters, while kept

    def keep(self, gathered: torch.Tensor) -> None:
        """The forward is done with ``gathered`` (full, valid): keep this rank's piece of it."""
        _, size = self.comm.span(Span.SECONDARY)
        if size == 1:
            self.piece = gathered  # the caller leaves its storage allocated (ParamStorage.reshard)
            return
        length = gathered.numel() // size
        start = self.comm.rank_in(Span.SECONDARY) * length
        # Faulted in as huge pages like the gathered buffer (a clone's fresh pages fault 4 KiB at a time).
        self.piece = advise_huge_pages(torch.empty_like(gathered[start : start + length]))
        self.piece.copy_(gathered[start : start + length])

    def gather_into(self, gathered: torch.Tensor) -> Handle | None:
        """The backward's gather from the kept pieces, the piece let go (the collective holds what it reads);
        None when there is no piece to gather from."""
        piece, self.piece = self.piece, None
        if piece is None:
            return None
        if piece is gathered:  # k = 1: the values never left the buffer
            return Handle()
        return all_gather(self.comm, gathered, piece, label=self.label, span=Span.SECONDARY)

    def holds(self, gathered: torch.Tensor) -> bool:
        """k = 1: the kept piece is ``gathered`` itself, whose storage must stay allocated while it is kept."""
        return self.piece is gathered

    def forget(self) -> None:
        self.piece = None


class StorageState(Enum):
    """Where a unit's full parameters (``gathered_params``) stand."""

    SHARDED = auto()  # stage 3 at rest: gathered_params has no storage
    PREFETCHING = auto()  # stage 3: all-gather issued into refilled storage, not yet waited on
    GATHERED = auto()  # gathered_params holds valid full parameters
    # Stages 1/2 after a step: the all-gather of the updated shards is still writing the full
    # parameters; the unit's next forward (or any touch of a parameter, through the guard) waits.
    REFRESHING = auto()


def check_master_placement(
    master: torch.Tensor, parameters: list[torch.Tensor], offload: UnitOffload, label: str
) -> None:
    """With the optimizer state in files, the plan rests the master in them only if it is its own memory.
    Where the plan and the tensors disagree (a case the plan's tests did not build), freeing the master would
    free the parameters, or a master left in memory would be counted on disk: refused before any work, with
    the same message on every rank (every rank builds the same units)."""
    if not offload.state_in_file:
        return
    address = master.untyped_storage().data_ptr()
    own_memory = address != 0 and all(address != t.untyped_storage().data_ptr() for t in parameters)
    if offload.master_in_file != own_memory:
        raise RuntimeError(
            f"ZeRO: internal error: the offload plan puts {label}'s fp32 master "
            f"{'in' if offload.master_in_file else 'outside'} the optimizer state's file, but it was built "
            f"{'as the memory of the parameters' if offload.master_in_file else 'as a tensor of its own'}. "
            "Please report it with your config; offload_optimizer='cpu' avoids it."
        )


class ParamStorage:
    def __init__(
        self,
        layout: FlatLayout,
        params: list[nn.Parameter],
        sharded_at_rest: bool,
        precision: MixedPrecision,
        comm: CommContext,
        guard: ParameterGuard,
        label: str,
        offload: UnitOffload,
        param_files: ShardFiles | None = None,
        state_files: StateFiles | None = None,
        wire: WirePlan = WirePlan(),
    ):
        """``offload``: where the unit's tensors rest; ``param_files``, ``state_files``: the file tiers it names
        (offload_params and offload_optimizer "nvme"); ``wire``: how its gathers travel (ZeRO++)."""
        self.layout, self.params, self.comm, self.label = layout, params, comm, label
        self.sharded_at_rest = sharded_at_rest
        self.guard = guard
        self.state = StorageState.GATHERED
        self._gather_handle: Handle | None = None
        # qwZ: stage 3's gathers before the unit runs carry int8 blocks; a refresh and the masters' gathers stay exact.
        block = wire.weight_block_size
        self._compute_gather = all_gather if block is None else partial(all_gather_quantized, block_size=block)
        # hpZ: this rank's piece of the full parameters, kept from a forward for the backward's gather.
        self.secondary = SecondaryShard(comm, label) if wire.secondary_size is not None else None
        self.offload = offload
        param_files = param_files if offload.param_shard_in_file else None
        params_moved = offload.param_shard is not Rest.DEVICE  # offload_params, a unit sharded at rest
        # A master that rests in the optimizer state's file is pageable (a pinned block resized to zero stays in
        # torch's pinned cache); every other host master, the host parameter shard among them, stays pinned.
        self._flatten_parameters(precision.compute_dtype, offload.offloaded, pinned_master=not offload.master_in_file)
        self.host_shard: torch.Tensor | None = None
        self.shard_file: ShardFile | None = None  # offload_params="nvme": where host_shard's bytes rest
        self._host_shard_read: torch.cuda.Event | None = None  # the last asynchronous copy out of host_shard
        if params_moved:
            self._move_shard_to_host(precision.compute_dtype, param_files)
        # offload_optimizer="nvme": the master rests in the optimizer state's file between steps, unless it is
        # the parameters' own memory (fp32 on a CPU device: the compute shard or the full parameters). Its tier
        # settles its writes and reads back what its files hold before every read or write of the master (a
        # write still pending would free newer values once done).
        parameters = [self.gathered_params, self.compute_shard] + (
            [self.host_shard] if self.host_shard is not None else []
        )
        check_master_placement(self._master, parameters, offload, label)
        self._state_files = state_files if offload.master_in_file else None
        # The compute copy already holds the master's values: the tier copied them right after the unit's step,
        # before the master went to disk, so the refresh that follows leaves the copy out. Set by
        # copy_master_to_compute; cleared when the unit's step begins, by every refresh, and by every other
        # write of the master.
        self.compute_copy_current = False
        self._own_pieces = {piece.slot.index: piece for piece in layout.pieces(comm.shard_rank)}

    def _flatten_parameters(self, compute_dtype: torch.dtype, host_master: bool, pinned_master: bool) -> None:
        """Copy the parameters into the flat buffers and make them views of it.

        Rank 0's values win, as in DDP, so ranks seeded differently still agree.
        """
        layout, comm = self.layout, self.comm
        padded_full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=comm.device)
        for slot, param in zip(layout.slots, self.params):
            slot_view(padded_full, slot).copy_(local_values(param))
        broadcast(comm, padded_full, label=self.label).wait()
        self._agree_across_tensor_parallel_ranks(padded_full)
        lo, hi = layout.shard_range(comm.shard_rank)
        self.gathered_params = padded_full.to(compute_dtype)
        if host_master and comm.device.type != "cpu":  # on a CPU device the master is in host memory already
            # Pageable when it goes to disk: a pinned block resized to zero would stay in torch's pinned cache.
            self._master = host_zeros(hi - lo, torch.float32, comm.device if pinned_master else torch.device("cpu"))
            self._master.copy_(padded_full[lo:hi])
            own = padded_full[lo:hi].to(compute_dtype, copy=True)
            self.compute_shard = own if self.sharded_at_rest else self.gathered_params[lo:hi]
        elif self.sharded_at_rest:
            self._master = padded_full[lo:hi].clone()
            self.compute_shard = self._master.to(compute_dtype)
        else:
            self.compute_shard = self.gathered_params[lo:hi]
            self._master = self.compute_shard if compute_dtype == torch.float32 else padded_full[lo:hi].clone()
        self._gathered_nbytes = self.gathered_params.untyped_storage().nbytes()
        for slot, param in zip(layout.slots, self.params):
            point_at(param, slot_view(self.gathered_params, slot))

    def _agree_across_tensor_parallel_ranks(self, padded_full: torch.Tensor) -> None:
        """A 2-D mesh: what every tensor-parallel rank holds alike (plain and Replicate parameters) takes the
        first one's values, as data-parallel ranks take rank 0's: ranks seeded differently still agree."""
        replicated = [slot for slot in self.layout.slots if not slot.spread_over_ranks]
        if self.comm.tensor_parallel_size == 1 or not replicated:
            return
        values = torch.cat([slot_view(padded_full, slot).reshape(-1) for slot in replicated])
        broadcast(self.comm, values, label=self.label, span=Span.TENSOR_PARALLEL).wait()
        for slot, value in zip(replicated, values.split([slot.numel for slot in replicated])):
            slot_view(padded_full, slot).copy_(value.view(slot.shape))

    def _move_shard_to_host(self, compute_dtype: torch.dtype, param_files: ShardFiles | None) -> None:
        """offload_params: the parameter shard rests in host memory (or, "nvme", in a file); the device keeps
        an empty staging buffer."""
        if self._master.device.type == "cpu" and compute_dtype == torch.float32 and param_files is None:
            self.host_shard = self._master  # the host fp32 master is the shard itself (no file): no second copy
        elif self.compute_shard.device.type == "cpu" and self.compute_shard is not self._master:
            self.host_shard = self.compute_shard
        elif param_files is not None:  # a copy of its own, the master staying where the optimizer keeps it;
            # pageable: a pinned storage resized to zero goes back to torch's pinned cache, not to the system.
            self.host_shard = self.compute_shard.to("cpu", copy=True)
        else:
            self.host_shard = host_zeros(self.compute_shard.numel(), compute_dtype, self.comm.device)
            self.host_shard.copy_(self.compute_shard)
        if param_files is not None:
            self.shard_file = param_files.file_for(self.host_shard)
        self.compute_shard = torch.empty(self.host_shard.numel(), dtype=compute_dtype, device=self.comm.device)
        self._staging_nbytes = self.compute_shard.untyped_storage().nbytes()
        self.compute_shard.untyped_storage().resize_(0)

    @property
    def master_shard(self) -> torch.Tensor:
        """The fp32 master shard, its values in memory, to read or write (with the NVMe optimizer tier, read back
        now if its file holds them: they stay in memory until the next step writes them out again)."""
        if self._state_files is not None:
            self._state_files.make_resident()
        return self._master

    @property
    def resting_master(self) -> torch.Tensor:
        """The master shard as it is now, nothing read: its storage is empty while the tier's file holds it (for
        counting bytes, and for the tier itself)."""
        return self._master

    def copy_master_to_compute(self, values: torch.Tensor | None = None) -> None:
        """The NVMe optimizer tier, right after this unit stepped and before its master goes to disk: the compute
        copy (or the parameter shard at rest) takes the master's values now; the refresh that follows leaves
        the copy out (stages 1/2 still all-gather the full parameters there). ``values``: the master's values
        read from its file (a load put them there), the master itself left on disk."""
        shard = self._shard_for_writing(keep_values=False)
        shard.copy_(self._master if values is None else values)  # from pageable memory: done when this returns
        self._shard_written()
        self.compute_copy_current = True

    @property
    def params_offloaded(self) -> bool:
        """offload_params (stage 3, sharded units): the parameter shard rests in host memory between gathers."""
        return self.host_shard is not None

    @property
    def params_on_disk(self) -> bool:
        """offload_params="nvme": the parameter shard rests in a file between gathers."""
        return self.shard_file is not None

    @property
    def secondary_piece(self) -> torch.Tensor | None:
        """hpZ: this rank's piece kept from the last forward for the backward (None: none kept)."""
        return self.secondary.piece if self.secondary is not None else None

    @property
    def bytes_on_disk(self) -> int:
        """offload_params="nvme": the shard's bytes when its file holds them and memory does not."""
        return self.shard_file.bytes_on_disk if self.shard_file is not None else 0

    def _wait_host_shard_read(self) -> None:
        """A copy still reading the host shard (to the device, for a gather) is done; with a file, the shard's
        memory is then freed (the file holds its values)."""
        if self._host_shard_read is not None:
            self._host_shard_read.synchronize()
            self._host_shard_read = None
        if self.shard_file is not None:
            self.shard_file.in_use = False
            self.shard_file.free_if_on_disk()

    def _shard_for_writing(self, keep_values: bool = True) -> torch.Tensor:
        """Where this rank's parameter shard (compute dtype) lives between gathers, ready to be written (then
        :meth:`_shard_written`); ``keep_values=False``: all of it is overwritten (a file is not read)."""
        self._wait_host_shard_read()
        if self.shard_file is not None:
            return self.shard_file.for_writing(keep_values)
        return self.host_shard if self.host_shard is not None else self.compute_shard

    def _shard_written(self) -> None:
        """The parameters' values changed: a secondary piece cut from the old ones is forgotten."""
        self.forget_secondary()
        if self.shard_file is not None:
            self.shard_file.store()  # written behind, freed once on disk

    def forget_secondary(self) -> None:
        if self.secondary is None:
            return
        if self.secondary.holds(self.gathered_params) and self.state is StorageState.SHARDED:
            self.gathered_params.untyped_storage().resize_(0)  # hpZ, k = 1: the kept buffer goes with it
        self.secondary.forget()

    # ------------------------------------------------------------ transitions
    @property
    def refreshing(self) -> bool:
        """Stages 1/2: the post-step all-gather may still be writing the parameters."""
        return self.state is StorageState.REFRESHING

    @property
    def live(self) -> bool:
        """The full parameters take memory (gathered, or being gathered)."""
        return self.state is not StorageState.SHARDED

    @property
    def wire_buffers(self) -> tuple[torch.Tensor, ...]:  # qwZ: a quantized gather's, until it is waited for
        return self._gather_handle.wire_buffers if self._gather_handle is not None else ()

    def start_gather(self, backward: bool = False) -> None:
        """SHARDED -> PREFETCHING: refill the storage and issue the all-gather (for a ``backward``, from the
        secondary pieces when they were kept)."""
        if self.state is not StorageState.SHARDED:
            return
        self.gathered_params.untyped_storage().resize_(self._gathered_nbytes)
        advise_huge_pages(self.gathered_params)
        handle = self.secondary.gather_into(self.gathered_params) if backward and self.secondary else None
        self._gather_handle = handle if handle is not None else self._gather_from_shard()
        self.state = StorageState.PREFETCHING

    def _gather_from_shard(self) -> Handle:
        """Every rank's shard all-gathered (staged from the host or a file first, with offload_params)."""
        if self.host_shard is not None:
            self.compute_shard.untyped_storage().resize_(self._staging_nbytes)
            source = self.shard_file.values() if self.shard_file is not None else self.host_shard
            self._host_shard_read = copy_to_device(self.compute_shard, source, self.comm.all_gather_stream)
            if self.shard_file is not None:
                # From pinned memory a GPU's copy runs on after this returns: freed once it landed.
                self.shard_file.in_use = self._host_shard_read is not None and source.is_pinned()
                self.shard_file.free_if_on_disk()
        return self._compute_gather(self.comm, self.gathered_params, self.compute_shard, label=self.label)

    def wait_gathered(self, backward: bool = False) -> None:
        """Any state -> GATHERED."""
        self.start_gather(backward)
        if self.state in (StorageState.PREFETCHING, StorageState.REFRESHING):
            self._gather_handle.wait()
            self._gather_handle = None
            if self.host_shard is not None:
                self.compute_shard.untyped_storage().resize_(0)  # landed: the staging copy is not needed
            if self.shard_file is not None:
                self._wait_host_shard_read()
            self.state = StorageState.GATHERED
            self.guard.guard(False)

    def read_ahead(self) -> None:
        """offload_params="nvme": start reading the shard of a unit predicted to gather soon."""
        if self.shard_file is not None and self.state is StorageState.SHARDED:
            self.shard_file.read_ahead()

    def reshard(self, keep_secondary: bool = False) -> None:
        """Stage 3: any state -> SHARDED, freeing the full parameters (and a shard read ahead for nothing);
        ``keep_secondary``: after a forward with a backward to come, hpZ keeps this rank's piece."""
        if self.shard_file is not None:
            self.shard_file.free_if_on_disk()
        if not self.sharded_at_rest or self.state is StorageState.SHARDED:
            return
        self.wait_gathered()
        if keep_secondary and self.secondary is not None:
            self.secondary.keep(self.gathered_params)
        elif self.secondary is not None and self.secondary.holds(self.gathered_params):
            self.secondary.forget()  # k = 1: the piece kept earlier is this buffer, freed now (the shard remains)
        if self.secondary is None or not self.secondary.holds(self.gathered_params):
            self.gathered_params.untyped_storage().resize_(0)
        self.state = StorageState.SHARDED
        self.guard.guard(True)

    def start_refresh(self, guard: bool) -> None:
        """After the step: bring the compute copy up to date with the master shard.

        Stages 1/2: GATHERED -> REFRESHING; ``wait_gathered`` waits for the
        all-gather of the full parameters. With ``guard`` (overlap_param_refresh)
        the parameters get their guard class meanwhile, so any touch of one
        before the unit's next forward waits for it first.
        """
        if self.refreshing:
            self.wait_gathered()  # an earlier refresh: never two all-gathers into one buffer
        if self.compute_copy_current:
            self.compute_copy_current = False  # copied right after the step (the NVMe optimizer tier)
        else:
            master = self.master_shard  # first: reading it back may raise, and a shard taken for writing must be stored
            shard = self._shard_for_writing(keep_values=False)
            if shard.data_ptr() != master.data_ptr():
                # From pinned host memory (offload) asynchronously, in stream order before the all-gather;
                # into host memory (offload_params) from a device master, which waits for the step.
                shard.copy_(master, non_blocking=master.is_pinned() and shard.is_cuda)
            self._shard_written()
        if self.sharded_at_rest:
            if self.state is StorageState.GATHERED:
                # A step inside a forward that still runs this unit (Lightning's manual optimization): the
                # rest of that forward sees the new values, gathered as its next forward would gather them.
                self.reshard()
                self.wait_gathered()
            return
        self._gather_handle = all_gather(self.comm, self.gathered_params, self.compute_shard, label=self.label)
        self.state = StorageState.REFRESHING
        if guard:
            self.guard.switch(True)

    # ---------------------------------------------------------- full values
    def write_param(self, slot_index: int, full_value: torch.Tensor) -> bool:
        """Take this rank's part of a new full value of a parameter into the shards (no communication, but
        for a DTensor value in another placement than its tensor-parallel parameter's).

        False (nothing written) if the value does not have the parameter's shape.
        """
        slot = self.layout.slots[slot_index]
        if not isinstance(full_value, torch.Tensor):
            return False
        full_value = local_piece_of(self.params[slot_index], full_value)  # tensor parallelism: this rank's part
        if full_value.shape != slot.shape:
            return False
        if self.refreshing:
            self.wait_gathered()  # its all-gather still reads the shard this writes
        piece = self._own_pieces.get(slot.index)
        if piece is None:
            return True  # no part of it lies in this rank's shard
        source = full_value.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel]
        master = self.master_shard  # read back before a shard is taken for writing (that must be stored)
        shard = self._shard_for_writing()  # before writing: the master may be the host shard a copy still reads
        self.compute_copy_current = False
        shard_view(master, piece).copy_(source)
        if shard.data_ptr() != master.data_ptr():
            shard_view(shard, piece).copy_(source)
        self._shard_written()
        return True

    def gather_full_master(self) -> torch.Tensor:
        """The unit's full fp32 flat parameters (padded), gathered from the master shards."""
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.comm.device)
        all_gather(self.comm, full, self.master_shard.to(full.device), label=self.label).wait()
        return full

    def load_master_shard(self, shard: torch.Tensor) -> None:
        """This rank's new fp32 master shard; the compute copies follow at the next refresh."""
        master = self.master_shard
        self._wait_host_shard_read()  # before writing: the master may be the host shard a copy still reads
        self.compute_copy_current = False
        self.forget_secondary()
        master.copy_(shard)

    def load_full_master(self, full: torch.Tensor) -> None:
        """Take this rank's slice of new full fp32 flat parameters (no communication)."""
        lo, hi = self.layout.shard_range(self.comm.shard_rank)
        master = self.master_shard  # read back before a shard is taken for writing (that must be stored)
        # Before writing: the master may be the host shard a copy still reads.
        shard = self._shard_for_writing(keep_values=False)
        self.compute_copy_current = False
        master.copy_(full[lo:hi])
        if shard.data_ptr() != master.data_ptr():
            shard.copy_(master)
        self._shard_written()
        if not self.sharded_at_rest:
            self.gathered_params.copy_(full)
