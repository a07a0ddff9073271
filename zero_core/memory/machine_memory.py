"""What memory a rank has: ``memory_budget="auto"``'s device part, read at setup; and what the host can still
give now (an asynchronous save's staged copy is checked against it).

A GPU's memory is its own (shared by the ranks that drive the same device). On a CPU the ranks share the host:
each gets its share of the smaller of the host's memory and its control group's limit (ranks in one group
share its limit; a rank in a group of its own, as the cap tests make, has it alone). The ranks take the
smallest share over them, so every rank chooses the same settings.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives
from ..collectives import CommContext

CGROUP_ROOT = Path("/sys/fs/cgroup")


def host_memory_bytes() -> int:
    """The host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_memory_limit() -> tuple[str, int | None]:
    """(this process's memory control group, its limit in bytes or None when unlimited or unreadable)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "", None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1
            return path, _limit(CGROUP_ROOT / "memory" / path.lstrip("/") / "memory.limit_in_bytes")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2's unified hierarchy
            return path, _limit(CGROUP_ROOT / path.lstrip("/") / "memory.max")
    return "", None


def available_host_memory_bytes() -> int:
    """What the host can still give this process now: the kernel's estimate of available memory
    (``MemAvailable``: free memory and the caches it can drop), or less where this process's control group
    is nearer its limit."""
    available = host_memory_bytes()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # not Linux: the host's physical memory is the bound
    group, limit = cgroup_memory_limit()
    used = _cgroup_usage(group) if limit is not None else None
    if limit is not None and used is not None:
        available = min(available, limit - used)
    return max(available, 0)


def _cgroup_usage(group: str) -> int | None:
    """The bytes charged to the control group now (v1's usage_in_bytes, or v2's memory.current)."""
    for file in (
        CGROUP_ROOT / "memory" / group.lstrip("/") / "memory.usage_in_bytes",
        CGROUP_ROOT / group.lstrip("/") / "memory.current",
    ):
        try:
            return int(file.read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def _limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max": no limit
        return None
    limit = int(text)
    return limit if limit < host_memory_bytes() else None  # v1 writes a huge number for no limit


def device_memory_per_rank(comm: CommContext) -> int:
    """The smallest, over ranks, of each rank's share of its device's memory (the same on every rank)."""
    host = socket.gethostname()
    if comm.device.type == "cuda":
        index = comm.device.index if comm.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        sharing = (host, f"cuda:{index}")
        places = collectives.all_gather_objects(comm, sharing, label="memory_budget auto: devices")
        share = total // places.count(sharing)
    elif comm.device.type == "cpu":
        group, limit = cgroup_memory_limit()
        places = collectives.all_gather_objects(comm, (host, group), label="memory_budget auto: hosts")
        share = host_memory_bytes() // sum(place[0] == host for place in places)
        if limit is not None:
            share = min(share, limit // places.count((host, group)))
    else:
        raise ValueError(
            f'memory_budget "auto" reads the memory of CUDA devices and of the host; this run is on '
            f"{comm.device.type}: give the budget in bytes per rank."
        )
    smallest = torch.tensor([share], dtype=torch.float64, device=comm.device)
    collectives.all_reduce(comm, smallest, dist.ReduceOp.MIN, label="memory_budget auto").wait()
    return int(smallest.item())
