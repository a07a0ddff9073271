"""Tensors to and from the file tiers' files, without the page cache: I/O only.

Shared by the optimizer state's files (``state_files.py``) and the parameter shards' (``shard_files.py``).
Both keep a tensor's identity while its bytes are on disk: its storage is resized to zero bytes (FSDP2's
trick) and given its bytes back when read. Every write reaches the disk (``fdatasync``) and drops its pages
from the cache, and so does every read: cached pages are memory too, and a memory cap counts them.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch


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
    """The tensors' bytes, one after the other, in ``path`` (replaced), on the disk when this returns.

    Over the old file's bytes, unless another name links them (an asynchronous save's snapshot,
    ``nvme_save.FrozenNvmeReads``): then as a new file renamed over the old, so that the link keeps what it held.
    Only then: a new file each step would need the disk to hold a second copy of the unit while it is written."""
    linked = path.exists() and path.stat().st_nlink > 1
    writing = path.with_name(path.name + ".writing") if linked else path
    try:
        with open(writing, "wb") as file:
            for tensor in tensors:
                file.write(_bytes_of(tensor))
            file.flush()
            os.fdatasync(file.fileno())
            _drop_cached_pages(file.fileno())
        if linked:
            os.replace(writing, path)
    except BaseException:
        if linked:
            writing.unlink(missing_ok=True)
        raise


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
