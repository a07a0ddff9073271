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

from ..quantization import dequantize_into, pack, packed_bytes, quantize, unpack
from .context import CommContext
from .handle import Handle
from .ops import all_gather
from .stats import Span


class _DequantizeOnWait(Handle):
    """The gather's handle, with the dequantization run once after it completed."""

    def __init__(self, gather: Handle, dequantize: Callable[[], None]):
        super().__init__(after_wait=dequantize)
        self._gather = gather

    def wait(self) -> None:
        self._gather.wait()  # raises CollectiveFailed (the output untouched) if the gather failed
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
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        send = pack(quantize(shard_in, block_size, bits))
    per_rank = packed_bytes(numel, block_size, bits)
    received = torch.empty(size * per_rank, dtype=torch.uint8, device=gathered_out.device)

    def dequantize() -> None:
        # Every rank's part at once, this rank's own among them: every rank holds the same values.
        dequantize_into(gathered_out, unpack(received, numel, parts=size, bits=bits), block_size)

    return _DequantizeOnWait(all_gather(comm, received, send, label, span), dequantize)
