"""``partition_activations``: the paper's P_a. What an activation-checkpointed block keeps for backward (its
inputs) is split across the tensor-parallel ranks, each keeping 1/TP, and all-gathered in backward just before
the block is recomputed (ZeRO-R, section 6.1). With ``offload_activations`` the slices wait in pinned host
memory (P_a+cpu; on a CPU device nothing moves).

Without it every tensor-parallel rank keeps the same whole input of every checkpointed block: the rank's
split layers need the whole (replicated) input, so torch's checkpoint saves it on each.

The blocks are the ones the user wrapped with torch's ``checkpoint_wrapper`` (``apply_activation_checkpointing``).
The engine runs each wrapper's own checkpoint (torch's, reentrant or not, with the options it was made with)
under saved-tensor hooks of its own. Torch's checkpoint saves the block's positional tensor inputs as saved
tensors (``save_for_backward``, or ``_make_saved_tensor`` without reentrance) before it runs the block under its
own hooks, so ours see exactly those inputs, and split them; keyword arguments are kept whole. A checkpoint
that kept its inputs elsewhere (another torch) would leave them whole, and is refused at its first call. The
wrapper gets its own function back when the engine lets go.

The inputs must be copies alike on every tensor-parallel rank, or one slice of each rank's would rebuild a
tensor no rank had: with sequence parallelism each rank holds its own part of the sequence, already split.
Every split input's bits are checksummed and compared across the tensor-parallel group: in forward the first time a
block runs (so a model whose inputs differ is refused before its first backward), later in backward before
the slices are put together. Both raise the same error on every rank of the group.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..collectives import CommContext, Handle, Span, all_gather, all_reduce
from . import activation_offload


def checkpoint_wrappers(model: nn.Module) -> list[tuple[str, CheckpointWrapper]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)]


def check_partition_activations(model: nn.Module, enabled: bool, tensor_parallel_size: int) -> None:
    """Refused before any collective, alike on every rank: P_a needs tensor parallelism and checkpointed
    blocks whose checkpoint it can take over."""
    if not enabled:
        return
    if tensor_parallel_size == 1:
        raise ValueError(
            "partition_activations splits activation checkpoints across the tensor-parallel ranks, and this "
            "engine has none: use it with tensor_parallel_size > 1 (a 2-D device_mesh), or leave it off."
        )
    wrappers = checkpoint_wrappers(model)
    if not wrappers:
        raise ValueError(
            "partition_activations splits the inputs of activation-checkpointed blocks, and the model has none: "
            "wrap its blocks with torch's checkpoint_wrapper (torch.distributed.algorithms._checkpoint."
            "checkpoint_wrapper.apply_activation_checkpointing) before the engine."
        )
    for name, wrapper in wrappers:
        _check_runs_torch_checkpoint(name, wrapper)


def _check_runs_torch_checkpoint(name: str, wrapper: CheckpointWrapper) -> None:
    """The wrapper must run torch's checkpoint: another function may keep its inputs where no hook sees them."""
    function = wrapper.checkpoint_fn
    if not isinstance(function, functools.partial) or function.func is not torch_checkpoint or function.args:
        raise ValueError(
            f"partition_activations: the checkpoint_wrapper at '{name}' runs its own checkpoint_fn "
            f"({function!r}); the engine can only split what torch.utils.checkpoint keeps. Wrap the block with "
            "checkpoint_wrapper's default checkpoint_fn, or leave partition_activations off."
        )


class _Restore:
    """Gives a wrapper its own checkpoint function back (the engine's hooks are removed alike)."""

    def __init__(self, wrapper: CheckpointWrapper, original: Callable) -> None:
        self.wrapper, self.original = wrapper, original

    def remove(self) -> None:
        self.wrapper.checkpoint_fn = self.original


class PartitionedActivations:
    def __init__(self, model: nn.Module, comm: CommContext, offload: bool) -> None:
        self.model, self.comm = model, comm
        self.offload = offload
        self._checked: set[str] = set()  # blocks whose inputs were compared in forward once

    def install(self) -> list[_Restore]:
        restores = []
        for name, wrapper in checkpoint_wrappers(self.model):  # each checked by check_partition_activations
            restores.append(_Restore(wrapper, wrapper.checkpoint_fn))
            wrapper.checkpoint_fn = _PartitionedCheckpoint(self, name, wrapper.checkpoint_fn)
        return restores

    def split(self, tensor: torch.Tensor, block: str) -> "_Slice":
        """This rank's 1/TP of ``tensor`` (padded to equal slices), and the agreement check started."""
        size, rank = self.comm.tensor_parallel_size, self.comm.tensor_parallel_rank
        flat = tensor.detach().reshape(-1)
        per_rank = math.ceil(flat.numel() / size)
        own = flat[rank * per_rank : (rank + 1) * per_rank]
        piece = torch.zeros(per_rank, dtype=tensor.dtype, device=tensor.device)
        piece[: own.numel()].copy_(own)  # a copy: a view would keep the whole input alive
        if self.offload and activation_offload.SavedOnHost.moves(piece):  # P_a+cpu
            piece = activation_offload.SavedOnHost.to_host(piece)
        check = _AgreementCheck(self.comm, flat, block)
        if block not in self._checked:
            self._checked.add(block)
            check.verify()
        return _Slice(self, piece, tensor.shape, tensor.device, check)


