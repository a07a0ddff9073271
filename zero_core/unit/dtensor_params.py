"""Parameters that tensor parallelism made DTensors (``parallelize_module``): what a unit does
differently for them, in one place.

A unit flattens, shards (across the data-parallel ranks only) and reduces a DTensor parameter's
*local* piece, exactly as it does a plain parameter's values; the tensor-parallel dimension is the
DTensor's own business. Three things differ:

- the local piece is reached through ``to_local()``, and pointing the parameter at a view of the
  unit's flat buffer sets its local piece (:func:`point_at`), so the parameter object users hold,
  with its hooks and attributes, stays the same;
- a gradient may come back in another placement than its parameter's (``SequenceParallel``'s norm
  weights give ``Partial`` sums): it is redistributed to the parameter's placement first, as FSDP2
  does, which sums it over the tensor-parallel group;
- a norm over the whole model counts a ``Shard`` parameter's local pieces on every tensor-parallel
  rank, but a ``Replicate`` (or plain) parameter's only once, and a checkpoint names each piece by
  where it lies in the whole parameter: :func:`place_in_whole` tells both.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .layout import PlaceInWhole


def is_dtensor(tensor: object) -> bool:
    return isinstance(tensor, DTensor)


def local_values(param: torch.Tensor) -> torch.Tensor:
    """The values this rank holds: a DTensor's local piece, a plain tensor itself (detached)."""
    with torch.no_grad():
        # DTensor's own method: a resting stage-3 parameter's guard class refuses to_local() to users.
        return DTensor.to_local(param) if isinstance(param, DTensor) else param.detach()


def local_shape(param: torch.Tensor) -> torch.Size:
    return local_values(param).shape


def place_in_whole(param: torch.Tensor) -> PlaceInWhole | None:
    """Where this rank's local piece of a DTensor parameter lies in the whole one (None for a plain
    parameter). A ``Shard(d)`` placement splits dimension d as ``torch.chunk`` does: pieces of
    ceil(size / ranks), the last ones shorter or empty."""
    if not isinstance(param, DTensor):
        return None
    whole = param.shape
    offsets = [0] * len(whole)
    spread = False
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            dim = placement.dim % len(whole)
            chunk = -(-whole[dim] // param.device_mesh.size(mesh_dim))
            offsets[dim] += min(param.device_mesh.get_local_rank(mesh_dim) * chunk, whole[dim])
            spread = True
    return PlaceInWhole(whole, tuple(offsets), spread)


def as_dtensor_like(param: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor placed as ``param`` is (no communication)."""
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def point_at(param: nn.Parameter, local: torch.Tensor) -> None:
    """Make ``param`` hold ``local`` as its values (a DTensor: as its local piece, in ``local``'s dtype).

    The parameter stays the same object with the same autograd identity, as ``param.data = ...`` keeps a
    plain one: its hooks (the engine's and the user's), attributes and optimizer references survive. For a
    DTensor ``.data`` sets the wrapper's dtype and the local piece and placement spec are set beside it, as
    FSDP2 resets its sharded DTensors' local tensors (``torch.utils.swap_tensors`` would give the parameter a
    new C++ tensor, and the hooks registered on the old one would stop firing)."""
    if not isinstance(param, DTensor):
        param.data = local
        return
    values = as_dtensor_like(param, local)
    param.data = values
    param._local_tensor, param._spec = values._local_tensor, values._spec


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param.grad``'s local piece, in the parameter's own placement."""
    grad = param.grad
    if grad is None or not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(placements=param.placements)  # SequenceParallel's Partial sums
    return grad.to_local()


def global_value(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole parameter from this rank's full ``local`` piece (a collective over the tensor-parallel
    ranks for a DTensor: every one of them calls it, in the same order)."""
    if not isinstance(param, DTensor):
        return local
    return as_dtensor_like(param, local).full_tensor()


def exported_copy(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A copy of a full local piece as ``state_dict()`` exports it: a plain parameter's in host memory; a
    DTensor parameter's as a DTensor on its mesh's device, as the unsharded tensor-parallel model's holds it."""
    if not isinstance(param, DTensor):
        return local.to("cpu", copy=True)
    return as_dtensor_like(param, local.to(param.device_mesh.device_type, copy=True))


def local_piece_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's local piece of a new value for ``param``: a DTensor value in any placement, or the
    whole value as a plain tensor (a consolidated checkpoint), sliced as ``distribute_tensor`` would."""
    if not isinstance(param, DTensor):
        return value.to_local() if isinstance(value, DTensor) else value
    if isinstance(value, DTensor):
        if tuple(value.placements) != tuple(param.placements):
            value = value.redistribute(param.device_mesh, param.placements)
        return value.to_local()
    if value.shape != param.shape:
        return value  # the caller's shape check refuses it
    place = place_in_whole(param)  # where checkpoints name the piece, so both slice alike
    return value[tuple(slice(start, start + size) for start, size in zip(place.offsets, local_shape(param)))]


def check_supported(fqn: str, param: torch.Tensor) -> None:
    """Placements a unit can shard: ``Shard`` and ``Replicate`` over a one-dimensional mesh (the
    tensor-parallel one). Anything else is refused before any work."""
    if not isinstance(param, DTensor):
        return
    placements = tuple(param.placements)
    if param.device_mesh.ndim != 1 or not all(isinstance(p, (Shard, Replicate)) for p in placements):
        raise ValueError(
            f"Parameter '{fqn}' is a DTensor over a {param.device_mesh.ndim}-dimensional mesh with placements "
            f"{placements}: ZeRO shards DTensor parameters that tensor parallelism made over the tensor-parallel "
            "mesh only (Shard or Replicate placements, as parallelize_module with ColwiseParallel, RowwiseParallel "
            "and SequenceParallel gives). Parallelise the model over device_mesh['tensor_parallel'] and hand ZeRO "
            "the whole mesh (device_mesh=...); do not shard it with fully_shard or distribute_tensor first."
        )
