"""Values and flags every rank must see alike (a flag is true everywhere if true on any rank), on the one
packing every agreement of integers rides on: each value and its negation, all-reduced with MAX, give its
highest and lowest over ranks in a single collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives  # looked up at call time: one place to stand in for every agreement's collectives
from ..collectives import DIVERGENCE_ADVICE, CollectiveFailed, CommContext


def true_on_any_rank(
    comm: CommContext, flags: list[bool], what: str, must_agree: dict[str, int] | None = None
) -> list[bool]:
    """Per position: true on every rank if true on any rank.

    Ranks that disagree on how many flags there are, or on any value of
    ``must_agree`` (integers below 2**52, checked in the same call), get the
    same error.
    """
    # The counts first, in a tensor of fixed size: all-reducing tensors of
    # different sizes is itself a mismatch no check could report.
    agree_on_values(comm, {f"{what} (how many)": len(flags), **(must_agree or {})}, what)
    tensor = torch.tensor([float(f) for f in flags], dtype=torch.float32, device=comm.device)
    collectives.all_reduce(comm, tensor, dist.ReduceOp.MAX, label=what).wait()
    return [v > 0 for v in tensor.tolist()]


def agree_on_values(comm: CommContext, checks: dict[str, int], what: str) -> None:
    """Every rank holds the same value of each check (integers below 2**52), or every rank raises the
    same error naming those that differ: one small all-reduce."""
    agreed = torch.tensor(with_negations(list(checks.values())), dtype=torch.float64, device=comm.device)
    collectives.all_reduce(comm, agreed, dist.ReduceOp.MAX, label=what).wait()
    differing = differing_values(checks, agreed.tolist())
    if differing:
        raise CollectiveFailed(f"ZeRO: ranks disagree on {'; '.join(differing)}.\n{DIVERGENCE_ADVICE}")


def with_negations(values: list[float]) -> list[float]:
    """``values`` then their negations: after a MAX all-reduce, each value's highest then lowest (negated)."""
    return [*values, *(-v for v in values)]


def differing_values(checks: dict[str, int], reduced: list[float]) -> list[str]:
    """``reduced`` ends with ``checks``' values then their negations, all-reduced with MAX
    (each value's highest and lowest over ranks): the values that differ between ranks,
    each as "name: lowest on some ranks, highest on others"; empty when all agree."""
    count = len(checks)
    highest = reduced[len(reduced) - 2 * count : len(reduced) - count]
    lowest = [-v for v in reduced[len(reduced) - count :]]
    return [
        f"{name}: {int(lo)} on some ranks, {int(hi)} on others"
        for name, lo, hi in zip(checks, lowest, highest)
        if lo != hi
    ]