class _AgreementCheck:
    """An exact checksum of a tensor's bits (their sum, and the sum of every third: copies computed alike are
    bit-identical), its maximum and minimum over the tensor-parallel group (one all-reduce). No tolerance: a
    sum and norm within one would let differing inputs through (per-token normalised halves of a sequence
    have the same sum and norm)."""

    _BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}

    def __init__(self, comm: CommContext, flat: torch.Tensor, block: str) -> None:
        bits = flat.contiguous().view(self._BITS[flat.element_size()])
        sums = torch.stack([bits.sum(dtype=torch.int64), bits[::3].sum(dtype=torch.int64)])
        self.extremes = torch.cat([sums, -sums])
        self.block = block
        self.handle: Handle | None = all_reduce(
            comm, self.extremes, dist.ReduceOp.MAX, label="activation agreement", span=Span.TENSOR_PARALLEL
        )

    def verify(self) -> None:
        if self.handle is None:
            return
        self.handle.wait()
        self.handle = None
        if not torch.equal(self.extremes[:2], -self.extremes[2:]):
            raise ValueError(
                f"partition_activations: an input of the checkpointed block '{self.block}' differs across the "
                "tensor-parallel ranks, so no rank can rebuild it from their slices (with sequence parallelism "
                "each rank already holds only its part of the sequence). Leave partition_activations off for this "
                "model, or checkpoint only blocks whose inputs are replicated."
            )


class _Slice:
    """What autograd keeps of one input: this rank's slice, gathered back whole when backward unpacks it."""

    def __init__(
        self,
        owner: PartitionedActivations,
        piece: torch.Tensor,
        shape: torch.Size,
        device: torch.device,
        check: _AgreementCheck,
    ) -> None:
        self.owner, self.piece, self.shape, self.device, self.check = owner, piece, shape, device, check

    def whole(self) -> torch.Tensor:
        self.check.verify()
        comm = self.owner.comm
        piece = self.piece.to(self.device, non_blocking=True)
        gathered = torch.empty(piece.numel() * comm.tensor_parallel_size, dtype=piece.dtype, device=self.device)
        all_gather(comm, gathered, piece, label="activations", span=Span.TENSOR_PARALLEL).wait()
        return gathered[: self.shape.numel()].view(self.shape)


def _splits(tensor: torch.Tensor, size: int) -> bool:
    """Split: the block's floating-point activations; parameters, DTensors (their placements already say how
    they are split), integer inputs and the few-element ones are kept whole."""
    return (
        tensor.is_floating_point()
        and tensor.numel() >= size
        and not isinstance(tensor, (nn.Parameter, DTensor))
        and tensor.layout == torch.strided
    )


class _PartitionedSaves(saved_tensors_hooks):
    def __init__(self, owner: PartitionedActivations, block: str) -> None:
        size = owner.comm.tensor_parallel_size
        self.splits = 0

        def pack(tensor: torch.Tensor) -> Any:
            if not _splits(tensor, size):
                return tensor
            self.splits += 1
            return owner.split(tensor, block)

        def unpack(saved: Any) -> torch.Tensor:
            return saved.whole() if isinstance(saved, _Slice) else saved

        super().__init__(pack, unpack)


class _PartitionedCheckpoint:
    """A checkpoint wrapper's ``checkpoint_fn``: its own torch checkpoint, with the inputs it saves split."""

    def __init__(self, owner: PartitionedActivations, block: str, checkpoint: Callable) -> None:
        self.owner, self.block, self.checkpoint = owner, block, checkpoint

    def __call__(self, function: Callable, /, *args: Any, **kwargs: Any) -> Any:
        saves = _PartitionedSaves(self.owner, self.block)
        with saves:
            output = self.checkpoint(function, *args, **kwargs)
        size = self.owner.comm.tensor_parallel_size
        expected = sum(isinstance(arg, torch.Tensor) and _splits(arg, size) for arg in args)
        # A reentrant checkpoint saves nothing when no input requires grad (torch warns); none to split then.
        saved_by_torch = any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args) or not _reentrant(
            self.checkpoint
        )
        if torch.is_grad_enabled() and saved_by_torch and saves.splits < expected:
            raise RuntimeError(
                f"partition_activations: torch's checkpoint kept the inputs of '{self.block}' where the engine "
                f"cannot split them ({saves.splits} of {expected} seen; torch {torch.__version__}). Use the torch "
                "release this package pins, or leave partition_activations off."
            )
        return output

    def __repr__(self) -> str:
        return f"PartitionedCheckpoint('{self.block}', {self.checkpoint!r})"


def _reentrant(checkpoint: Callable) -> bool:
    return bool(getattr(checkpoint, "keywords", {}).get("use_reentrant", False))
