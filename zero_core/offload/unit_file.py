"""The one layout of a unit's file in the optimizer state's tier, ``unit<i>.bin``: written and read here only.

The unit's fp32 master shard first, when it rests there (a tensor of its own: ``UnitOffload.master_in_file``),
then one flat buffer per per-element state key (Adam's two moments, SGD's momentum), each as long as the
master shard, in the order of the keys. The step's tier (:class:`UnitFile`), the save's unit-by-unit reads
and the load's staged files (:func:`write_unit_file`, :func:`read_part`) all go through this layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .file_io import free, read_tensors, write_tensors

MASTER_DTYPE = torch.float32


def write_unit_file(path: Path, master: torch.Tensor | None, state: dict[str, torch.Tensor]) -> None:
    """A unit's file at ``path`` (replaced), in the layout: ``master`` (None: it does not rest there), then
    ``state``'s buffers in its order."""
    write_tensors(path, ([master] if master is not None else []) + list(state.values()))


def read_part(
    path: Path, numel: int, with_master: bool, dtypes: dict[str, torch.dtype], part: str
) -> dict[str, torch.Tensor]:
    """One part of a unit's file (``with_master``: the master rests there; ``dtypes``: its state keys, in file
    order, each ``numel`` long), read into new tensors: ``part`` "master" (under that key; none when it does
    not rest there) or "state" (by key)."""
    if part == "master":
        wanted = {"master": MASTER_DTYPE} if with_master else {}
    else:
        wanted = dtypes
    copies = {key: torch.empty(numel, dtype=dtype) for key, dtype in wanted.items()}
    master_bytes = numel * MASTER_DTYPE.itemsize if with_master and part != "master" else 0
    read_tensors(path, list(copies.values()), offset=master_bytes)
    return copies


@dataclass
class UnitFile:
    """One unit's state and its file: its master shard (when it rests there) and a flat buffer per state key,
    each piece's tensor a view of it."""

    path: Path
    master: torch.Tensor | None = None  # the unit's fp32 master shard, when it is a tensor of its own
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    resident: bool = True  # the tensors hold their bytes (else their storage is empty and the file holds them)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return ([self.master] if self.master is not None else []) + list(self.buffers.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        return {key: buffer.dtype for key, buffer in self.buffers.items()}

    def free(self) -> None:
        for tensor in self.tensors:
            free(tensor)
        self.resident = False

    def write(self) -> None:
        write_unit_file(self.path, self.master, self.buffers)

    def read(self) -> None:
        """Give the tensors their bytes back and fill them from the file."""
        read_tensors(self.path, self.tensors)
        self.resident = True
