"""Where a benchmark's rank runs: the machine's cores split between the ranks, rank r on its own share.

Rank r of every world gets the same cores (``benchmarks/stepping_rank.py``: both sides of a comparison;
``benchmarks/collective_cost.py``: as the guard's ranks run), so where the scheduler put a process, and moved
it, is no difference between them; with one core per rank, what a rank's threads spend (gloo's included) is
taken from its own compute.
"""

from __future__ import annotations

import os


def take_own_cores(rank: int, world_size: int, pin: bool) -> int:
    """Pin this process to rank ``rank``'s share of the cores it may use (``pin`` false: leave it where the
    scheduler puts it); returns the share's size, the threads a rank should compute on."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // world_size)
    if pin:
        first = (rank * per_rank) % len(cores)
        os.sched_setaffinity(0, cores[first : first + per_rank])
    return per_rank
