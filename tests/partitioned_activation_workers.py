"""Workers for partition_activations (the paper's P_a), run in test_tensor_parallel.py's 2 × 2 grid.

The model is split Megatron's way, without sequence parallelism, so every layer's input is whole on every
tensor-parallel rank (the paper's setting), and each layer is wrapped with torch's checkpoint_wrapper.
What a forward leaves alive is read from the C allocator (``mallinfo2``: every byte malloc hands out and has
not been given back), not from the engine; the bytes sent are counted where they are handed to
``torch.distributed`` (ours) and to torch's functional collectives (the split layers' own).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import weakref
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.tensor import DTensor

import zero_core.passes.activation_offload as activation_offload
from zero_core import WrapPolicy, ZeroConfig, ZeroEngine, tensor_parallel_mesh

from .tensor_parallel_model import VOCAB, Layer, LlamaSize, TinyLlama, loss_of, parallelize, tokens
from .workers import LayerCollectives, SentByDimension, refusal

TP = 2
# Wide enough that one layer's input (BATCH x LENGTH x 256 x 4 bytes = 1 MiB) dwarfs the allocator's rounding.
WIDE = LlamaSize(width=256, heads=4, hidden=512)
BATCH, LENGTH = 4, 256


def checkpointed(model: torch.nn.Module, reentrant: bool = False) -> torch.nn.Module:
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda module: isinstance(module, Layer),
    )
    return model


def split_model(
    size: LlamaSize = LlamaSize(), sequence_parallel: bool = False, reentrant: bool = False
) -> tuple[torch.nn.Module, Any]:
    mesh = tensor_parallel_mesh(TP)
    torch.manual_seed(0)
    model = parallelize(TinyLlama(size), mesh["tensor_parallel"], sequence_parallel=sequence_parallel)
    return checkpointed(model, reentrant), mesh


def _engine(model: torch.nn.Module, mesh: Any, **settings: Any) -> ZeroEngine:
    config = ZeroConfig(stage=3, wrap_policy=WrapPolicy(module_classes=(Layer,)), **settings)
    return ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, device_mesh=mesh)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        + ("keepcost",)
    ]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def heap_in_use() -> int:
    """Bytes malloc has handed out and not been given back: in its arena and in its own mappings."""
    gc.collect()
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class LayerInputs:
    """Weak references to what enters each checkpointed layer: alive after forward only if something keeps it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.refs: list[weakref.ref] = []
        for module in model.modules():
            if isinstance(module, CheckpointWrapper):
                module.register_forward_pre_hook(lambda _, args: self.refs.append(weakref.ref(args[0])))

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.refs)


def memory_and_traffic(rank: int, world_size: int) -> dict[str, Any]:
    """One measured step (after one to warm up) with torch's checkpoint and with P_a, alike otherwise."""
    results: dict[str, Any] = {"whole_input_bytes": BATCH * LENGTH * WIDE.width * 4, "layers": WIDE.layers}
    for partition in (False, True):
        model, mesh = split_model(WIDE)
        engine = _engine(model, mesh, partition_activations=partition)
        dp_rank = mesh["data_parallel"].get_local_rank()
        inputs, losses = LayerInputs(model), []
        for step in range(2):
            generator = torch.Generator().manual_seed(10 * step + dp_rank)
            ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
            inputs.refs.clear()
            before = heap_in_use()
            with SentByDimension() as sent, LayerCollectives() as layers:
                loss = loss_of(model(ids), ids)
                kept, alive = heap_in_use() - before, inputs.alive()
                engine.backward(loss)
            engine.step()
            engine.optimizer.zero_grad()
            losses.append(loss.item())
        results[f"partition={partition}"] = {
            "kept_after_forward": kept,
            "layer_inputs_alive": alive,
            "ours_tensor_parallel": sent.bytes.get("tensor_parallel", 0),
            "layers_own": dict(layers.bytes),
            "losses": losses,
        }
    return results


