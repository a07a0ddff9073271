"""ZeRO++'s quantized weights (qwZ): a parameter all-gather that carries int8 blocks and their scales.

Each rank quantizes its shard (``quantization.py``), the packed bytes are all-gathered as one ``uint8``
collective (so its counted bytes are what really travels), and ``wait()`` dequantizes every rank's part,
this rank's own among them, into the full buffer: every rank computes with the same values. Only the
forward and backward gathers of stage 3 use it; the fp32 masters, checkpoints, ``gathered_parameters()``
and exports gather exactly.

On a GPU the quantization runs on the all-gather's side stream, after what the compute stream issued and
after a staging copy queued there (offload_params), and the dequantization on the compute stream once the
collective's event is waited for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..quantization import dequantize_working_bytes, dequantized_rows, packed_bytes, quantize_rows_into
from .context import CommContext
from .handle import Handle
from .ops import all_gather
from .stats import Span


class DequantizeOnWait(Handle):
    """A quantized collective's handle (a gather's, or a reduce's all-to-all), with the dequantization of what
    arrived run once after it completed; its packed buffers are ``wire_buffers`` while in flight."""

    def __init__(self, gather: Handle, dequantize: Callable[[], None], wire_buffers: tuple[torch.Tensor, ...]):
        super().__init__(after_wait=dequantize)
        self._gather = gather
        self.wire_buffers = wire_buffers  # what was sent and what arrives, while in flight

    def wait(self) -> None:
        self._gather.wait()  # raises CollectiveFailed (the output untouched) if the gather failed
        self.wire_buffers = ()  # the sent bytes go now; the dequantization holds what arrived until it is done
        super().wait()

    def is_completed(self) -> bool:
        return self._gather.is_completed()


def all_gather_quantized(
    comm: CommContext,
    gathered_out: torch.Tensor,
    shard_in: torch.Tensor,
    label: str = "parameters",
    span: Span = Span.SHARD_GROUP,
    *,
    block_size: int,
    bits: int = 8,
) -> Handle:
    """Fill ``gathered_out`` (group size * shard numel) with every rank's shard, quantized to ``bits`` (int8
    unless asked) in blocks of ``block_size`` on the wire and dequantized into ``gathered_out``'s dtype."""
    numel = shard_in.numel()
    if numel == 0:
        return all_gather(comm, gathered_out, shard_in, label, span)
    _, size = comm.span(span)
    side = comm.all_gather_stream if shard_in.is_cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(shard_in.device))
    per_rank = packed_bytes(numel, block_size, bits)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        send = torch.empty(1, per_rank, dtype=torch.uint8, device=shard_in.device)
        quantize_rows_into(send, shard_in.reshape(1, numel), block_size, bits)
    received = torch.empty(size * per_rank, dtype=torch.uint8, device=gathered_out.device)

    def dequantize() -> None:
        # Every rank's part, this rank's own among them: every rank holds the same values. Into a float32
        # output straight (no float32 pass to copy from); into another dtype through the pass, rounded once.
        out_rows = gathered_out.view(size, numel)
        in_place = gathered_out.dtype == torch.float32 and gathered_out.is_contiguous()
        for where, values in dequantized_rows(received, numel, size, bits, block_size, out_rows if in_place else None):
            if not in_place:
                out_rows[where].copy_(values)

    gather = all_gather(comm, received, send.view(-1), label, span)
    return DequantizeOnWait(gather, dequantize, (send, received))


def gather_working_bytes(numel: int, size: int, block_size: int, bits: int, out_element_bytes: int) -> int:
    """What :func:`all_gather_quantized` of a shard of ``numel`` over ``size`` ranks into an output of
    ``out_element_bytes`` allocates at its peak besides its input and output: the packed bytes sent (a backend
    may let them go only when the call returns) and arrived, and the dequantization's float32 pass (none into
    a float32 output, which it dequantizes into; with int4, the widened values)."""
    packed = packed_bytes(numel, block_size, bits) * (size + 1)
    return packed + dequantize_working_bytes(size, numel, block_size, bits, float_pass=out_element_bytes != 4)
