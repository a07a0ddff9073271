"""An NVMe save: the optimizer state's files read unit by unit for a reader (a save), the whole state never in
memory. (Its counterpart is ``nvme_load.py``; the checkpoint's side is ``checkpoint/nvme_load_reads.py``.)

A unit in memory is handed out as it is. A unit whose file holds it is read into tensors of the reader's own
(the master alone, or the per-element state alone), the last ``units_in_memory`` reads kept for the pieces
that follow, the tier's own tensors left as they are: nothing comes back into memory for good, so a run
whose optimizer state only fits on disk can save it. A read is out of date once a step or a load changed the
state (``StateFiles.generation``), and then read again.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from ..host_memory import release_freed_memory
from .state_files import StateFiles, UnitInFiles
from .unit_file import read_part


class NvmeSaveReads:
    def __init__(self, tier: StateFiles):
        self.tier = tier
        self._kept: OrderedDict[tuple[int, str], tuple[int, dict[str, torch.Tensor]]] = OrderedDict()

    def rests_frozen(self, unit: UnitInFiles) -> bool:
        """Whether the unit's values are read from a file no later step writes (``FrozenNvmeReads``)."""
        return False

    def frozen(self) -> FrozenNvmeReads | None:
        """These reads over hard links to the resting units' files as they are now, which the next steps leave
        alone (the tier writes a file another name links as a new file, ``file_io.write_tensors``): an
        asynchronous save stages them without reading them. None where a link cannot be made, or where the disk
        has no room to keep the linked files beside the ones the next steps write: the caller reads them now."""
        self.tier.settle_behind()  # the files hold what the last walk wrote
        resting = [index for index in range(len(self.tier.states)) if self.tier.needs_read(index)]
        if not resting:
            return None
        linked_bytes = sum(self.tier.states[index].nbytes for index in resting)
        directory = self.tier.directory / f"checkpoint-snapshot-{uuid.uuid4().hex}"
        try:
            if shutil.disk_usage(self.tier.directory).free < linked_bytes:
                return None
            directory.mkdir()
            links = {}
            for index in resting:
                links[index] = directory / self.tier.states[index].path.name
                os.link(self.tier.states[index].path, links[index])
        except OSError:  # no hard links on this filesystem, or no room: read now
            shutil.rmtree(directory, ignore_errors=True)
            return None
        return FrozenNvmeReads(self, directory, links)

    def master(self, unit: UnitInFiles) -> torch.Tensor:
        """The unit's fp32 master shard, as it is now (from its file when it rests there)."""
        read = self._read(unit.index, "master")
        return unit.storage.resting_master if read is None else read["master"]

    def state_key(self, unit: UnitInFiles, value: torch.Tensor) -> str | None:
        """The key of the tier's buffer that ``value`` (an optimizer-state tensor of the unit) is a view of;
        None when it is not one (a unit that stays in memory, or state loaded and not yet stepped)."""
        for key, buffer in self.tier.states[unit.index].buffers.items():
            if value.untyped_storage() is buffer.untyped_storage():
                return key
        return None

    def per_element(self, unit: UnitInFiles, key: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a view of the unit's ``key`` buffer), as it is now (from its file when it rests there)."""
        if self.state_key(unit, value) != key:
            raise RuntimeError(
                "ZeRO: the optimizer state this sharded state dict points at was replaced since it was taken (a "
                "load, or the optimizer attached again). Take the state dict again right before saving it."
            )
        read = self._read(unit.index, "state")
        if read is None:
            return value
        start = value.storage_offset() - self.tier.states[unit.index].buffers[key].storage_offset()
        return read[key][start : start + value.numel()]

    def _read(self, index: int, part: str) -> dict[str, torch.Tensor] | None:
        """The part read from the unit's file (kept from an earlier call while up to date); None: in memory."""
        self.tier.settle_behind()
        if not self.tier.needs_read(index):
            return None
        generation = self.tier.generation
        kept = self._kept.pop((index, part), None)
        if kept is not None and kept[0] == generation:
            self._kept[(index, part)] = kept  # most recently used last
            return kept[1]
        evicted = False
        while len(self._kept) >= max(1, self.tier.units_in_memory):  # room first: the bound holds during the read
            self._kept.popitem(last=False)
            evicted = True
        if evicted:
            release_freed_memory()  # what the save's writes freed too: else the heap keeps it
        read = self.tier.read_resting(index, part)
        if read is not None:
            self._kept[(index, part)] = (generation, read)
        return read


class FrozenNvmeReads(NvmeSaveReads):
    """An asynchronous save's reads of the NVMe tier: the units that rested in files are read from hard links
    made at staging (``NvmeSaveReads.frozen``), in the writer's thread, a few units at a time; the units in
    memory then are read (and staged) as the live reads give them. ``close`` removes the links."""

    def __init__(self, live: NvmeSaveReads, directory: Path, links: dict[int, Path]):
        super().__init__(live.tier)
        self.directory, self.links = directory, links
        tier = live.tier
        # What the reads need of the tier, taken now: the next steps replace the tier's records.
        self._layout = {
            index: (
                tier.units[index].storage.resting_master.numel(),
                tier.states[index].master is not None,
                dict(tier.states[index].dtypes),
                {key: buffer.storage_offset() for key, buffer in tier.states[index].buffers.items()},
            )
            for index in links
        }
        self._frozen_kept: OrderedDict[tuple[int, str], dict[str, torch.Tensor]] = OrderedDict()

    def rests_frozen(self, unit: UnitInFiles) -> bool:
        return unit.index in self.links

    def master(self, unit: UnitInFiles) -> torch.Tensor:
        if unit.index not in self.links:
            return super().master(unit)
        return self._read_link(unit.index, "master")["master"]

    def per_element(self, unit: UnitInFiles, key: str, value: torch.Tensor) -> torch.Tensor:
        if unit.index not in self.links:
            return super().per_element(unit, key, value)
        start = value.storage_offset() - self._layout[unit.index][3][key]
        return self._read_link(unit.index, "state")[key][start : start + value.numel()]

    def _read_link(self, index: int, part: str) -> dict[str, torch.Tensor]:
        kept = self._frozen_kept.pop((index, part), None)
        if kept is None:
            while len(self._frozen_kept) >= max(1, self.tier.units_in_memory):
                self._frozen_kept.popitem(last=False)
            numel, with_master, dtypes, _ = self._layout[index]
            kept = read_part(self.links[index], numel, with_master, dtypes, part)
        self._frozen_kept[(index, part)] = kept  # most recently used last
        return kept

    def close(self) -> None:
        self._frozen_kept.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
