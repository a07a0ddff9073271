"""What autograd keeps for backward, measured without the memory: the model's forward and backward run on
fake tensors of the target device, and every tensor saved for backward is counted once.

Why fake tensors (torch's ``FakeTensorMode``, the mode torch.compile traces with): each op runs its own
shape rule for the device named, so the kernels chosen are the device's (on a CPU, the fused attention that
keeps one row of statistics, where the meta device's reference path keeps the whole attention matrix), and
no byte is allocated: a model larger than the machine is measured on it. The copy the run uses has fake
parameters in the compute dtype (what the engine computes with); the model itself is not touched.

What is counted (per rank, for one micro-batch): the storages of the tensors autograd saves during the
forward (each once, however many views of it are saved), parameters and buffers aside (they are model state,
in the estimate). They are split by where they were saved: in one of the blocks activation checkpointing
would wrap (the units below the root, outermost), or outside them; and each block's inputs are counted too,
which is what a checkpointed block keeps instead of its saved tensors. So, for ``m`` samples::

    kept(m)              = outside + sum(in each block)                 (no checkpointing)
    kept(m), checkpointed = outside + sum(block inputs) + max(in a block)  (one block recomputed at a time)
    peak(m)              = kept(m) + 2 x the largest saved tensor       (a gradient of it and of its input)

each term measured at 2 and 3 samples and taken as linear in ``m`` (what does not grow with the batch, a
position table for example, is the part at 0).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (  # torch's own shape-only execution; no public name
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.multiprocessing.reductions import StorageWeakRef

from ..unit.unit_selection import plan_units
from ..wrap_policy import WrapPolicy

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class SavedBytes:
    """One micro-batch's count: what autograd saved, by where it was saved."""

    outside_blocks: int
    in_blocks: tuple[int, ...]  # per block, in the order the blocks ran
    block_inputs: tuple[int, ...]  # what each block was given (not already counted as saved outside)
    largest_saved: int  # the largest storage saved

    def kept(self, checkpointed: bool) -> int:
        if not checkpointed:
            return self.outside_blocks + sum(self.in_blocks)
        return self.outside_blocks + sum(self.block_inputs) + max(self.in_blocks, default=0)

    def peak(self, checkpointed: bool) -> int:
        return self.kept(checkpointed) + 2 * self.largest_saved


# The micro-batch sizes measured. Not 1: at one sample some ops save a view where at more they save a copy,
# so the line through 1 and 2 misses larger batches by a little; through 2 and 3 it holds from 2 on, and at 1
# it errs high.
MEASURED_SIZES = (2, 3)


@dataclass(frozen=True)
class ActivationProfile:
    """What a rank's forward keeps for backward, as a line in the micro-batch size (measured at MEASURED_SIZES)."""

    smaller: SavedBytes  # at MEASURED_SIZES[0] samples
    larger: SavedBytes  # at MEASURED_SIZES[1]
    checkpointed_blocks: tuple[str, ...]  # the module paths activation checkpointing wraps

    def peak_bytes(self, micro_batch_size: int, checkpointed: bool) -> int:
        """The most bytes of activations alive at once in a step of ``micro_batch_size`` samples."""
        return self._line(micro_batch_size, lambda saved: saved.peak(checkpointed))

    def kept_bytes(self, micro_batch_size: int, checkpointed: bool) -> int:
        """What the forward keeps for backward at ``micro_batch_size`` samples (the peak less the working term)."""
        return self._line(micro_batch_size, lambda saved: saved.kept(checkpointed))

    def _line(self, micro_batch_size: int, value: Callable[[SavedBytes], int]) -> int:
        (low, high), first = MEASURED_SIZES, value(self.smaller)
        per_sample = (value(self.larger) - first) // (high - low)
        return max(0, first + per_sample * (micro_batch_size - low))


