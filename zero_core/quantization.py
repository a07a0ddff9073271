"""Block quantization for the wire (ZeRO++'s qwZ): int8 values with one fp32 scale per block.

A flat tensor is cut into blocks of ``block_size`` elements (the last one short). Each block keeps its
largest magnitude ``amax`` as its scale and every value as ``round(x / amax * 127)``, an int8 in
[-127, 127] (symmetric: -128 is never used, so a block and its negation quantize alike). Dequantized,
a value is ``amax * (q / 127)``:

- the error is at most half a step (``amax / 254``) plus fp32 rounding;
- a block of zeros is zeros, and a constant block (every value ``c``) is ``c`` exactly: ``q`` is then
  +-127 and ``q / 127`` is exactly +-1;
- a block holding an inf or a NaN dequantizes to NaN throughout, so a non-finite value is never lost on
  the way (the fp16 loss scaler's overflow check still sees it, and a NaN parameter stays visible).

On the wire a rank's quantized shard is one ``uint8`` buffer, its int8 values then its scales
(:func:`pack`), so an all-gather of it is one collective whose counted bytes are what really travels:
``n + 4 * ceil(n / block_size)`` for ``n`` elements, against ``2 n`` for bf16 and ``4 n`` for fp32.

Plain torch operations, on whatever device the tensor is on; no state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LEVELS = 127  # int8, symmetric
SCALE_BYTES = 4  # one fp32 scale per block


class Quantized(NamedTuple):
    values: torch.Tensor  # int8, as many as the input's elements
    scales: torch.Tensor  # float32, one per block


def blocks_of(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def packed_bytes(numel: int, block_size: int) -> int:
    """Bytes of one quantized shard of ``numel`` elements on the wire (values, then scales)."""
    return numel + SCALE_BYTES * blocks_of(numel, block_size)


def _as_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` (float32; its last dimension the elements) as rows of ``block_size``, the last row padded with
    zeros (which raise no amax)."""
    pad = blocks_of(flat.shape[-1], block_size) * block_size - flat.shape[-1]
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(*flat.shape[:-1], -1, block_size)


def quantize(tensor: torch.Tensor, block_size: int) -> Quantized:
    """``tensor`` (any floating dtype, read flat) to int8 values and one fp32 scale per block."""
    flat = tensor.detach().reshape(-1).float()
    blocks = _as_blocks(flat, block_size)
    # amax is NaN for a block with a NaN (amax propagates it), inf for one with an inf: dequantized, both
    # give NaN throughout (inf * 0 is NaN).
    amax = blocks.abs().amax(dim=1, keepdim=True)
    divisor = torch.where(amax > 0, amax, torch.ones_like(amax))  # a zero block: every q is 0 anyway
    scaled = torch.round(blocks / divisor * LEVELS)
    scaled = torch.where(torch.isfinite(scaled), scaled, torch.zeros_like(scaled))  # inf/NaN: lost in amax
    values = scaled.to(torch.int8).reshape(-1)[: flat.numel()]
    return Quantized(values, amax.reshape(-1))


def dequantize_into(out: torch.Tensor, quantized: Quantized, block_size: int) -> None:
    """Write the dequantized values into ``out`` (any floating dtype, as many elements as quantized): one shard,
    or several back to back (:func:`unpack`'s ``parts``) at once."""
    values = quantized.values.float()
    blocks = _as_blocks(values, block_size)
    restored = quantized.scales.unsqueeze(-1) * (blocks / LEVELS)
    out.view(values.shape).copy_(restored.flatten(-2)[..., : values.shape[-1]])


def pack(quantized: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """One ``uint8`` buffer: the int8 values, then the scales' bytes (into ``out`` if given)."""
    values = quantized.values.view(torch.uint8)
    scales = quantized.scales.contiguous().view(torch.uint8)
    if out is None:
        return torch.cat([values, scales])
    out[: values.numel()].copy_(values)
    out[values.numel() :].copy_(scales)
    return out


def unpack(buffer: torch.Tensor, numel: int, parts: int = 1) -> Quantized:
    """The inverse of :func:`pack` for a buffer of ``numel`` quantized elements (views of the values, no copy),
    or of ``parts`` such buffers back to back (an all-gather's output): values (parts, numel), scales (parts,
    blocks)."""
    rows = buffer.view(parts, -1)
    values = rows[:, :numel].view(torch.int8)
    scales = rows[:, numel:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # aligned bytes
    return Quantized(values[0], scales[0]) if parts == 1 else Quantized(values, scales)
