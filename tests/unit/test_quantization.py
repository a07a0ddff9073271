"""The block quantizer ZeRO++'s quantized collectives carry (zero_core/quantization.py), tested directly, at
int8 (weights, and gradients if asked) and int4 (gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from zero_core import quantization
from zero_core.quantization import (
    BITS,
    dequantize_into,
    dequantized_rows,
    levels,
    pack,
    packed_bytes,
    quantize,
    quantize_rows_into,
    unpack,
)

LEVELS = levels(8)
each_width = pytest.mark.parametrize("bits", BITS)


def round_trip(tensor: torch.Tensor, block: int, dtype: torch.dtype = torch.float32, bits: int = 8) -> torch.Tensor:
    out = torch.empty(tensor.numel(), dtype=dtype)
    dequantize_into(out, quantize(tensor, block, bits), block)
    return out


@each_width
@pytest.mark.parametrize("block", [1, 7, 64, 2048])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 5003])
def test_error_is_at_most_half_a_step_per_block(block: int, numel: int, bits: int) -> None:
    torch.manual_seed(numel * 31 + block)
    # Blocks of very different magnitudes: each block's step is its own.
    values = torch.randn(numel) * torch.logspace(-6, 3, numel)[torch.randperm(numel)]
    restored = round_trip(values, block, bits=bits)
    blocks = -(-numel // block)
    pad = blocks * block - numel
    error = torch.nn.functional.pad((values - restored).abs(), (0, pad)).view(blocks, block).amax(dim=1)
    amax = torch.nn.functional.pad(values.abs(), (0, pad)).view(blocks, block).amax(dim=1)
    # Half a step, plus fp32 rounding of the scale and the division (a few ulps of amax).
    ulp = torch.tensor([math.ulp(a) for a in amax.tolist()])
    bound = amax / levels(bits) / 2 + 4 * ulp
    assert (error <= bound).all(), (error - bound).max()


@each_width
def test_zero_and_constant_blocks_are_exact(bits: int) -> None:
    block = 16
    values = torch.cat(
        [
            torch.zeros(block),
            torch.full((block,), 0.1),
            torch.full((block,), -3.7e-5),
            torch.full((block,), 6.0e4),
            torch.full((5,), 1.2345),  # a short last block
        ]
    )
    assert torch.equal(round_trip(values, block, bits=bits), values)


@each_width
def test_the_largest_magnitude_of_each_block_is_exact_and_signs_are_kept(bits: int) -> None:
    values = torch.tensor([0.5, -2.0, 1.0, 0.25, 3.0, -0.75])
    restored = round_trip(values, 3, bits=bits)
    assert restored[1].item() == -2.0 and restored[4].item() == 3.0
    assert torch.equal(torch.sign(restored), torch.sign(values))


@each_width
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_makes_its_block_nan_and_leaves_the_others(bad: float, bits: int) -> None:
    values = torch.tensor([1.0, 2.0, bad, 4.0, 5.0, 6.0, 7.0, 8.0])
    restored = round_trip(values, 4, bits=bits)
    assert torch.isnan(restored[:4]).all()  # the overflow check still sees it
    assert torch.allclose(restored[4:], values[4:], rtol=0, atol=8.0 / levels(bits) / 2)


@each_width
def test_a_block_of_subnormal_values_and_zeros_stays_finite(bits: int) -> None:
    """A block whose largest magnitude is below levels / float32's largest has an inf multiplier: its zeros
    (0 * inf is NaN) and its values (inf) are set to 0, so the block comes back as zeros, finite, off by at most
    its largest magnitude; the next block is untouched."""
    values = torch.zeros(32)
    values[1], values[5], values[12] = 1e-44, -3e-45, 7e-45  # float32 subnormals
    values[16:] = torch.linspace(-1, 1, 16)  # the next block ordinary
    quantized = quantize(values, 16, bits)
    assert torch.equal(quantized.values[:16], torch.zeros(16, dtype=torch.int8))
    restored = round_trip(values, 16, bits=bits)
    assert torch.isfinite(restored).all() and torch.equal(restored[:16], torch.zeros(16))
    assert (restored[16:] - values[16:]).abs().max() <= 1 / levels(bits) / 2 + 1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_in_and_out(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    values = torch.randn(300).to(dtype)
    restored = round_trip(values, 32, dtype)
    assert restored.dtype == dtype
    assert (restored.float() - values.float()).abs().max().item() <= values.float().abs().max().item() / LEVELS


@each_width
def test_values_are_within_the_symmetric_range(bits: int) -> None:
    values = torch.randn(4096) * 100
    quantized = quantize(values, 256, bits)
    assert quantized.values.dtype == torch.int8 and quantized.scales.dtype == torch.float32
    assert quantized.values.numel() == 4096 and quantized.scales.numel() == 16
    assert quantized.values.min().item() == -levels(bits) and quantized.values.max().item() == levels(bits)


@each_width
@pytest.mark.parametrize("numel,block", [(1, 1), (10, 3), (4096, 2048), (4097, 2048)])
def test_the_packed_buffer_holds_values_then_scales(numel: int, block: int, bits: int) -> None:
    values = torch.randn(numel)
    quantized = quantize(values, block, bits)
    buffer = pack(quantized)
    value_bytes = numel if bits == 8 else -(-numel // 2)  # int4: two to a byte, the last one half full
    assert buffer.dtype == torch.uint8 and buffer.numel() == packed_bytes(numel, block, bits)
    assert buffer.numel() == value_bytes + 4 * -(-numel // block)
    back = unpack(buffer, numel, bits=bits)
    assert torch.equal(back.values, quantized.values) and torch.equal(back.scales, quantized.scales)
    into = torch.empty_like(buffer)
    assert torch.equal(pack(quantized, into), buffer)


@each_width
@pytest.mark.parametrize("numel,block,parts", [(10, 3, 4), (4097, 2048, 3), (1, 1, 2)])
def test_shards_back_to_back_dequantize_at_once_as_each_alone(numel: int, block: int, parts: int, bits: int) -> None:
    """An all-gather's output: every rank's packed shard, dequantized in one go, bit for bit as one by one."""
    shards = [torch.randn(numel) * 10 for _ in range(parts)]
    gathered = torch.cat([pack(quantize(shard, block, bits)) for shard in shards])
    at_once = torch.empty(parts * numel, dtype=torch.bfloat16)
    dequantize_into(at_once, unpack(gathered, numel, parts=parts, bits=bits), block)
    for index, shard in enumerate(shards):
        alone = round_trip(shard, block, torch.bfloat16, bits)
        assert torch.equal(at_once[index * numel : (index + 1) * numel], alone)


@each_width
def test_rows_quantize_each_on_its_own_blocks(bits: int) -> None:
    """A 2-D tensor (one row per destination rank): each row quantized, packed and unpacked as if alone,
    with the row's blocks starting at the row (an all-to-all sends a row whole)."""
    rows = torch.randn(3, 100) * torch.tensor([[1.0], [1e-3], [1e3]])
    quantized = quantize(rows, 16, bits)
    packed = pack(quantized)
    assert packed.shape == (3, packed_bytes(100, 16, bits))
    for index in range(3):
        assert torch.equal(packed[index], pack(quantize(rows[index], 16, bits)))
    back = unpack(packed.reshape(-1), 100, parts=3, bits=bits)
    assert torch.equal(back.values, quantized.values) and torch.equal(back.scales, quantized.scales)