def measure_activations(
    model: nn.Module,
    sample: Any,
    *,
    wrap_policy: WrapPolicy,
    bucket_numel: int,
    compute_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    loss_fn: LossFn | None = None,
) -> ActivationProfile:
    """Run ``model`` (anywhere, the meta device included; left untouched) on fake tensors of ``device`` at
    MEASURED_SIZES samples of ``sample`` (a tensor, a tuple or list of them, or a mapping of names to them, each with
    the batch in its first dimension), forward and backward, and count what autograd saves. ``loss_fn(model,
    batch)`` gives the loss; by default the model's output's ``.loss``, or the sum of its output."""
    device = torch.device(device)
    mode = FakeTensorMode()
    fake = _fake_copy(model, mode, compute_dtype, device)
    units = plan_units(fake, wrap_policy, bucket_numel)
    blocks = [(plan.name, plan.module) for plan in units if plan.parent == 0]
    counts = []
    for samples in MEASURED_SIZES:
        with mode:
            batch = _resized(sample, samples, compute_dtype, device)
        counts.append(_count_saved(fake, batch, blocks, mode, loss_fn or default_loss))
    return ActivationProfile(counts[0], counts[1], tuple(name for name, _ in blocks))


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A mapping is passed as keywords (a Hugging Face batch), a tuple or list as arguments; the output's
    ``loss`` if it has one (labels in the batch), else the sum of its first tensor (a mapping's first value,
    a tuple's first item)."""
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(tensors_in(output), None)
    if first is None:
        raise ValueError(
            f"fit: the model returned {type(output).__name__}, with no tensor to take a loss of; pass loss_fn="
        )
    return first.float().sum()


def _fake_copy(model: nn.Module, mode: FakeTensorMode, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model with every parameter and buffer a fake tensor of ``device`` (floating parameters in the
    compute dtype), copied through deepcopy's memo so that no real tensor of it is copied."""
    memo: dict[int, Any] = {}
    with mode:
        for param in model.parameters():
            dtype = compute_dtype if param.is_floating_point() else param.dtype
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            memo[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
        for buffer in model.buffers():
            memo[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return copy.deepcopy(model, memo)


def _resized(sample: Any, samples: int, compute_dtype: torch.dtype, device: torch.device) -> Any:
    """``sample`` with ``samples`` rows in every tensor's first dimension (values are not read: fake)."""
    if isinstance(sample, torch.Tensor):
        if sample.dim() == 0:
            raise ValueError("fit: a 0-d tensor in the sample batch has no batch dimension; give each input its batch")
        dtype = compute_dtype if sample.is_floating_point() else sample.dtype
        return torch.zeros((samples, *sample.shape[1:]), dtype=dtype, device=device)
    if isinstance(sample, Mapping):
        return {key: _resized(value, samples, compute_dtype, device) for key, value in sample.items()}
    if isinstance(sample, (tuple, list)):
        return type(sample)(_resized(value, samples, compute_dtype, device) for value in sample)
    return sample  # a flag or a number: passed as it is


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)


class _SavedCounter:
    """The pack hook's side: each saved storage once, under the block running when it was saved."""

    def __init__(self, model: nn.Module, blocks: int):
        self.state = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
        self.saved: dict[StorageWeakRef, tuple[int | None, int]] = {}  # storage -> (block or None, bytes)
        self.inputs: list[dict[StorageWeakRef, int]] = [{} for _ in range(blocks)]
        self.running: int | None = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(tensor.untyped_storage())
        if key not in self.state and key not in self.saved:
            self.saved[key] = (self.running, tensor.untyped_storage().nbytes())
        return tensor

    def enter(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.running = index
        for tensor in tensors_in((args, kwargs)):
            key = StorageWeakRef(tensor.untyped_storage())
            if key not in self.state:
                self.inputs[index][key] = tensor.untyped_storage().nbytes()

    def result(self, blocks: int) -> SavedBytes:
        outside = {key for key, (block, _) in self.saved.items() if block is None}
        in_blocks = [0] * blocks
        for block, nbytes in self.saved.values():
            if block is not None:
                in_blocks[block] += nbytes
        counted: set[StorageWeakRef] = set(outside)
        inputs = []
        for given in self.inputs:  # a tensor given to two blocks (a mask) is kept once
            inputs.append(sum(nbytes for key, nbytes in given.items() if key not in counted))
            counted.update(given)
        return SavedBytes(
            sum(self.saved[key][1] for key in outside),
            tuple(in_blocks),
            tuple(inputs),
            max((nbytes for _, nbytes in self.saved.values()), default=0),
        )


def _count_saved(
    model: nn.Module, batch: Any, blocks: list[tuple[str, nn.Module]], mode: FakeTensorMode, loss_fn: LossFn
) -> SavedBytes:
    counter = _SavedCounter(model, len(blocks))
    handles = []
    for index, (_, block) in enumerate(blocks):
        enter = lambda module, args, kwargs, index=index: counter.enter(index, args, kwargs)  # noqa: E731
        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.register_forward_hook(lambda *_: setattr(counter, "running", None)))
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise ValueError(
                    "fit: the loss must be one element that requires grad (the model's trainable parameters "
                    f"in its graph); got {type(loss).__name__}"
                    + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                )
            loss.backward()  # runs every saved tensor's unpacking: a model whose backward fails fails here
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as error:
        raise ValueError(
            f"fit: the model's forward and backward could not run on fake tensors ({type(error).__name__}: "
            f"{error}). A forward that reads values (.item(), data-dependent shapes) cannot be measured this "
            "way: pass activation_bytes= (the peak you measured for one sample) instead."
        ) from error
    except Exception as error:
        error.add_note("fit: raised by the model's forward or backward on fake tensors, counting its activations")
        raise
    finally:
        for handle in handles:
            handle.remove()
    return counter.result(len(blocks))
