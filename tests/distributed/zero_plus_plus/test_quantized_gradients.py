"""ZeRO++'s quantized gradients (qgZ), the collectives themselves: pieces reach the rank that owns them, in
one hop or two; errors stay within the quantizer's half step per contribution; replicas stay equal; the
bytes on each link are the formula's; the memory each quantized collective allocates is what the estimate
says. Training with it is tested in ``tests/distributed/zero_plus_plus/test_zero_plus_plus.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.quantized_gradient_workers import BLOCK, PIECE, reductions
from tests.rank_pool import run_distributed
from zero_core.quantization import levels, packed_bytes

LAYOUTS = {"flat": (4, 1), "two_hops": (4, 2), "hybrid": (2, 1)}  # shard group size, hops


@pytest.fixture(scope="module")
def at_four() -> list[dict[str, Any]]:
    return run_distributed(reductions, 4, timeout=300)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_piece_reaches_the_rank_that_owns_it(at_four: list[dict[str, Any]], layout: str, bits: int) -> None:
    """Blocks of constants quantize exactly at every hop: the result is the exact sum, so a piece sent to the
    wrong rank (or a row of the two-hop transpose out of place) cannot hide in the tolerance."""
    assert all(ranked[f"{layout}-{bits}-routed"] for ranked in at_four)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_error_is_within_half_a_step_per_contribution(
    at_four: list[dict[str, Any]], layout: str, bits: int
) -> None:
    """Each hop adds at most half a step of each block it quantizes; the second hop quantizes partial sums,
    whose largest magnitude is at most the sum of their parts'."""
    group_size, hops = LAYOUTS[layout]
    for rank, ranked in enumerate(at_four):
        first = rank - rank % group_size
        inputs = torch.stack([at_four[r][f"{layout}-{bits}-inputs"] for r in range(first, first + group_size)])
        mine = inputs[:, (rank % group_size) * PIECE : (rank % group_size + 1) * PIECE]
        amax = mine.abs().view(group_size, -1, BLOCK).amax(dim=2).sum(dim=0)  # per output block
        bound = hops * amax / (2 * levels(bits)) * (1 + 1e-4) + 1e-6
        error = ranked[f"{layout}-{bits}-error"].view(-1, BLOCK).amax(dim=1)
        assert (error <= bound).all(), (rank, (error / bound).max())
        assert error.max() > 0  # quantized, not sent exactly


def test_two_hops_send_a_quarter_of_bf16_across_the_secondary_groups(at_four: list[dict[str, Any]]) -> None:
    """4 ranks as 2 nodes of 2: the first hop moves this rank's gradient inside its node (2 rows of the two
    shards at its place), the second only its 2 shards' partial sums across nodes: int4 blocks, 1/4 of bf16's
    2 bytes per element plus one fp32 scale per block."""
    for ranked in at_four:
        spans = ranked["two_hops-4-spans"]
        assert spans["SECONDARY"] == 2 * packed_bytes(2 * PIECE, BLOCK, 4)
        assert spans["ACROSS_SECONDARY"] == 2 * packed_bytes(PIECE, BLOCK, 4)
        bf16_across = 2 * PIECE * 2
        assert spans["ACROSS_SECONDARY"] / bf16_across == pytest.approx(0.25 * (1 + 8 / BLOCK))
        assert spans["SHARD_GROUP"] == spans["WORLD"] == 0
        assert ranked["flat-4-spans"]["SHARD_GROUP"] == 4 * packed_bytes(PIECE, BLOCK, 4)  # one hop
        assert ranked["flat-8-spans"]["SHARD_GROUP"] == 4 * packed_bytes(PIECE, BLOCK, 8)


def test_across_groups_every_replica_holds_the_same_sum(at_four: list[dict[str, Any]]) -> None:
    """Hybrid sharding's all-reduce across groups: a quantized all-to-all of the pieces, then a quantized
    all-gather every replica dequantizes alike (its own piece too), so the replicas' masters never drift."""
    piece = -(-(PIECE + 3) // 2)
    for ranked in at_four:
        assert ranked["across-equal"]
        assert 0 < ranked["across-error"] <= 3 * ranked["across-amax"] / (2 * levels(8))
        # The all-to-all and the all-gather: 2 rows of packed int8 each. Per element of the shard a rank sends
        # half a piece each way: 1/2 of a bf16 ring all-reduce's bytes with int8 (1/4 with int4) plus scales.
        assert ranked["across-spans"]["ACROSS_GROUPS"] == 2 * 2 * packed_bytes(piece, BLOCK, 8)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_collective_allocates_what_the_estimate_says(at_four: list[dict[str, Any]], layout: str) -> None:
    """The peak of what a quantized gather, reduce or all-reduce allocates (every allocation and free the
    profiler saw) against the working-bytes formulas zero-estimate reports: the packed buffers that arrived and
    the float32 pass. The formulas count the packed buffers to the end of the call, as a backend may hold them
    (gloo lets them go when its worker thread is done, sooner or later): a bound that is reached (under load,
    in the full suite), never passed."""
    for ranked in at_four:
        for name, (measured, formula) in ranked[f"{layout}-working"].items():
            assert 0.6 * formula <= measured <= 1.02 * formula, (name, measured, formula)
