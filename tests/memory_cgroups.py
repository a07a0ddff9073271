"""Memory cgroups (the v1 controller) for tests that hold a job to a memory cap: made, entered, read, removed.

Each needs root and a writable ``/sys/fs/cgroup/memory``; the tests that use them skip elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")


def memory_cgroups_writable() -> bool:
    return MEMORY_CGROUPS.is_dir() and os.access(MEMORY_CGROUPS, os.W_OK)


def new_memory_cgroup(name: str, limit_bytes: int | None) -> Path:
    """A new group under the controller, limited to ``limit_bytes`` (None: not limited); the caller removes it
    (``group.rmdir()``) once its processes have ended."""
    group = MEMORY_CGROUPS / f"lightning-zero-test-{os.getpid()}-{name}"
    group.mkdir()
    if limit_bytes is not None:
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    return group


def entering(group: Path, command: list[str]) -> list[str]:
    """``command`` run in ``group``: the shell joins the group, then becomes the command (its children stay in)."""
    return ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *command]


def peak_bytes(group: Path) -> int:
    """The most memory the group has held so far: its processes' and the page cache charged to it."""
    return int((group / "memory.max_usage_in_bytes").read_text())


def oom_kills(group: Path) -> int:
    """How many processes the kernel killed in ``group`` for its limit."""
    fields = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return int(fields.get("oom_kill", 0))
