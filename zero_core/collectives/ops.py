"""The collectives themselves: pure functions from tensors and a :class:`CommContext` to a
:class:`Handle`. Each counts its bytes and picks the primitive for the backend."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .context import CollectiveFailed, CommContext
from .handle import Handle, _handle, _on_side_stream
from .stats import CollectiveKind, Span

# torch 2.13 renamed the tensor collectives; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(
    comm: CommContext,
    gathered_out: torch.Tensor,
    shard_in: torch.Tensor,
    label: str = "parameters",
    span: Span = Span.SHARD_GROUP,
) -> Handle:
    """Fill ``gathered_out`` (group size * shard numel) with every rank's shard, in group rank order."""
    comm.stats.record(CollectiveKind.ALL_GATHER, gathered_out, span)
    group, size = comm.span(span)
    with record_function("zero::all_gather"):
        in_place = gathered_out.data_ptr() == shard_in.data_ptr()
        if gathered_out.numel() == 0 or (size == 1 and in_place):
            return Handle()
        if comm.all_gather_stream is not None:
            # World size 1 too: NCCL runs one-rank collectives, so one GPU exercises this path.
            return _on_side_stream(
                comm,
                comm.all_gather_stream,
                (gathered_out, shard_in),
                lambda: _all_gather_single(gathered_out, shard_in, group=group, async_op=False),
                CollectiveKind.ALL_GATHER,
                label,
            )
        if size == 1:
            gathered_out.copy_(shard_in)
            return Handle()
        if comm.uses_rooted_collectives:
            slices = gathered_out.chunk(size)
            own = slices[comm.rank_in(span)]
            if own.data_ptr() != shard_in.data_ptr():
                own.copy_(shard_in)
            # Each rank broadcasts its slice, in place in every rank's flat output.
            works = [
                dist.broadcast(piece, group_src=src, group=group, async_op=True) for src, piece in enumerate(slices)
            ]
            return _handle(comm, works, CollectiveKind.ALL_GATHER, label)
        work = _all_gather_single(gathered_out, shard_in, group=group, async_op=True)
        return _handle(comm, work, CollectiveKind.ALL_GATHER, label)


def reduce_scatter(
    comm: CommContext,
    shard_out: torch.Tensor,
    full_in: torch.Tensor,
    label: str = "gradients",
    polled: bool = False,
) -> Handle:
    """Sum ``full_in`` over the shard group and leave this rank's slice in ``shard_out``.

    ``shard_out`` may be this rank's slice of ``full_in`` itself. The rest of
    ``full_in`` is undefined afterwards (gloo reduces in it). ``polled``: the
    caller asks the handle's ``is_completed()`` before waiting for it, which
    gloo's point-to-point works answer only once waited for, so the exchange
    form is not taken.
    """
    comm.stats.record(CollectiveKind.REDUCE_SCATTER, full_in, Span.SHARD_GROUP)
    with record_function("zero::reduce_scatter"):
        if full_in.numel() == 0:
            return Handle()
        size = comm.shard_size
        own = full_in.chunk(size)[comm.shard_rank]
        in_place = own.data_ptr() == shard_out.data_ptr()
        if size == 1 and in_place:
            return Handle()
        if comm.reduce_scatter_stream is not None:
            # World size 1 too: NCCL runs one-rank collectives, so one GPU exercises this path.
            return _on_side_stream(
                comm,
                comm.reduce_scatter_stream,
                (shard_out, full_in),
                lambda: _reduce_scatter_single(shard_out, full_in, group=comm.shard_group, async_op=False),
                CollectiveKind.REDUCE_SCATTER,
                label,
            )
        if size == 1:
            shard_out.copy_(full_in)
            return Handle()
        if comm.uses_rooted_collectives:
            # Gloo's point-to-point calls take host memory only (its reduces stage CUDA tensors through the host).
            if comm.device.type == "cpu" and size == 2 and not in_place and not polled:
                return _reduce_scatter_by_exchange(comm, shard_out, full_in, own, label)
            # Each slice is summed onto the rank that owns it, in place. The slices
            # this rank does not own are left holding partial sums: ``full_in`` is
            # scratch once handed over.
            works = [
                dist.reduce(piece, group_dst=dst, group=comm.shard_group, async_op=True)
                for dst, piece in enumerate(full_in.chunk(size))
            ]
            copy_out = None if in_place else (lambda: shard_out.copy_(own))
            return _handle(comm, works, CollectiveKind.REDUCE_SCATTER, label, after_wait=copy_out)
        work = _reduce_scatter_single(shard_out, full_in, group=comm.shard_group, async_op=True)
        return _handle(comm, work, CollectiveKind.REDUCE_SCATTER, label)


