"""A save that ran out of disk space, told as such: the free bytes and what the save writes.

A filesystem that fills up in the middle of a tensor's ``torch.save`` surfaces as torch's zip
writer's own words ("unexpected pos 704 vs 598", "PytorchStreamWriter failed writing file"), and
DCP hands the failures of every rank around pickled, which drops the ``OSError`` (ENOSPC) beneath
them. So a failure counts as a full disk when ENOSPC or those words appear anywhere in it, and the
checkpoint's filesystem, looked at then, has less room left than this rank's part of the save (or
under 1 MiB): the same words with room to spare are some other failure, told as it is.
Each rank reports what it writes and what was free before the save began; the message is made
from every rank's report, so it reads the same everywhere.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItem

from ..sizes import human_bytes

# torch's zip writer when a write comes up short (its words for ENOSPC), and the OS's own.
_FULL_WORDS = ("unexpected pos", "pytorchstreamwriter failed writing file", "no space left on device")
# Per item besides its tensor's bytes: torch.save's zip records around it (about 1.5 KiB) and its entries
# in .metadata and the manifest (about 350 bytes), as measured on torch 2.13.
_ITEM_OVERHEAD = 1536 + 384
_AT_LEAST_FREE = 1 << 20  # less free than this is full, however small this rank's part (blocks, other writers)


class SpaceReport(NamedTuple):
    """One rank's: the bytes its part of the save writes, the bytes free before the save, and whether its
    failure is the filesystem running out of space."""

    needed: int
    free_before: int
    full: bool = False


class SaveSpace:
    """What a save writes on this rank (added as DCP plans it) against the room on ``directory``'s filesystem."""

    def __init__(self, path: Path, directory: Path):
        self.path = path  # what messages name: the checkpoint
        self.directory = directory
        self.free_before = free_bytes(directory)  # before any rank writes (every rank measures first)
        self.needed = 0

    def add(self, size: int) -> None:
        self.needed += size

    def report(self, error: BaseException | None) -> SpaceReport:
        full = error is not None and _says_full(error) and free_bytes(self.directory) < max(self.needed, _AT_LEAST_FREE)
        return SpaceReport(self.needed, self.free_before, full)


def planned_bytes(items: Sequence[WriteItem]) -> int:
    """What saving these items writes: each tensor's bytes, torch.save's records around each item, and its
    entries in the files that index them."""
    total = 0
    for item in items:
        total += _ITEM_OVERHEAD
        if item.tensor_data is not None:  # this rank's piece of the tensor (``size`` is the whole tensor's)
            numel = 1
            for size in item.tensor_data.chunk.sizes:
                numel *= size
            total += numel * item.tensor_data.properties.dtype.itemsize
    return total


def free_bytes(directory: Path) -> int:
    """Free bytes (for this user) on the filesystem holding ``directory`` or its nearest existing parent."""
    for place in (directory, *directory.parents):
        try:
            return shutil.disk_usage(place).free
        except OSError:
            continue
    return 0


def disk_full_message(path: Path, reports: Sequence[SpaceReport]) -> str:
    """The cause every rank gives for a save that filled the filesystem (``reports``: every rank's)."""
    needed = sum(report.needed for report in reports)
    free = min(report.free_before for report in reports)
    if needed > free:
        advice = f"free at least {size_text(needed - free)} more there, or save elsewhere"
    else:  # the estimate fell short, or something else wrote there meanwhile
        advice = "it filled up during the save: free more space there, or save elsewhere"
    return (
        f"No space left on device: the filesystem holding {path} had {size_text(free)} free when the save "
        f"began, and this save writes about {size_text(needed)} (every rank's files); "
        f"{advice}"
    )


def size_text(size: int) -> str:
    """Bytes exactly, and in a unit that never rounds a non-zero size to zero."""
    return f"{size} bytes" if size < 1024 else f"{size:,} bytes ({human_bytes(size)})"


def _says_full(error: BaseException) -> bool:
    for seen in _errors_in(error):
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if any(words in str(seen).lower() for words in _FULL_WORDS):
            return True
    return False


def _errors_in(error: BaseException) -> Iterator[BaseException]:
    """``error``, what caused it, and (for DCP's) every rank's failure and its causes."""
    stack: list[BaseException | None] = [error]
    seen: set[int] = set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, CheckpointException):
            stack.extend(failure for failure, _ in current.failures.values())
        stack.extend((current.__cause__, current.__context__))
