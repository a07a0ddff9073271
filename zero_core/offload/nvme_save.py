"""An NVMe save: the optimizer state's files read unit by unit for a reader (a save), the whole state never in
memory. (Its counterpart is ``nvme_load.py``; the checkpoint's side is ``checkpoint/nvme_load_reads.py``.)

A unit in memory is handed out as it is. A unit whose file holds it is read into tensors of the reader's own
(the master alone, or the per-element state alone), the last ``units_in_memory`` reads kept for the pieces
that follow, the tier's own tensors left as they are: nothing comes back into memory for good, so a run
whose optimizer state only fits on disk can save it. A read is out of date once a step or a load changed the
state (``StateFiles.generation``), and then read again.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..host_memory import release_freed_memory
from .state_files import StateFiles, UnitInFiles


class NvmeSaveReads:
    def __init__(self, tier: StateFiles):
        self.tier = tier
        self._kept: OrderedDict[tuple[int, str], tuple[int, dict[str, torch.Tensor]]] = OrderedDict()

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
