"""An NVMe load: a checkpoint loaded into the optimizer state's files a unit at a time, all or nothing.
(Its counterpart is ``nvme_save.py``; the checkpoint's DCP reads are ``checkpoint/nvme_load_reads.py``.)

While a load reads, each unit of the tier gets its loaded values one unit at a time, written beside its file:
the per-element state and a master that rests in the file to ``unit<i>.bin.loaded``, in the file's layout
(``unit_file.py``; what the load does not replace, the master when only the optimizer is loaded or the state
when only the weights are, is copied over from the unit's current values); a master that stays in memory (fp32 on a CPU
device: the parameters' own memory) to ``unit<i>.master.loaded``. Nothing of the unit changes until every
rank has read everything: then :meth:`NvmeLoad.install` puts each file in place, the optimizer's state of
the unit becomes views of new buffers that rest on disk, and the unit's master (or, resting on disk, its
compute copy) takes the loaded values. A load that fails anywhere removes the files
(:meth:`NvmeLoad.discard`). So a run whose optimizer state fits only on disk can resume, holding
a few units' state in memory at a time. The staged files sit beside the units' own until then: before a load
reads anything, every rank says what it will stage and what is free (:meth:`NvmeLoad.room`), and a load that
does not fit is refused on every rank alike (:func:`room_problem`), rather than failing part-way on a full disk.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..host_memory import release_freed_memory
from ..sizes import human_bytes
from .file_io import free, has_bytes
from .state_files import StateFiles, UnitInFiles
from .unit_file import read_part, write_unit_file

STAGED_SUFFIX = ".loaded"  # the files of a load not yet put in place


@dataclass
class _StagedUnit:
    path: Path
    master_path: Path | None  # a loaded master that stays in memory, until it is installed
    dtypes: dict[str, torch.dtype]  # its per-element buffers, in file order
    pieces: list[tuple[Any, str]] = field(default_factory=list)  # loaded state: (piece, key) to install
    loaded_master: bool = False
    loaded_state: bool = False


@dataclass(frozen=True)
class StagingRoom:
    """One rank's offload_dir as a load starts: what the load will stage there, and what is free."""

    rank: int
    root: str
    filesystem: tuple[str, int]  # (host, device): the ranks on one filesystem share its free bytes
    free: int
    needed: int


def _filesystem(path: Path) -> tuple[str, int]:
    return socket.gethostname(), os.stat(path).st_dev


def room_problem(rooms: Sequence[StagingRoom]) -> str | None:
    """Every rank's room (in rank order): where a load's staged files do not fit, said alike on every rank, or
    None. Ranks on one filesystem (a node's ranks sharing one disk) are counted together against its free bytes:
    each alone may fit where all of them do not."""
    shared: dict[tuple[str, int], list[StagingRoom]] = {}
    for room in rooms:
        shared.setdefault(room.filesystem, []).append(room)
    problems = []
    for group in shared.values():
        needed, free = sum(r.needed for r in group), min(r.free for r in group)
        if needed <= free:
            continue
        if len(group) == 1:
            where = f"rank {group[0].rank}'s offload_dir {group[0].root}"
        else:
            each = ", ".join(f"rank {r.rank} {human_bytes(r.needed)}" for r in group)
            where = (
                f"the offload_dir {group[0].root} of ranks {', '.join(str(r.rank) for r in group)} (one disk: {each})"
            )
        problems.append(f"{where} has {human_bytes(free)} free and the load stages {human_bytes(needed)} there")
    if not problems:
        return None
    return (
        "ZeRO: loading this checkpoint stages a copy of the offloaded optimizer state in offload_dir, beside the "
        f"state, until every rank has read it, and it does not fit: {'; '.join(problems)}. Free space there and "
        "load again"
    )