@each_width
@pytest.mark.parametrize("batch", [64, 100, 1 << 22])  # runs of one row's blocks, rows per pass, one pass
@pytest.mark.parametrize("rows,numel,block", [(5, 37, 8), (3, 301, 7), (2, 4097, 16), (1, 64, 64)])
def test_passes_pack_and_restore_bit_for_bit_as_one_pass(
    monkeypatch: pytest.MonkeyPatch, bits: int, batch: int, rows: int, numel: int, block: int
) -> None:
    """The collectives quantize and dequantize a bounded number of elements per pass (whole rows, or runs of
    one row's blocks): the bytes and the values are those of the whole tensor at once."""
    torch.manual_seed(rows * numel + block)
    tensor = torch.randn(rows, numel) * torch.logspace(-3, 3, numel)
    whole = pack(quantize(tensor, block, bits))
    monkeypatch.setattr(quantization, "BATCH_ELEMENTS", batch)
    assert torch.equal(quantize_rows_into(torch.empty_like(whole), tensor, block, bits), whole)
    restored, elements = torch.full((rows, numel), float("nan")), 0
    for where, values in dequantized_rows(whole.reshape(-1), numel, rows, bits, block):
        assert values.numel() <= max(batch, 2 * block)  # whole blocks, an even number of values (int4)
        restored[where] = values
        elements += values.numel()
    expected = torch.empty(rows, numel)
    dequantize_into(expected, unpack(whole.reshape(-1), numel, parts=rows, bits=bits), block)
    assert elements == rows * numel and torch.equal(restored, expected)