def _reduce_scatter_by_exchange(
    comm: CommContext, shard_out: torch.Tensor, full_in: torch.Tensor, own: torch.Tensor, label: str
) -> Handle:
    """Gloo on the CPU, a shard group of two ranks, ``shard_out`` a tensor of its own: each rank sends its
    peer the peer's slice and receives its own slice's other term into ``shard_out``, both at once, then
    adds its own term once the exchange has landed. (CUDA tensors keep the reduces: gloo's point-to-point
    calls read and write host memory only.)

    Gloo runs the two rooted reduces one after the other, so each direction of the link is idle half the
    time; the exchange uses both at once, in about half the wall and CPU time (benchmarks/NOTES.md,
    "Reduce-scatter by exchange"). It sends the same bytes, and the sum is the same
    bit for bit: a sum of two terms does not depend on their order. With more ranks each peer's term would
    need a slice of scratch memory, and with ``shard_out`` inside ``full_in`` (stage 1) one more, so those
    keep the rooted reduces."""
    peer = 1 - comm.shard_rank
    sent, group = full_in.chunk(2)[peer], comm.shard_group
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, sent, group=group, group_peer=peer),
            dist.P2POp(dist.irecv, shard_out, group=group, group_peer=peer),
        ]
    )
    return _handle(comm, works, CollectiveKind.REDUCE_SCATTER, label, after_wait=lambda: shard_out.add_(own))


def all_reduce(
    comm: CommContext,
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    label: str = "step flags",
    span: Span = Span.WORLD,
) -> Handle:
    comm.stats.record(CollectiveKind.ALL_REDUCE, tensor, span)
    group, size = comm.span(span)
    with record_function("zero::all_reduce"):
        if size == 1:
            return Handle()
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        return _handle(comm, work, CollectiveKind.ALL_REDUCE, label)


def broadcast(
    comm: CommContext, tensor: torch.Tensor, src_rank: int = 0, label: str = "buffers", span: Span = Span.WORLD
) -> Handle:
    """Broadcast to every rank of ``span`` from ``src_rank`` of it (a group rank, not a global one)."""
    comm.stats.record(CollectiveKind.BROADCAST, tensor, span)
    group, size = comm.span(span)
    with record_function("zero::broadcast"):
        if size == 1:
            return Handle()
        work = dist.broadcast(tensor, group_src=src_rank, group=group, async_op=True)
        return _handle(comm, work, CollectiveKind.BROADCAST, label)


def exchange(
    comm: CommContext,
    sends: list[tuple[torch.Tensor, int]],
    receives: list[tuple[torch.Tensor, int]],
    label: str,
) -> Handle:
    """Point to point inside the shard group: each ``(tensor, shard rank)`` of ``sends`` to that rank, each of
    ``receives`` filled from it. Peers post their halves in the same order (torch matches them in order).
    Counted as what this rank sends. A tensor off the wire's device (an offloaded piece under NCCL) travels
    through a copy on it."""
    for tensor, _ in sends:
        comm.stats.record(CollectiveKind.SEND, tensor, Span.SHARD_GROUP)
    with record_function("zero::exchange"):
        if not sends and not receives:
            return Handle()

        def on_wire(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if tensor.device == comm.device else tensor.to(comm.device)

        staged = [(t, on_wire(t)) for t, _ in receives]
        group = comm.shard_group
        ops = [dist.P2POp(dist.isend, on_wire(t), group=group, group_peer=r) for t, r in sends]
        ops += [dist.P2POp(dist.irecv, wire, group=group, group_peer=r) for (_, wire), (_, r) in zip(staged, receives)]
        works = dist.batch_isend_irecv(ops)
        copies = [(t, wire) for t, wire in staged if wire is not t]

        def copy_back() -> None:
            for target, wire in copies:
                target.copy_(wire)

        return _handle(comm, works, CollectiveKind.SEND, label, after_wait=copy_back if copies else None)


def all_gather_objects(comm: CommContext, obj: object, label: str) -> list:
    """Every rank's small picklable ``obj``, in rank order: for agreements, not data.

    Not counted in ``comm.stats``: those count the model-state traffic the
    ZeRO formulas describe. A peer that never answers ends this after the
    process group's timeout with :class:`CollectiveFailed` naming ``label``.
    """
    if comm.world_size == 1:
        return [obj]
    gathered: list = [None] * comm.world_size
    # NCCL moves the pickled bytes through the current CUDA device: make it ours.
    device = torch.cuda.device(comm.device) if comm.device.type == "cuda" else contextlib.nullcontext()
    with record_function("zero::all_gather_object"), device:
        try:
            dist.all_gather_object(gathered, obj, group=comm.group)
        except (RuntimeError, ValueError) as error:  # gloo: timeout, closed connection
            raise CollectiveFailed(f"ZeRO: {label} did not complete on every rank ({error}).") from error
    return gathered