class NvmeLoad:
    def __init__(self, tier: StateFiles):
        self.tier = tier
        self.units: dict[int, _StagedUnit] = {}
        tier.settle_behind()  # the last step's writes done (and their units freed) before the load reads

    def takes(self, unit: UnitInFiles) -> bool:
        """Whether the unit's state rests in the tier's files (its load goes through a staged file)."""
        return unit.index in self.tier.offloaded

    def room(self, load_model: bool, loaded_state: Mapping[int, Iterable[torch.dtype]] | None) -> StagingRoom:
        """What this load will stage beside the tier's files, and what is free there now. ``loaded_state``: the
        dtypes of each unit's per-element state in the checkpoint (None: no optimizer state is loaded, the
        unit's own is copied over). A staged file that an earlier read of this load wrote (the model, when the
        optimizer comes from a directory of its own) is written over in place: its bytes are counted as free.
        (The parameter shards' files of offload_params="nvme" are rewritten in place once the load is applied:
        they stage nothing.)"""
        needed = sum(self._bytes_to_stage(index, load_model, loaded_state) for index in self.tier.offloaded)
        rewritten = sum(staged.path.stat().st_size for staged in self.units.values() if staged.path.exists())
        path = self.tier.directory
        free = shutil.disk_usage(path).free
        needed = max(0, needed - rewritten)
        return StagingRoom(self.tier.comm.rank, str(self.tier.offload_dir), _filesystem(path), free, needed)

    def _bytes_to_stage(
        self, index: int, load_model: bool, loaded_state: Mapping[int, Iterable[torch.dtype]] | None
    ) -> int:
        state, earlier, unit = self.tier.states[index], self.units.get(index), self.tier.units[index]
        if loaded_state is not None:
            dtypes = list(loaded_state.get(index, ()))
        elif earlier is not None:
            dtypes = list(earlier.dtypes.values())
        else:
            dtypes = [buffer.dtype for buffer in state.buffers.values()]
        # The master: in the unit's staged file where it rests in the unit's file, else, if loaded, in its own.
        with_master = state.master is not None or load_model
        return unit.storage.resting_master.numel() * (
            with_master * unit.storage.resting_master.element_size() + sum(d.itemsize for d in dtypes)
        )

    def current_master(self, unit: UnitInFiles) -> torch.Tensor:
        """A copy of the unit's master as it is now (a load fills the pieces it holds; the padding keeps its values)."""
        resting = self.tier.states[unit.index].master
        if resting is None:  # in memory: the parameters' own
            return unit.storage.master_shard.clone()
        master = self._current(unit, "master")["master"]
        return master.clone() if master is resting else master  # one read from a file is a copy already

    def write(
        self,
        unit: UnitInFiles,
        master: torch.Tensor | None,
        state: dict[str, torch.Tensor] | None,
        pieces: list[tuple[Any, str]],
    ) -> None:
        """A unit's loaded values (None: it keeps what it has), flat like the tier's buffers, written beside its
        file; ``pieces``: the (piece, key) views of ``state`` to install in the optimizer."""
        release_freed_memory()  # the last unit's reads: else the heap keeps them
        has_master = self.tier.states[unit.index].master is not None
        loaded_master = master is not None
        if has_master and master is None:
            master = self._current(unit, "master")["master"]
        current_state = self._current(unit, "state") if state is None else state
        earlier = self.units.get(unit.index)
        path = self.tier.states[unit.index].path.with_suffix(".bin" + STAGED_SUFFIX)
        write_unit_file(path, master if has_master else None, current_state)
        master_path = earlier.master_path if earlier is not None else None
        if loaded_master and not has_master:
            master_path = path.with_suffix(".master" + STAGED_SUFFIX)
            write_unit_file(master_path, master, {})  # laid out as a unit's file with its master and no state
        dtypes = {key: value.dtype for key, value in current_state.items()}
        staged = _StagedUnit(path, master_path, dtypes)
        staged.loaded_master = loaded_master or (earlier is not None and earlier.loaded_master)
        if state is not None:
            staged.pieces, staged.loaded_state = pieces, True
        elif earlier is not None:
            staged.pieces, staged.loaded_state = earlier.pieces, earlier.loaded_state
        self.units[unit.index] = staged

    def _current(self, unit: UnitInFiles, part: str) -> dict[str, torch.Tensor]:
        """The unit's master or state as it is now: staged by an earlier read of this load, in its file, or in
        memory."""
        tier, index = self.tier, unit.index
        staged = self.units.get(index)
        if staged is not None:
            with_master = tier.states[index].master is not None
            return read_part(staged.path, unit.storage.resting_master.numel(), with_master, staged.dtypes, part)
        read = tier.read_resting(index, part)
        if read is not None:
            return read
        state = tier.states[index]
        return {"master": state.master} if part == "master" else dict(state.buffers)

    def install(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Every rank read everything: each staged file replaces its unit's, the optimizer's loaded state of the
        unit becomes views of new buffers (resting on disk), and the master (or, on disk, the compute copy)
        takes the loaded values. Every rank calls it (a collective): a rename or read that fails raises the
        same OffloadError on every rank, the load half applied (load again)."""
        failures: list[str] = []
        try:
            self._install_units(optimizer)
        except Exception as error:  # noqa: BLE001 - whatever failed here, every rank raises it alike
            failures.append(f"{type(error).__name__}: {error}")
        finally:
            self.discard()  # what was not put in place, and the loaded masters' files read
        what, found = "the loaded state staged in the tier's files", " (the load is half applied)"
        self.tier.raise_if_any_rank_failed(self.tier.comm, failures, "installing a load", what, found)

    def _install_units(self, optimizer: torch.optim.Optimizer | None) -> None:
        tier = self.tier
        tier.settle_behind()
        for index, staged in self.units.items():
            state, unit = tier.states[index], tier.units[index]
            os.replace(staged.path, state.path)
            if staged.loaded_state:
                assert optimizer is not None
                numel = unit.storage.resting_master.numel()
                # Untouched memory, freed below (views need a storage with bytes when they are made).
                state.buffers = {key: torch.empty(numel, dtype=dtype) for key, dtype in staged.dtypes.items()}
                for piece, key in staged.pieces:
                    start = piece.piece.shard_start
                    optimizer.state[piece.param][key] = state.buffers[key][start : start + piece.piece.numel]
            if staged.loaded_master:
                self._take_loaded_master(staged, unit)
            else:  # the weights did not change: the compute copy holds the master's values (not read back)
                unit.storage.compute_copy_current = True
            for tensor in state.tensors:
                if has_bytes(tensor):
                    free(tensor)  # the file holds the values now
            state.resident = False
            release_freed_memory()  # a unit at a time: else the heap keeps each unit's
        tier.generation += 1

    def _take_loaded_master(self, staged: _StagedUnit, unit: UnitInFiles) -> None:
        # Both files start with the master: the unit's (in place now) where it rests there, else its own.
        path = staged.master_path or self.tier.states[unit.index].path
        master = read_part(path, unit.storage.resting_master.numel(), True, {}, "master")["master"]
        if staged.master_path is None:  # it rests on disk: the compute copy takes it
            unit.storage.copy_master_to_compute(master)
        else:
            unit.storage.load_master_shard(master)

    def discard(self) -> None:
        """The load failed (on some rank): the staged files go (a partly written one too), and nothing of the
        units changed."""
        for path in self.tier.directory.glob(f"*{STAGED_SUFFIX}"):
            path.unlink(missing_ok=True)
        self.units.clear()