class MovesEverything(activation_offload.SavedOnHost):
    """The offload hooks taking the path a GPU takes (every saved tensor copied out and back, DTensors
    rebuilt from their local tensors) on this CPU: a copy stands in for host memory."""

    dtensors = copies = numel = 0  # counted: a test that never took the path would prove nothing

    @staticmethod
    def moves(tensor: torch.Tensor) -> bool:
        MovesEverything.dtensors += isinstance(tensor, DTensor)
        return tensor.layout == torch.strided

    @staticmethod
    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        MovesEverything.copies += 1
        MovesEverything.numel += tensor.numel()
        return tensor.detach().clone(memory_format=torch.contiguous_format)


def offloaded_losses(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """P_a (in torch's checkpoint with and without reentrance), P_a+cpu and offload_activations alone on the
    split model, with the moving path taken."""
    losses, moved = {}, {}
    original, activation_offload.SavedOnHost = activation_offload.SavedOnHost, MovesEverything
    try:
        for name, settings in {
            "plain": {},
            "offload": dict(offload_activations=True),
            "partition": dict(partition_activations=True),
            "partition+offload": dict(partition_activations=True, offload_activations=True),
            "partition reentrant": dict(partition_activations=True),
        }.items():
            MovesEverything.dtensors = MovesEverything.copies = MovesEverything.numel = 0
            model, mesh = split_model(reentrant=name.endswith("reentrant"))
            engine = _engine(model, mesh, **settings)
            dp_rank = mesh["data_parallel"].get_local_rank()
            losses[name] = []
            for step in range(3):
                ids = tokens(step, dp_rank)
                loss = loss_of(model(ids), ids)
                engine.backward(loss)
                engine.clip_grad_norm_(0.5)
                engine.step()
                engine.optimizer.zero_grad()
                losses[name].append(loss.item())
            losses[name].append(float(sum(v.float().square().sum() for v in engine.full_state_dict().values())))
            moved[name] = {"dtensors": MovesEverything.dtensors, "copies": MovesEverything.copies,
                           "numel": MovesEverything.numel}  # fmt: skip
    finally:
        activation_offload.SavedOnHost = original
    layer_input = tokens(0, 0).numel() * LlamaSize().width
    return {"losses": losses, "moved": moved, "layer_input_numel": layer_input, "layers": LlamaSize().layers}


def refusals(rank: int, world_size: int) -> dict[str, str | None]:
    """What partition_activations cannot take, refused alike on every rank."""
    model, mesh = split_model(sequence_parallel=True)  # each rank's layer input is its part of the sequence
    engine = _engine(model, mesh, partition_activations=True)
    ids = tokens(0, mesh["data_parallel"].get_local_rank())
    result = {"sequence_parallel": refusal(lambda: model(ids), ValueError)}
    del engine
    # Inputs alike at a block's first call, unlike later: refused in backward, before the slices are used.
    model, mesh = split_model()
    engine = _engine(model, mesh, partition_activations=True)
    layer = model.layers[0]
    layer(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))).sum().backward()
    differing = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    result["differs_later"] = refusal(lambda: layer(differing).sum().backward(), ValueError)
    # Each token normalised: every rank's own tokens have the same sum and norm, but not the same bits.
    normalised = torch.nn.functional.layer_norm(
        torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(rank)), (32,)
    )
    result["normalised_differ"] = refusal(lambda: model.layers[1](normalised.requires_grad_()), ValueError)
    del engine
    torch.manual_seed(0)
    plain = checkpointed(TinyLlama())
    result["no_tensor_parallelism"] = refusal(lambda: _engine(plain, None, partition_activations=True), ValueError)
    unwrapped = parallelize(TinyLlama(), mesh["tensor_parallel"], sequence_parallel=False)
    result["no_wrappers"] = refusal(lambda: _engine(unwrapped, mesh, partition_activations=True), ValueError)
    own = parallelize(TinyLlama(), mesh["tensor_parallel"], sequence_parallel=False)
    apply_activation_checkpointing(
        own,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_fn=lambda f, *a, **k: f(*a, **k)),
        check_fn=lambda module: isinstance(module, Layer),
    )
    result["own_checkpoint_fn"] = refusal(lambda: _engine(own, mesh, partition_activations=True), ValueError)
    return result
