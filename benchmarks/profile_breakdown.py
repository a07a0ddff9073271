"""Where one training step's time goes, from the torch profiler: compute, copies,
communication (issuing collectives and waiting for them), hooks, and the rest.

Every profiled event's *self* time (its time minus that of the events inside
it) lands in exactly one category, so the categories add up to the time the
profiler saw; what it did not see (Python between events, waits inside C++
that no event names, such as DDP's all-reduce wait at the end of backward)
is the remainder, "other". Frameworks name their own phases: ours
``zero::pre_forward``, ``zero::wait``, ..., FSDP2's ``FSDP::pre_forward``,
``FSDP::all_gather``, ...; DDP and DeepSpeed name little, so more of theirs
is "other".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

CATEGORIES = ("compute", "copies", "communication", "hooks", "other")

# Tensor copies: moving bytes, not computing (flattening, casting, gathering into place).
COPY_OPS = {
    "aten::copy_",
    "aten::cat",
    "aten::_to_copy",
    "aten::clone",
    "aten::_foreach_copy_",
    "aten::split_with_sizes_copy",
    "aten::_chunk_cat",
    "aten::index_copy_",
    "aten::contiguous",
}
# Issuing or waiting for a collective (the self time of these ranges is the wait or the call itself).
COMMUNICATION_MARKS = (
    "zero::all_gather",
    "zero::reduce_scatter",
    "zero::all_reduce",
    "zero::broadcast",
    "zero::wait",
    "FSDP::all_gather (",
    "FSDP::all_gather",
    "FSDP::post_backward_reduce",
    "FSDP::post_backward_rs_wait",
    "c10d::",
    "gloo",
    "nccl",
    "allreduce",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
)
HOOK_MARKS = ("zero::", "FSDP::", "DeepSpeed", "deepspeed")


def category_of(name: str) -> str:
    if name in COPY_OPS:
        return "copies"
    if name.startswith("FSDP::all_gather_copy") or name.startswith("FSDP::post_backward_accumulate"):
        return "hooks"  # the Python around FSDP2's copy-in/out; the copies inside count as copies
    if any(mark in name for mark in COMMUNICATION_MARKS):
        return "communication"
    if name.startswith(HOOK_MARKS):
        return "hooks"
    if name.startswith("aten::") or name.startswith("Optimizer") or "::" in name:
        return "compute"
    return "hooks" if "hook" in name.lower() else "other"


def categorise(events: Iterable[tuple[str, float]], wall_seconds: float) -> dict[str, float]:
    """``events``: (name, self seconds). Seconds per category; "other" is the wall time left over."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for name, self_seconds in events:
        seconds[category_of(name)] += self_seconds
    seconds["other"] += max(0.0, wall_seconds - sum(seconds.values()))
    return seconds


def profile_step(phases: list[Callable[[], None]]) -> dict[str, object]:
    """Run one step's phases under the torch profiler (CPU activities); the share of the
    profiled step's wall time per category (the profiler slows every op, so shares, not seconds)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        for phase in phases:
            phase()
        wall = time.perf_counter() - started
    events = [(event.key, event.self_cpu_time_total / 1e6) for event in profiler.key_averages()]
    seconds = categorise(events, wall)
    total = sum(seconds.values())
    shares = {name: value / total for name, value in seconds.items()}
    top = sorted(events, key=lambda e: -e[1])[:8]
    return {"shares": shares, "profiled_wall_s": wall, "top_self": [[name, round(s, 4)] for name, s in top]}
