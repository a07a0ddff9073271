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

from collections.abc import Iterator
from typing import NamedTuple

import torch

BITS = (4, 8)  # the widths the wire carries
LEVELS = 127  # int8, symmetric
SCALE_BYTES = 4  # one fp32 scale per block
_INT4_OFFSET = 8  # an int4 value q in [-7, 7] travels as the nibble q + 8
# Elements quantized or dequantized per pass (:func:`quantize_rows_into`, :func:`dequantized_rows`): whole rows
# while they fit, else whole blocks of one row; bounds the float32 working copy of a collective to this many.
BATCH_ELEMENTS = 1 << 22


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


def _block_views(rows: torch.Tensor, block_size: int) -> list[tuple[torch.Tensor, slice]]:
    """``rows`` (2-D, the last dimension the elements) as views of its blocks, (rows, blocks, elements), with
    the blocks' indices: the whole blocks, then the short last one if any. Views, so no padding copy."""
    numel = rows.shape[-1]
    whole = numel // block_size
    views = [(rows[:, : whole * block_size].view(rows.shape[0], whole, block_size), slice(0, whole))] if whole else []
    if numel % block_size:
        views.append((rows[:, whole * block_size :].unsqueeze(1), slice(whole, whole + 1)))
    return views


def _float_copy(source: torch.Tensor, work: torch.Tensor | None) -> torch.Tensor:
    """``source`` in float32, in ``work`` (a flat float32 buffer at least as long) if given, else a new tensor."""
    if work is None:
        return source.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return work[: source.numel()].view(source.shape).copy_(source)


def _float_buffer(shape: torch.Size, work: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``shape`` to write into: the front of ``work`` (a flat float32 buffer at least as
    long) if given, else a new one."""
    if work is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return work[: shape.numel()].view(shape)


def _block_extremes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's smallest and largest value (NaN for a block with a NaN: both reductions propagate it).

    On the CPU ``amin`` then ``amax`` is about 5x faster than one ``aminmax`` over the last dimension (0.29
    against 1.44 ns per element on this project's benchmark machine, one thread, blocks of 128), though it
    reads the elements twice; on a GPU, where the reading is the cost, ``aminmax`` reads them once. Both
    give the same values."""
    if blocks.is_cuda:
        return torch.aminmax(blocks, dim=-1, keepdim=True)
    return blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)


def quantize(
    tensor: torch.Tensor,
    block_size: int,
    bits: int = 8,
    work: torch.Tensor | None = None,
    values_out: torch.Tensor | None = None,
) -> Quantized:
    """``tensor`` (any floating dtype) to ``bits``-wide values and one fp32 scale per block: a 2-D tensor row by
    row; any other as one row, read flat (values and scales then 1-D). ``work``: a float32 buffer to compute
    in (else one is made). ``values_out``: an int8 tensor of the values' shape to write them into (a packed
    buffer's value bytes, so no int8 copy is made and copied again)."""
    rows = tensor.detach().reshape(tensor.shape if tensor.dim() == 2 else (1, -1))
    # A float32 input's blocks are read where they are and multiplied into ``work``: the copy and the multiply
    # are one pass, with the values of copying first. Another dtype is copied into ``work`` first (the CPU's
    # mixed-dtype multiply would make a float32 copy of its own, beside ``work``), as is a tensor whose
    # elements are not adjacent.
    in_place = rows.dtype == torch.float32 and rows.stride(-1) == 1
    source = rows if in_place else _float_copy(rows, work)
    work = _float_buffer(rows.shape, work, rows.device) if in_place else source
    scales = torch.empty(rows.shape[0], blocks_of(rows.shape[-1], block_size), device=rows.device)
    # On the CPU, whether every scale and multiplier is finite (then nothing can be NaN: see below).
    all_finite = not rows.is_cuda
    for (blocks, which), (out, _) in zip(_block_views(source, block_size), _block_views(work, block_size)):
        # amax is NaN for a block with a NaN, inf for one with an inf: dequantized, both give NaN throughout
        # (inf * 0 is NaN).
        lowest, highest = _block_extremes(blocks)
        amax = torch.maximum(-lowest, highest)
        # One multiplier per block (a pass over the elements fewer than dividing each): 0 for a zero block,
        # whose values are all 0 anyway, and for an inf or NaN one, whose values the scale's inf or NaN overrides.
        multiplier = torch.where(amax > 0, levels(bits) / amax, torch.zeros_like(amax))
        torch.mul(blocks, multiplier, out=out)
        scales[:, which] = amax.squeeze(-1)
        all_finite = all_finite and bool(torch.isfinite(amax).all() and torch.isfinite(multiplier).all())
    rounded = work.round_()
    # A NaN comes from a NaN or inf value, or from 0 times the inf multiplier of a block whose amax is below
    # levels / float32's largest (subnormal); inf * 0 is NaN. Each is set to 0. Skipped, one pass fewer, on
    # the CPU when every scale and multiplier is finite (there is then no NaN to set); on a GPU always run, as
    # the check would wait for the device.
    if not all_finite:
        rounded.nan_to_num_(0.0, 0.0, 0.0)
    # The same conversion either way (copy_ into int8 is what .to(torch.int8) runs).
    values = rounded.to(torch.int8) if values_out is None else values_out.view(rounded.shape).copy_(rounded)
    return Quantized(values, scales, bits) if tensor.dim() == 2 else Quantized(values[0], scales[0], bits)


