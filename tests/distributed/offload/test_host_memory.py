"""Huge-page advice for large host buffers: given only to a fresh mapping of the
buffer's own, never to heap memory that other tensors get later."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.paths import ROOT
from zero_core.host_memory import MIN_ADVISED_BYTES, advise_huge_pages

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")


def mapping_flags(address: int) -> set[str]:
    """The kernel's VmFlags of the mapping that holds ``address`` ("hg": huge pages advised)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_fresh_buffers_are_advised_and_small_ones_are_not() -> None:
    large = advise_huge_pages(torch.empty(MIN_ADVISED_BYTES // 4 + (4 << 20)))
    small = advise_huge_pages(torch.empty((MIN_ADVISED_BYTES // 4) // 2))
    assert "hg" in mapping_flags(large.data_ptr() + (large.nbytes // 2))
    assert "hg" not in mapping_flags(small.data_ptr())


def test_no_advice_where_large_blocks_may_come_from_the_heap() -> None:
    """With glibc told to put large blocks in the heap, advice would outlive the buffer there.
    Why a process of its own: glibc's malloc settings (`MALLOC_MMAP_THRESHOLD_`) are read once, at process start."""
    probe = (
        "import torch\n"
        "from zero_core.host_memory import advise_huge_pages\n"
        "from tests.distributed.offload.test_host_memory import mapping_flags\n"
        "x = advise_huge_pages(torch.empty(48 << 18))\n"
        "print('hg' in mapping_flags(x.data_ptr() + x.nbytes // 2))\n"
    )
    root = ROOT
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 30), "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, cwd=root
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False"
