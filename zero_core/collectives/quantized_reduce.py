"""ZeRO++'s quantized gradients (qgZ): reductions whose pieces travel as int4 (or int8) blocks.

A reduce-scatter becomes an all-to-all: each rank quantizes the piece every other rank owns
(``quantization.py``), sends it straight there, and each rank dequantizes what it received and sums it in
fp32, in rank order. With secondary groups (hpZ's node, one shard group) it runs in two hops, as the
paper's hierarchical all-to-all: first inside the secondary group, each rank summing what its group holds
for the ranks at its place in every group, then across the groups, between the ranks at one place. The
link between nodes carries 1/k of the gradient, quantized, instead of all of it.

Under hybrid sharding the shard group's reduce-scatter is one hop (the shard group is the node), and the
across-groups all-reduce is a quantized all-to-all of its pieces, summed in fp32, then a quantized
all-gather of the sums that every replica dequantizes alike, its own piece too: replicas keep equal shards.

On the CPU a one-hop reduce-scatter (no secondary groups) is asynchronous as the exact one is: the call
quantizes and issues the all-to-all, and ``wait()`` dequantizes what arrived and sums it, so the transfer
runs while the next unit's backward goes on; the packed buffers are the handle's ``wire_buffers`` until
then. Two hops, and the all-reduce across groups, run to completion before the call returns (the second hop
needs the first's sum; issuing it at the wait would let another collective in between on some ranks). On a
GPU every hop is queued on the reduce-scatter stream and the handle orders the caller after them. Either
way the collectives of every rank are issued in the same order. Byte counts are the packed ``uint8``
buffers: what really travels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ..quantization import dequantize_working_bytes, dequantized_rows, packed_bytes, pass_elements, quantize_rows_into
from .context import CommContext
from .handle import Handle, _handle, _on_side_stream
from .quantized_gather import DequantizeOnWait, all_gather_quantized, gather_working_bytes
from .stats import CollectiveKind, Span


def _start_all_to_all(comm: CommContext, send: torch.Tensor, span: Span, label: str) -> tuple[torch.Tensor, Handle]:
    """Row ``i`` of ``send`` to the ``i``-th rank of ``span``; row ``i`` of the result from it, once the handle
    is waited for (its wait raises CollectiveFailed, naming the collective)."""
    comm.stats.record(CollectiveKind.REDUCE_SCATTER, send, span)
    group, size = comm.span(span)
    if size == 1:
        return send, Handle()
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received, send, group=group, async_op=True)
    return received, _handle(comm, work, CollectiveKind.REDUCE_SCATTER, label)


def _quantized_rows(rows: torch.Tensor, block_size: int, bits: int) -> torch.Tensor:
    """``rows`` packed, one ``uint8`` row each: a 2-D tensor in passes; a 3-D one (rows of strided pieces, the
    two hops' regrouping) one row at a time, each copied whole only while it is quantized."""
    count, numel = rows.shape[0], rows[0].numel()
    send = torch.empty(count, packed_bytes(numel, block_size, bits), dtype=torch.uint8, device=rows.device)
    if rows.dim() == 2:
        return quantize_rows_into(send, rows, block_size, bits)
    for index in range(count):
        quantize_rows_into(send[index : index + 1], rows[index].reshape(1, numel), block_size, bits)
    return send


def _start_sum_rows(
    rows: torch.Tensor, comm: CommContext, span: Span, label: str, block_size: int, bits: int, out: torch.Tensor
) -> Handle:
    """``rows`` (one per rank of ``span``, in its order; each 1-D, or 2-D read flat) quantized and sent now;
    the handle's wait writes this rank's row summed over ``span`` into ``out``. Summed in fp32 in rank order:
    ``out`` itself when it is a float32 block (no zeroed total to fault in and copy), else a total copied in."""
    count, numel = rows.shape[0], rows[0].numel()
    send = _quantized_rows(rows, block_size, bits)
    received, sent = _start_all_to_all(comm, send, span, label)

    def summed() -> None:
        in_place = out.dtype == torch.float32 and out.is_contiguous()
        total = out.view(-1) if in_place else torch.empty(numel, dtype=torch.float32, device=rows.device)
        for (which, elements), values in dequantized_rows(received, numel, count, bits, block_size):
            # The first rows of these elements are written, the later ones added, in rank order on every rank:
            # bitwise what adding all to zeros gives (0 + x is x, but for -0, which + 0.0 makes +0 as it did).
            if which.start == 0:
                torch.sum(values, dim=0, out=total[elements]).add_(0.0)
            else:
                total[elements] += values.sum(dim=0)
        if not in_place:
            out.copy_(total.view(out.shape))

    return DequantizeOnWait(sent, summed, (send, received))


def _sum_rows(
    rows: torch.Tensor, comm: CommContext, span: Span, label: str, block_size: int, bits: int
) -> torch.Tensor:
    """:func:`_start_sum_rows`, waited for: the sum itself."""
    total = torch.empty(rows[0].numel(), dtype=torch.float32, device=rows.device)
    _start_sum_rows(rows, comm, span, label, block_size, bits, out=total).wait()
    return total


def _run(
    comm: CommContext,
    stream: torch.cuda.Stream | None,
    tensors: tuple[torch.Tensor, ...],
    hops: Callable[[], None],
    label: str,
) -> Handle:
    """``hops`` now, on the caller's stream (CPU: each collective waited for inside), or queued on ``stream``
    with the handle ordering the caller after it."""
    if stream is None:
        hops()
        return Handle()
    return _on_side_stream(comm, stream, tensors, hops, CollectiveKind.REDUCE_SCATTER, label)


def reduce_scatter_quantized(
    comm: CommContext,
    shard_out: torch.Tensor,
    full_in: torch.Tensor,
    label: str = "gradients",
    *,
    block_size: int,
    bits: int,
) -> Handle:
    """Sum ``full_in`` over the shard group and leave this rank's slice in ``shard_out`` (which may be a slice of
    ``full_in``), each piece quantized to ``bits`` in blocks of ``block_size`` on the wire."""
    if full_in.numel() == 0:
        comm.stats.record(CollectiveKind.REDUCE_SCATTER, full_in, Span.SHARD_GROUP)
        return Handle()
    size, piece = comm.shard_size, full_in.numel() // comm.shard_size
    if comm.reduce_scatter_stream is None and comm.across_secondary_group is None:
        with record_function("zero::reduce_scatter_quantized"):  # the quantization and the issue; wait() sums
            return _start_sum_rows(
                full_in.view(size, piece), comm, Span.SHARD_GROUP, label, block_size, bits, out=shard_out
            )

    def hops() -> None:
        with record_function("zero::reduce_scatter_quantized"):
            if comm.across_secondary_group is None:
                rows = full_in.view(size, piece)
                _start_sum_rows(rows, comm, Span.SHARD_GROUP, label, block_size, bits, out=shard_out).wait()
                return
            inner, outer = comm.secondary_size, size // comm.secondary_size
            # Shard rank g * inner + l: row l holds what this rank has for the ranks at place l of every group.
            by_place = full_in.view(outer, inner, piece).transpose(0, 1)
            partial = _sum_rows(by_place, comm, Span.SECONDARY, label, block_size, bits)
            # The second hop sums apart and is copied: its peak stays the dequantization reduce_working_bytes
            # counts (summed in shard_out, the peak would move to its quantization, beside the partial sums).
            shard_out.copy_(_sum_rows(partial.view(outer, piece), comm, Span.ACROSS_SECONDARY, label, block_size, bits))

    return _run(comm, comm.reduce_scatter_stream, (shard_out, full_in), hops, label)


def all_reduce_quantized(
    comm: CommContext, tensor: torch.Tensor, label: str, span: Span = Span.ACROSS_GROUPS, *, block_size: int, bits: int
) -> Handle:
    """Sum ``tensor`` over ``span`` in place: a quantized all-to-all of its pieces, each rank summing one in
    fp32, then a quantized all-gather of the sums, which every rank (its own piece too) dequantizes alike."""
    _, size = comm.span(span)
    if size == 1 or tensor.numel() == 0:
        return Handle()
    numel = tensor.numel()
    piece = -(-numel // size)

    def hops() -> None:
        with record_function("zero::all_reduce_quantized"):
            rows = torch.nn.functional.pad(tensor.reshape(-1), (0, size * piece - numel)).view(size, piece)
            summed = _sum_rows(rows, comm, span, label, block_size, bits)
            del rows  # a padded copy: summed now
            gathered = torch.empty(size * piece, dtype=tensor.dtype, device=tensor.device)
            all_gather_quantized(comm, gathered, summed, label, span, block_size=block_size, bits=bits).wait()
            tensor.view(-1).copy_(gathered[:numel])

    return _run(comm, None, (tensor,), hops, label)


def _hop_working_bytes(count: int, numel: int, block_size: int, bits: int, total: bool = True) -> int:
    """:func:`_start_sum_rows` of ``count`` rows of ``numel`` at its peak, the dequantization: the packed bytes
    sent (a backend may let them go only when the call returns) and arrived, the float32 ``total`` unless it
    sums in its output, a pass and its sum over the pass's rows."""
    summed = 4 * min(numel, pass_elements(count, numel, block_size))
    packed = 2 * count * packed_bytes(numel, block_size, bits)
    totals = 4 * numel if total else 0
    return packed + totals + dequantize_working_bytes(count, numel, block_size, bits, per_pass_bytes=summed)


def reduce_working_bytes(
    piece: int, size: int, secondary: int | None, block_size: int, bits: int, out_element_bytes: int
) -> int:
    """What :func:`reduce_scatter_quantized` over ``size`` ranks into a shard of ``piece`` elements allocates at
    its peak besides its input and output; ``secondary``: the secondary group's size when it runs in two hops;
    ``out_element_bytes``: the output's (4, float32: one hop sums in it; else into a total first)."""
    if secondary is None:
        return _hop_working_bytes(size, piece, block_size, bits, total=out_element_bytes != 4)
    outer = size // secondary
    first = _hop_working_bytes(secondary, outer * piece, block_size, bits)  # its total: the partial sums
    # The first hop's packed buffers, sent and arrived, which a backend may still hold through the second.
    first_packed = 2 * secondary * packed_bytes(outer * piece, block_size, bits)
    return max(first, first_packed + 4 * outer * piece + _hop_working_bytes(outer, piece, block_size, bits))


def all_reduce_working_bytes(numel: int, size: int, block_size: int, bits: int, element_bytes: int) -> int:
    """What :func:`all_reduce_quantized` of ``numel`` elements of ``element_bytes`` over ``size`` ranks allocates at
    its peak besides the tensor: its padded copy while summed, then the sum and the gather of the sums."""
    piece = -(-numel // size)
    summing = size * piece * element_bytes + _hop_working_bytes(size, piece, block_size, bits)
    sent = size * packed_bytes(piece, block_size, bits)
    gather = gather_working_bytes(piece, size, block_size, bits, element_bytes)
    gathering = sent + 4 * piece + size * piece * element_bytes + gather
    return max(summing, gathering)