def _dequantized(
    quantized: Quantized, block_size: int, work: torch.Tensor | None = None, into: torch.Tensor | None = None
) -> torch.Tensor:
    """The values in float32, in the shape of ``quantized.values``: computed in ``into`` (a contiguous float32
    tensor of that shape) if given, else in ``work`` (a float32 buffer), else in a new tensor."""
    # Worked on in place; the same operations wherever they run, so the same bits.
    values = into.copy_(quantized.values) if into is not None else _float_copy(quantized.values, work)
    rows, scales = values.view(-1, values.shape[-1]), quantized.scales.view(-1, quantized.scales.shape[-1])
    for blocks, which in _block_views(rows, block_size):
        # q / L first: exactly +-1 at a block's largest magnitude, which the scale then restores exactly.
        blocks.div_(levels(quantized.bits)).mul_(scales[:, which].unsqueeze(-1))
    return values


def dequantize_into(out: torch.Tensor, quantized: Quantized, block_size: int) -> None:
    """Write the dequantized values into ``out`` (any floating dtype, as many elements as quantized): one row,
    or several back to back (:func:`unpack`'s ``parts``) at once."""
    out.view(quantized.values.shape).copy_(_dequantized(quantized, block_size))


def _value_bytes_of(values: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return values.view(torch.uint8)
    nibbles = (values + _INT4_OFFSET).to(torch.uint8)
    if nibbles.shape[-1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _write_packed(value_out: torch.Tensor, scale_out: torch.Tensor, quantized: Quantized) -> None:
    if quantized.values.data_ptr() != value_out.data_ptr():  # else quantize() wrote them there
        value_out.copy_(_value_bytes_of(quantized.values, quantized.bits))
    scale_out.copy_(quantized.scales.contiguous().view(torch.uint8))


def pack(quantized: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """``uint8`` bytes, each row its values then its scales' bytes (into ``out``, of that shape, if given)."""
    split = value_bytes(quantized.values.shape[-1], quantized.bits)
    if out is None:
        width = split + SCALE_BYTES * quantized.scales.shape[-1]
        out = torch.empty(*quantized.values.shape[:-1], width, dtype=torch.uint8, device=quantized.values.device)
    _write_packed(out[..., :split], out[..., split:], quantized)
    return out


def _unpack(values_raw: torch.Tensor, scales_raw: torch.Tensor, numel: int, bits: int) -> Quantized:
    """Values (rows, numel) from their packed bytes, scales (rows, blocks) from theirs (copied: fp32-aligned)."""
    if bits == 8:
        values = values_raw.view(torch.int8)
    else:
        low = (values_raw & 0xF).to(torch.int8) - _INT4_OFFSET
        high = (values_raw >> 4).to(torch.int8) - _INT4_OFFSET
        values = torch.stack([low, high], dim=-1).flatten(-2)[:, :numel]
    return Quantized(values, scales_raw.clone(memory_format=torch.contiguous_format).view(torch.float32), bits)


def unpack(buffer: torch.Tensor, numel: int, parts: int = 1, bits: int = 8) -> Quantized:
    """The inverse of :func:`pack` for a buffer of ``numel`` quantized elements, or of ``parts`` such rows back
    to back (an all-gather's output): values (parts, numel), scales (parts, blocks). int8 values are views
    of the buffer; int4 values are widened to int8."""
    rows = buffer.view(parts, -1)
    split = value_bytes(numel, bits)
    values, scales, _ = _unpack(rows[:, :split], rows[:, split:], numel, bits)
    return Quantized(values[0], scales[0], bits) if parts == 1 else Quantized(values, scales, bits)


class _Segment(NamedTuple):
    """Some rows' elements ``[start, stop)`` (whole blocks but the row's last), and where they are packed."""

    rows: slice
    start: int
    stop: int
    values: slice  # bytes of each packed row
    scales: slice


def _rows_per_pass(numel: int) -> int:
    return max(1, BATCH_ELEMENTS // max(numel, 1))


def _run_elements(block_size: int) -> int:
    """Elements of one pass over a row longer than ``BATCH_ELEMENTS``: whole blocks, an even number of them
    (int4 packs two values to a byte)."""
    return max(1, BATCH_ELEMENTS // (2 * block_size)) * 2 * block_size


def pass_elements(count: int, numel: int, block_size: int) -> int:
    """The most elements one pass over ``count`` rows of ``numel`` holds: its float32 working buffer."""
    if numel <= BATCH_ELEMENTS:
        return min(count, _rows_per_pass(numel)) * numel
    return min(numel, _run_elements(block_size))


def dequantize_working_bytes(
    count: int, numel: int, block_size: int, bits: int, per_pass_bytes: int = 0, float_pass: bool = True
) -> int:
    """What :func:`dequantized_rows` of ``count`` rows of ``numel`` allocates at its peak: the float32 pass
    (unless ``float_pass`` is False: it dequantizes into its ``out``), its scales, and with int4 the values
    widened to int8 (with the nibbles they are widened from), or instead ``per_pass_bytes``, what the caller
    allocates for each pass once its int8 values are freed."""
    elements = pass_elements(count, numel, block_size)
    widened = 5 * elements // 2 if bits == 4 else 0
    scales = SCALE_BYTES * (blocks_of(elements, block_size) + min(count, _rows_per_pass(numel)))
    return (4 * elements if float_pass else 0) + scales + max(widened, per_pass_bytes)


def _segments(count: int, numel: int, block_size: int, bits: int) -> Iterator[_Segment]:
    """The passes over ``count`` rows of ``numel`` elements: whole rows while ``BATCH_ELEMENTS`` holds them,
    else runs of whole blocks of one row."""
    if numel <= BATCH_ELEMENTS:
        runs, rows_per_pass = [(0, numel)], _rows_per_pass(numel)
    else:
        run = _run_elements(block_size)
        runs, rows_per_pass = [(start, min(start + run, numel)) for start in range(0, numel, run)], 1
    scales_at = value_bytes(numel, bits)
    for first in range(0, count, rows_per_pass):
        rows = slice(first, min(count, first + rows_per_pass))
        for start, stop in runs:
            values = slice(value_bytes(start, bits), value_bytes(stop, bits))
            scale_bytes = slice(
                scales_at + SCALE_BYTES * (start // block_size), scales_at + SCALE_BYTES * blocks_of(stop, block_size)
            )
            yield _Segment(rows, start, stop, values, scale_bytes)


def _work_buffer(count: int, numel: int, block_size: int, device: torch.device) -> torch.Tensor:
    """One float32 buffer every pass computes in, so a pass's temporaries are freed before the next begins."""
    return torch.empty(pass_elements(count, numel, block_size), dtype=torch.float32, device=device)


def quantize_rows_into(out: torch.Tensor, rows: torch.Tensor, block_size: int, bits: int) -> torch.Tensor:
    """Each row of ``rows`` (2-D, any floating dtype) quantized and packed into the same row of ``out``
    (``uint8``, ``packed_bytes`` wide), at most ``BATCH_ELEMENTS`` at a time; returns ``out``."""
    count, numel = rows.shape
    work = _work_buffer(count, numel, block_size, rows.device)
    for segment in _segments(count, numel, block_size, bits):
        # int8: the values go straight into their packed bytes; int4 packs two to a byte afterwards.
        values_out = out[segment.rows, segment.values].view(torch.int8) if bits == 8 else None
        quantized = quantize(rows[segment.rows, segment.start : segment.stop], block_size, bits, work, values_out)
        _write_packed(out[segment.rows, segment.values], out[segment.rows, segment.scales], quantized)
    return out


def dequantized_rows(
    buffer: torch.Tensor, numel: int, parts: int, bits: int, block_size: int, out: torch.Tensor | None = None
) -> Iterator[tuple[tuple[slice, slice], torch.Tensor]]:
    """The ``parts`` packed rows of ``buffer`` (of ``numel`` elements each) dequantized, at most
    ``BATCH_ELEMENTS`` at a time: ``((rows, elements), values)``, ``values`` float32 of shape (rows, elements),
    in one buffer every pass reuses: valid until the next pass. ``out``: a contiguous float32 (parts, numel)
    tensor to dequantize straight into instead (each pass's ``values`` is then its slice of ``out``, whole
    rows or a run of one row's elements: contiguous either way)."""
    packed_rows = buffer.view(parts, -1)
    work = _work_buffer(parts, numel, block_size, buffer.device) if out is None else None
    for rows, start, stop, values, scales in _segments(parts, numel, block_size, bits):
        into = out[rows, start:stop] if out is not None else None
        # One expression: the widened int8 values are freed once in ``work``, before the caller sees the pass.
        restored = _dequantized(
            _unpack(packed_rows[rows, values], packed_rows[rows, scales], stop - start, bits), block_size, work, into
        )
        yield (rows, slice(start, stop)), restored
