"""ZeRO on a device mesh: sharding over its data-parallel dimension, with tensor parallelism on the other.

A 2-D mesh names its dimensions as Lightning's ``ModelParallelStrategy`` does: ``"data_parallel"`` and
``"tensor_parallel"``. The model is parallelised over ``mesh["tensor_parallel"]`` first
(``parallelize_module``), so its split layers hold DTensor parameters; the engine then shards each
unit's local pieces across ``mesh["data_parallel"]`` only (unit/dtensor_params.py). A 1-D mesh is
plain data parallelism over its ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from .collectives import CommContext
from .unit.dtensor_params import check_supported

DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"

# The plain engine's refusal and Fabric's say the same (one mistake, one fix), each route's fix named.
OPTIMIZER_BEFORE_SPLIT = (
    "The optimizer was made before the model was split over the tensor-parallel mesh: splitting "
    "(torch's parallelize_module) replaces the model's parameters, so that optimizer holds the old, unsplit "
    "ones. Split the model first, then make the optimizer over its parameters: "
    f"`model = parallelize_module(model, mesh['{TENSOR_PARALLEL}'], plan)`, then "
    "`optimizer = torch.optim.AdamW(model.parameters())` and `ZeroEngine(model, optimizer, device_mesh=mesh)`; "
    "with Fabric, `model = fabric.setup_module(model)` (it calls parallelize_fn), then make the optimizer "
    "over model.parameters() and `fabric.setup_optimizers(optimizer)`."
)


def tensor_parallel_mesh(tensor_parallel_size: int, device_type: str | None = None) -> DeviceMesh:
    """The 2-D mesh (data_parallel × tensor_parallel) over every rank, from the tensor-parallel size:
    consecutive ranks (one node's devices, as torchrun numbers them) split each layer together. Every
    rank calls it after ``init_process_group``."""
    world_size = dist.get_world_size()
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must be a positive divisor of the number of "
            f"processes ({world_size}): use the number of devices per node, or fewer."
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(
        device_type,
        (world_size // tensor_parallel_size, tensor_parallel_size),
        mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL),
    )


def engine_comm(
    model: nn.Module,
    tensor_parallel_size: int,
    process_group: dist.ProcessGroup | None,
    device_mesh: DeviceMesh | None,
    device: torch.device,
) -> CommContext:
    """Where an engine's collectives run: the process group, or the mesh (data-parallel × tensor-parallel)."""
    if device_mesh is not None:
        check_mesh(device_mesh)
    check_tensor_parallel_size(device_mesh, tensor_parallel_size)
    check_model_on_mesh(model, device_mesh)
    if device_mesh is None:
        return CommContext.create(process_group, device)
    if process_group is not None:
        raise ValueError("Give the engine process_group= or device_mesh=, not both.")
    return comm_for_mesh(device_mesh, device)


def check_mesh(mesh: DeviceMesh) -> None:
    names = mesh.mesh_dim_names or ()
    if mesh.ndim != 1 and (mesh.ndim != 2 or set(names) != {DATA_PARALLEL, TENSOR_PARALLEL}):
        raise ValueError(
            f"device_mesh has {mesh.ndim} dimensions named {names}: ZeRO takes a 1-D mesh (data parallelism) or "
            f"a 2-D mesh named ('{DATA_PARALLEL}', '{TENSOR_PARALLEL}'), as Lightning's ModelParallelStrategy "
            "builds it and zero_core.tensor_parallel_mesh(tensor_parallel_size) makes."
        )
    if mesh.ndim == 2 and mesh.size() != dist.get_world_size():
        # The setup and checkpoints of a 2-D mesh are agreed by every rank of the world (spanning_every_rank).
        raise ValueError(
            f"device_mesh spans {mesh.size()} of the {dist.get_world_size()} processes: a 2-D mesh must span "
            "every process (zero_core.tensor_parallel_mesh(tensor_parallel_size) makes one)."
        )


def check_tensor_parallel_size(mesh: DeviceMesh | None, size: int) -> None:
    """``tensor_parallel_size`` (1, the default: as the mesh says) must be the mesh's: the model was split
    before the engine saw it, so the engine cannot split it itself."""
    mesh_size = mesh[TENSOR_PARALLEL].size() if mesh is not None and mesh.ndim == 2 else 1
    if size > 1 and size != mesh_size:
        raise ValueError(
            f"ZeroConfig.tensor_parallel_size={size}, but the engine was given "
            + (f"a mesh whose '{TENSOR_PARALLEL}' dimension has {mesh_size} ranks" if mesh_size > 1 else "no 2-D mesh")
            + f": build the mesh with zero_core.tensor_parallel_mesh({size}), parallelise the model over its "
            f"'{TENSOR_PARALLEL}' dimension, and pass device_mesh=mesh."
        )


def comm_for_mesh(mesh: DeviceMesh, device: torch.device) -> CommContext:
    """Collectives over the mesh's data-parallel ranks; norms and agreements also span the tensor-parallel ones."""
    if mesh.ndim == 1:
        return CommContext.create(mesh.get_group(), device)
    tp = mesh[TENSOR_PARALLEL]
    # Hybrid sharding splits every data-parallel group alike (each is one column of the mesh).
    ranks = mesh.mesh if mesh.mesh_dim_names[0] == DATA_PARALLEL else mesh.mesh.T
    return dataclasses.replace(
        CommContext.create(mesh[DATA_PARALLEL].get_group(), device),
        tensor_parallel_group=tp.get_group(),
        tensor_parallel_rank=tp.get_local_rank(),
        tensor_parallel_size=tp.size(),
        data_parallel_groups=tuple(tuple(column.tolist()) for column in ranks.T),
    )


def spanning_every_rank(comm: CommContext) -> CommContext:
    """Where the setup is agreed and checkpoints are agreed and written: on a 2-D mesh every rank of the
    world (the tensor-parallel ranks must build the same model too, and their pieces of the layers all go
    into one checkpoint); the units keep their data-parallel context."""
    if comm.tensor_parallel_size == 1:
        return comm
    return CommContext.create(None, comm.device, comm.progress)


def check_model_on_mesh(model: nn.Module, mesh: DeviceMesh | None) -> None:
    """A model with DTensor parameters needs the mesh they live on, and what this mesh supports; refused
    before any collective, alike on every rank (every rank built the same model)."""
    dtensors = [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]
    tensor_parallel = mesh is not None and mesh.ndim == 2
    if dtensors and not tensor_parallel:
        raise ValueError(
            f"Parameter '{dtensors[0][0]}' is a DTensor (tensor parallelism), but the engine was given no 2-D "
            f"device mesh: build it with device_mesh=mesh, the mesh whose '{TENSOR_PARALLEL}' dimension the model "
            f"was parallelised over (zero_core.tensor_parallel_mesh(size) makes one; Lightning's ZeroStrategy("
            "tensor_parallel_size=...) hands it to configure_model as self.device_mesh)."
        )
    if not tensor_parallel:
        return
    if not dtensors and mesh[TENSOR_PARALLEL].size() > 1:
        # Each tensor-parallel rank would hold and compute the whole model on the same batches.
        raise ValueError(
            f"The engine was given a mesh whose '{TENSOR_PARALLEL}' dimension has {mesh[TENSOR_PARALLEL].size()} "
            "ranks, but no parameter of the model is split over it: split the model first (torch's "
            f"parallelize_module over device_mesh['{TENSOR_PARALLEL}']), or use tensor_parallel_size=1."
        )
    for name, param in dtensors:
        check_supported(name, param)
        if param.device_mesh != mesh[TENSOR_PARALLEL]:
            raise ValueError(
                f"Parameter '{name}' is a DTensor over {param.device_mesh}, not over the engine's "
                f"device_mesh['{TENSOR_PARALLEL}'] ({mesh[TENSOR_PARALLEL]}): parallelise the model over that "
                "dimension of the mesh you give the engine."
            )
    if any(p.is_meta for _, p in model.named_parameters()):
        raise ValueError(
            "A model on the meta device with tensor parallelism is not supported yet: materialise it "
            "(to_empty and initialise) before parallelize_module and the engine."
        )


def made_before_split(model_params: Iterable[torch.Tensor], foreign: Iterable[torch.Tensor]) -> bool:
    """Whether tensors an optimizer holds but the engine did not shard are a split model's parameters as
    they were before the split: plain tensors with a split (DTensor) parameter's whole shape."""
    split_shapes = {tuple(p.shape) for p in model_params if isinstance(p, DTensor)}  # a DTensor's is whole
    return any(not isinstance(t, DTensor) and tuple(t.shape) in split_shapes for t in foreign)
