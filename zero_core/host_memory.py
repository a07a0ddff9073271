"""Large host buffers that fault in as huge pages; pinned buffers for offload; freed memory handed back.

Stage 3 refills each unit's parameter storage for every gather, and stages
2/3 allocate each unit's full gradient buffer for every backward. On the CPU
an allocation that large is a fresh ``mmap`` (glibc maps every block above
32 MiB itself and unmaps it when freed), so the first touch of each 4 KiB
page faults, and the kernel zeroes it: for a 50 MB unit that costs several
times the copy that fills it (measured in benchmarks/NOTES.md, "Huge
pages"). Advising huge pages on the fresh mapping before its first touch
is what torch does for every allocation under ``THP_MEM_ALLOC_ENABLE=1``;
here it is done for these buffers only, and changes nothing else about the
process. Where the kernel has transparent huge pages off, or the call is
not available (not Linux), the advice is a no-op.

The advice pays only on a fresh mapping of the buffer's own. A block inside
the heap was touched before and is reused without faults, and advising it
would split the heap's mapping and leave the advice behind on memory that
other tensors get later. So nothing is advised when the allocator may place
large blocks in the heap (glibc's ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_MMAP_MAX_`` set, or another allocator preloaded), nor any buffer
that lies below the program break (the main heap).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

import torch

# Below glibc's largest mmap threshold a block may sit inside the heap, where advice would
# split the heap's mapping for no gain (freed heap blocks are reused without faulting).
MIN_ADVISED_BYTES = 32 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 << 20


def _load_libc_calls():
    """(madvise, sbrk), or None where the advice would not pay or not be safe."""
    if not sys.platform.startswith("linux"):
        return None
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_MMAP_MAX_" in os.environ:
        return None  # large blocks may come from the heap
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return None  # another allocator: its blocks are not ours to advise
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise, sbrk = libc.madvise, libc.sbrk
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    sbrk.argtypes = (ctypes.c_ssize_t,)
    sbrk.restype = ctypes.c_void_p
    return madvise, sbrk


_LIBC_CALLS = _load_libc_calls()


def advise_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """Ask for huge pages behind ``tensor``'s storage, before anything touches it.

    Only the 2 MiB-aligned middle of the storage is advised: a huge page never
    reaches memory outside the buffer. Returns ``tensor``.
    """
    if _LIBC_CALLS is None or tensor.device.type != "cpu":
        return tensor
    storage = tensor.untyped_storage()
    if storage.nbytes() < MIN_ADVISED_BYTES:
        return tensor
    madvise, sbrk = _LIBC_CALLS
    start = storage.data_ptr()
    if start < (sbrk(0) or 0):
        return tensor  # inside the main heap: not a mapping of its own
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = (start + storage.nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if last > first:
        madvise(first, last - first, _MADV_HUGEPAGE)  # advice: a refusal changes nothing
    return tensor


def host_zeros(numel: int, dtype: torch.dtype, for_device: torch.device) -> torch.Tensor:
    """A host buffer that copies to and from ``for_device`` go through (offload): page-locked when that is
    a GPU, so the copies run asynchronously at the link's speed; plain memory when the device is the host."""
    return torch.zeros(numel, dtype=dtype, pin_memory=for_device.type == "cuda")


def wait_for_host_copies(device: torch.device) -> None:
    """The asynchronous device-to-host copies issued so far on ``device``'s current stream have landed
    (nothing to wait for when the device is the host)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def copy_to_device(
    device_shard: torch.Tensor, host_shard: torch.Tensor, stream: torch.cuda.Stream | None
) -> torch.cuda.Event | None:
    """A parameter shard from host memory into its device buffer ahead of its all-gather (offload_params). On
    a GPU the copy runs on ``stream``, the all-gather's side stream, after what the compute stream issued
    (the buffer was just allocated there): it overlaps compute, and the all-gather issued next on that stream
    runs after it. Returns an event recorded after the copy, which the host waits for before it writes
    ``host_shard`` again (None: the copy is done). On a CPU device, a plain copy."""
    if stream is None or not device_shard.is_cuda:
        device_shard.copy_(host_shard)
        return None
    stream.wait_stream(torch.cuda.current_stream(device_shard.device))
    with torch.cuda.stream(stream):
        device_shard.copy_(host_shard, non_blocking=host_shard.is_pinned())
        return stream.record_event()


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc: its allocator returns memory by its own rules


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> None:
    """Hand the memory of freed tensors back to the system now. glibc keeps freed blocks below its
    (dynamic) mmap threshold in the heap, so without this a freed unit's bytes would still count
    against the process's memory (and a memory cap) as if they were in memory."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
