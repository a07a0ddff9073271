"""Tensors to and from the NVMe tier's files, without the page cache.

Shared by the optimizer state's files (optim/nvme_state.py) and the parameter shards' (unit/shard_files.py).
Both keep a tensor's identity while its bytes are on disk: its storage is resized to zero bytes (FSDP2's
trick) and given its bytes back when read. Every write reaches the disk (``fdatasync``) and drops its pages
from the cache, and so does every read: cached pages are memory too, and a memory cap counts them.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import torch


class OffloadError(RuntimeError):
    """Reading or writing offloaded state failed (on some rank); raised alike on every rank.

    What it means: with ``offload_optimizer="nvme"`` or ``offload_params="nvme"`` the engine keeps
    optimizer state or parameters in files under ``offload_dir``; writing them (the disk is full, the
    directory is gone or not writable) or reading them back (a file is short or missing, no memory to
    read into) failed. The message names the cause, the file and the ranks it happened on. The last
    checkpoint is untouched.

    What to do: free disk space under ``offload_dir`` or choose another ``offload_dir`` (a local disk
    every rank can write, with room for what the setup line says goes to disk), or offload to
    ``"cpu"`` instead; then restart and resume from the last checkpoint.
    """


def succeeded(future: concurrent.futures.Future, failures: list[str]) -> bool:
    """Whether a read or write finished; if not, why goes to ``failures`` (to be agreed across ranks)."""
    try:
        future.result()
        return True
    except OSError as error:
        failures.append(f"{error.strerror or error}: {error.filename or ''}".rstrip(": "))
    except (RuntimeError, MemoryError) as error:  # no memory to read into: agreed alike too
        failures.append(f"{type(error).__name__}: {error}")
    return False


def agreed_failure(reported: list[str | None], what: str, found: str = "") -> OffloadError | None:
    """From every rank's first failure (None: none), in rank order: the error every rank raises alike."""
    ranks = [rank for rank, failure in enumerate(reported) if failure]
    if not ranks:
        return None
    return OffloadError(
        f"ZeRO: {what} could not be read or written ({reported[ranks[0]]}, on ranks {ranks}){found}. Free disk "
        "space or choose another offload_dir; the last checkpoint is untouched (resume from it)."
    )


def human_bytes(nbytes: float) -> str:
    """``1000 B``, ``3.72 MiB``, ``1.50 GiB``: the unit chosen by magnitude, so a figure never shows as zero (a
    directory of 1 MiB is not "0.00 GiB"), with at least three significant digits above 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} TiB"


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


def _drop_cached_pages(descriptor: int) -> None:
    if hasattr(os, "posix_fadvise"):  # Linux; elsewhere the kernel keeps what it likes
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, for file I/O. Not through ``.numpy()``: a storage shared with numpy
    can no longer be resized, and freeing is resizing to zero."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def free(tensor: torch.Tensor) -> None:
    """The tensor keeps its identity, shape and views; its storage holds no bytes."""
    tensor.untyped_storage().resize_(0)


def has_bytes(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


def write_tensors(path: Path, tensors: list[torch.Tensor]) -> None:
    """The tensors' bytes, one after the other, in ``path`` (replaced), on the disk when this returns."""
    with open(path, "wb") as file:
        for tensor in tensors:
            file.write(_bytes_of(tensor))
        file.flush()
        os.fdatasync(file.fileno())
        _drop_cached_pages(file.fileno())


def read_tensors(path: Path, tensors: list[torch.Tensor], offset: int = 0) -> None:
    """Give the tensors their bytes back and fill them from ``path`` (as ``write_tensors`` wrote them),
    from byte ``offset`` on (the tensors written before them skipped)."""
    for tensor in tensors:
        if not has_bytes(tensor):  # (resizing reallocates even at the same size)
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
    with open(path, "rb") as file:
        file.seek(offset)
        for tensor in tensors:
            view = _bytes_of(tensor)
            if file.readinto(view) != len(view):
                raise OSError(f"{path} is shorter than what was written to it")
        _drop_cached_pages(file.fileno())
