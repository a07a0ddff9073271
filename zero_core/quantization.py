"""Block quantization for the wire (ZeRO++'s qwZ and qgZ): int8 or int4 values, one fp32 scale per block.

A flat tensor is cut into blocks of ``block_size`` elements (the last one short). Each block keeps its
largest magnitude ``amax`` as its scale and every value as ``round(x / amax * L)``, an integer in [-L, L]
with ``L = 2 ** (bits - 1) - 1`` (127 for int8, 7 for int4; symmetric: a block and its negation quantize
alike). Dequantized, a value is ``amax * (q / L)``:

- the error is at most half a step (``amax / (2 L)``) plus fp32 rounding;
- a block of zeros is zeros, and a constant block (every value ``c``) is ``c`` exactly: ``q`` is then
  +-L and ``q / L`` is exactly +-1;
- a block holding an inf or a NaN dequantizes to NaN throughout, so a non-finite value is never lost on
  the way (the fp16 loss scaler's overflow check still sees it, and a NaN parameter stays visible).

A tensor of several dimensions is quantized row by row (its last dimension the elements, each row its own
blocks), so one row can travel to one rank. On the wire each row is one ``uint8`` run, its values then its
scales (:func:`pack`; int4 values two to a byte, low nibble first), so a collective of it counts what
really travels: ``value_bytes(n) + 4 * ceil(n / block_size)`` for ``n`` elements, against ``2 n`` for bf16
and ``4 n`` for fp32.

Plain torch operations, on whatever device the tensor is on; no state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BITS = (4, 8)  # the widths the wire carries
LEVELS = 127  # int8, symmetric
SCALE_BYTES = 4  # one fp32 scale per block
_INT4_OFFSET = 8  # an int4 value q in [-7, 7] travels as the nibble q + 8


class Quantized(NamedTuple):
    values: torch.Tensor  # int8 (int4 values widened), as many as the input's elements
    scales: torch.Tensor  # float32, one per block
    bits: int = 8


def levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def blocks_of(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def value_bytes(numel: int, bits: int = 8) -> int:
    return numel if bits == 8 else -(-numel // 2)


def packed_bytes(numel: int, block_size: int, bits: int = 8) -> int:
    """Bytes of one quantized row of ``numel`` elements on the wire (values, then scales)."""
    return value_bytes(numel, bits) + SCALE_BYTES * blocks_of(numel, block_size)


def _as_blocks(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """``rows`` (float32; its last dimension the elements) as blocks of ``block_size``, the last block of
    each row padded with zeros (which raise no amax)."""
    pad = blocks_of(rows.shape[-1], block_size) * block_size - rows.shape[-1]
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.view(*rows.shape[:-1], -1, block_size)


def quantize(tensor: torch.Tensor, block_size: int, bits: int = 8) -> Quantized:
    """``tensor`` (any floating dtype) to ``bits``-wide values and one fp32 scale per block: a 1-D tensor (or
    one of any shape, read flat) as one row; a 2-D tensor row by row."""
    rows = tensor.detach().float()
    rows = rows if rows.dim() == 2 else rows.reshape(-1)
    blocks = _as_blocks(rows, block_size)
    # amax is NaN for a block with a NaN (aminmax propagates it), inf for one with an inf: dequantized, both
    # give NaN throughout (inf * 0 is NaN).
    lowest, highest = torch.aminmax(blocks, dim=-1, keepdim=True)
    amax = torch.maximum(-lowest, highest)
    # One multiplier per block (a pass over the elements fewer than dividing each): 0 for a zero block, whose
    # values are all 0 anyway, and for an inf or NaN one, whose values the scale's inf or NaN overrides.
    multiplier = torch.where(amax > 0, levels(bits) / amax, torch.zeros_like(amax))
    scaled = (blocks * multiplier).round_().nan_to_num_(0.0, 0.0, 0.0)  # inf * 0 is NaN: to 0 as well
    values = scaled.to(torch.int8).flatten(-2)[..., : rows.shape[-1]]
    return Quantized(values, amax.squeeze(-1), bits)


def dequantize_into(out: torch.Tensor, quantized: Quantized, block_size: int) -> None:
    """Write the dequantized values into ``out`` (any floating dtype, as many elements as quantized): one row,
    or several back to back (:func:`unpack`'s ``parts``) at once."""
    values = quantized.values.float()  # a new tensor: worked on in place
    # q / L first: exactly +-1 at a block's largest magnitude, which the scale then restores exactly.
    blocks = _as_blocks(values, block_size).div_(levels(quantized.bits)).mul_(quantized.scales.unsqueeze(-1))
    out.view(values.shape).copy_(blocks.flatten(-2)[..., : values.shape[-1]])


def _value_bytes_of(values: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return values.view(torch.uint8)
    nibbles = (values + _INT4_OFFSET).to(torch.uint8)
    if nibbles.shape[-1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def pack(quantized: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """``uint8`` bytes, each row its values then its scales' bytes (into ``out``, of that shape, if given)."""
    values = _value_bytes_of(quantized.values, quantized.bits)
    scales = quantized.scales.contiguous().view(torch.uint8)
    if out is None:
        return torch.cat([values, scales], dim=-1)
    out[..., : values.shape[-1]].copy_(values)
    out[..., values.shape[-1] :].copy_(scales)
    return out


def unpack(buffer: torch.Tensor, numel: int, parts: int = 1, bits: int = 8) -> Quantized:
    """The inverse of :func:`pack` for a buffer of ``numel`` quantized elements, or of ``parts`` such rows back
    to back (an all-gather's output): values (parts, numel), scales (parts, blocks). int8 values are views
    of the buffer; int4 values are widened to int8."""
    rows = buffer.view(parts, -1)
    raw = rows[:, : value_bytes(numel, bits)]
    if bits == 8:
        values = raw.view(torch.int8)
    else:
        low = (raw & 0xF).to(torch.int8) - _INT4_OFFSET
        high = (raw >> 4).to(torch.int8) - _INT4_OFFSET
        values = torch.stack([low, high], dim=-1).flatten(-2)[:, :numel]
    scales = rows[:, value_bytes(numel, bits) :].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return Quantized(values[0], scales[0], bits) if parts == 1 else Quantized(values, scales, bits)
