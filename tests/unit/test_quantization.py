"""The block quantizer ZeRO++'s quantized all-gathers carry (zero_core/quantization.py), tested directly."""

from __future__ import annotations

import math

import pytest
import torch

from zero_core.quantization import LEVELS, dequantize_into, pack, packed_bytes, quantize, unpack


def round_trip(tensor: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.empty(tensor.numel(), dtype=dtype)
    dequantize_into(out, quantize(tensor, block), block)
    return out


@pytest.mark.parametrize("block", [1, 7, 64, 2048])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 5003])
def test_error_is_at_most_half_a_step_per_block(block: int, numel: int) -> None:
    torch.manual_seed(numel * 31 + block)
    # Blocks of very different magnitudes: each block's step is its own.
    values = torch.randn(numel) * torch.logspace(-6, 3, numel)[torch.randperm(numel)]
    restored = round_trip(values, block)
    blocks = -(-numel // block)
    pad = blocks * block - numel
    error = torch.nn.functional.pad((values - restored).abs(), (0, pad)).view(blocks, block).amax(dim=1)
    amax = torch.nn.functional.pad(values.abs(), (0, pad)).view(blocks, block).amax(dim=1)
    # Half a step, plus fp32 rounding of the scale and the division (a few ulps of amax).
    ulp = torch.tensor([math.ulp(a) for a in amax.tolist()])
    bound = amax / LEVELS / 2 + 4 * ulp
    assert (error <= bound).all(), (error - bound).max()


def test_zero_and_constant_blocks_are_exact() -> None:
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
    assert torch.equal(round_trip(values, block), values)


def test_the_largest_magnitude_of_each_block_is_exact_and_signs_are_kept() -> None:
    values = torch.tensor([0.5, -2.0, 1.0, 0.25, 3.0, -0.75])
    restored = round_trip(values, 3)
    assert restored[1].item() == -2.0 and restored[4].item() == 3.0
    assert torch.equal(torch.sign(restored), torch.sign(values))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_makes_its_block_nan_and_leaves_the_others(bad: float) -> None:
    values = torch.tensor([1.0, 2.0, bad, 4.0, 5.0, 6.0, 7.0, 8.0])
    restored = round_trip(values, 4)
    assert torch.isnan(restored[:4]).all()  # the overflow check still sees it
    assert torch.allclose(restored[4:], values[4:], rtol=0, atol=8.0 / LEVELS / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_in_and_out(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    values = torch.randn(300).to(dtype)
    restored = round_trip(values, 32, dtype)
    assert restored.dtype == dtype
    assert (restored.float() - values.float()).abs().max().item() <= values.float().abs().max().item() / LEVELS


def test_values_are_int8_within_the_symmetric_range() -> None:
    values = torch.randn(4096) * 100
    quantized = quantize(values, 256)
    assert quantized.values.dtype == torch.int8 and quantized.scales.dtype == torch.float32
    assert quantized.values.numel() == 4096 and quantized.scales.numel() == 16
    assert quantized.values.min().item() >= -LEVELS and quantized.values.max().item() <= LEVELS


@pytest.mark.parametrize("numel,block", [(1, 1), (10, 3), (4096, 2048), (4097, 2048)])
def test_the_packed_buffer_holds_values_then_scales(numel: int, block: int) -> None:
    values = torch.randn(numel)
    quantized = quantize(values, block)
    buffer = pack(quantized)
    assert buffer.dtype == torch.uint8 and buffer.numel() == packed_bytes(numel, block)
    assert buffer.numel() == numel + 4 * -(-numel // block)
    back = unpack(buffer, numel)
    assert torch.equal(back.values, quantized.values) and torch.equal(back.scales, quantized.scales)
    into = torch.empty_like(buffer)
    assert torch.equal(pack(quantized, into), buffer)


@pytest.mark.parametrize("numel,block,parts", [(10, 3, 4), (4097, 2048, 3), (1, 1, 2)])
def test_shards_back_to_back_dequantize_at_once_as_each_alone(numel: int, block: int, parts: int) -> None:
    """An all-gather's output: every rank's packed shard, dequantized in one go, bit for bit as one by one."""
    shards = [torch.randn(numel) * 10 for _ in range(parts)]
    gathered = torch.cat([pack(quantize(shard, block)) for shard in shards])
    at_once = torch.empty(parts * numel, dtype=torch.bfloat16)
    dequantize_into(at_once, unpack(gathered, numel, parts=parts), block)
    for index, shard in enumerate(shards):
        assert torch.equal(at_once[index * numel : (index + 1) * numel], round_trip(shard, block, torch.bfloat16))
