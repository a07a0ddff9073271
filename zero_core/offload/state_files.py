"""offload_optimizer="nvme" (ZeRO-Infinity's optimizer tier): the optimizer's per-element state in files, one
per unit.

Between steps each unit's fp32 master shard and per-element state (Adam's two moments, SGD's momentum:
every tensor shaped like a master piece) live in ``<run dir>/unit<i>.bin`` (laid out by ``unit_file.py``), as
DeepSpeed's NVMe optimizer offload keeps them; in memory the tensors keep their identity, shapes and offsets,
but their storage is resized to zero bytes (FSDP2's trick), so nothing holds them. (A master that is the
parameters' own memory in fp32 stays where it is: ``UnitOffload.master_in_file``.) The step runs unit by unit
(:class:`UnitWalk`): the state of the next units is read on the I/O pool while
the current unit steps, the unit's compute copy takes the new master's values, its state is written back
behind it, and at most ``units_in_memory`` units are in memory at once. Scalar state (Adam's ``step``) stays
in memory.

Every reader of the state outside the step calls :meth:`StateFiles.make_resident` first: the optimizer's
``state_dict()`` (its pre-hook), and any reader of a unit's master (the unit's storage holds this tier and
calls it): the whole state comes back into memory until the next step writes it out again. A save and a load
go a unit at a time instead (``nvme_save.py``, ``nvme_load.py``). A failed read or write raises the same error
on every rank after the units were stepped (no collective runs in between), and the files of the run are
removed at exit.

The tier sits below the units: it takes them as :class:`UnitInFiles` (what it uses of a ``FlatUnit``) and the
optimizer's groups as :class:`StepGroups`.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from ..collectives import CommContext
from ..host_memory import release_freed_memory
from ..offload_plan import UnitOffload
from .failure_agreement import OffloadError, succeeded
from .tier import FileTier, IOPool
from .unit_file import UnitFile, read_part

RawStep = Callable[[torch.optim.Optimizer], object]  # an optimizer class's own step, under torch's hooks


class UnitInFiles(Protocol):
    """What the tier uses of a unit (a ``FlatUnit``)."""

    index: int
    offload: UnitOffload
    master_pieces: Sequence[Any]  # (piece, param): piece.shard_start, piece.numel; param the optimizer's
    compute_copy_current: bool

    @property
    def resting_master(self) -> torch.Tensor: ...

    @property
    def master_shard(self) -> torch.Tensor: ...

    def copy_master_to_compute(self, values: torch.Tensor | None = None) -> None: ...

    def load_master_shard(self, shard: torch.Tensor) -> None: ...


class StepGroups(Protocol):
    """What the step uses of the optimizer's groups (``optim.param_groups.OptimizerGroups``)."""

    optimizer: torch.optim.Optimizer

    def restricted(self) -> AbstractContextManager[Callable[[Any], None]]: ...


class StateFiles(FileTier):
    """The per-unit files, the step that brings units in and out, and reads of the whole state."""

    def __init__(self, unit_count: int, comm: CommContext, directory: Path, pool: IOPool, units_in_memory: int):
        """Opened before the units are built; each joins it as it is (:meth:`add_unit`)."""
        super().__init__(directory, pool)
        self.comm = comm
        self.units_in_memory = units_in_memory
        self.units: list[UnitInFiles] = []  # by index, once all joined
        self._joined: dict[int, UnitInFiles] = {}
        # The units whose state goes to disk (offload_fraction); the others' stays in memory and steps in place.
        self.offloaded: set[int] = set()
        self.states = [UnitFile(directory / f"unit{i}.bin") for i in range(unit_count)]
        self._setup_failures: list[str] = []
        self._behind: UnitWalk | None = None  # the last walk, whose last writes may still be going on
        self._late_failures: list[str] = []  # of those writes, when settled outside a walk: raised by the next
        # Counts the walks and loads: values read from the files before it changed may be out of date.
        self.generation = 0

    def add_unit(self, unit: UnitInFiles) -> None:
        """A unit as it is built: a master that rests in its file goes there now, so the masters never all sit
        in memory at once, not even while the model is set up (a failed write keeps it: agreed at the end)."""
        self._joined[unit.index] = unit
        if unit.offload.state_in_file:
            self.offloaded.add(unit.index)
        if unit.offload.master_in_file:
            state = self.states[unit.index]
            state.master = unit.storage.resting_master
            if succeeded(self.submit(state.write), self._setup_failures):
                state.free()
                release_freed_memory()

    def all_units_added(self) -> None:
        """Every unit joined (every rank calls this, a collective): a failed write is raised alike on all."""
        self.units = [self._joined[index] for index in range(len(self.states))]
        failures, self._setup_failures = self._setup_failures, []
        self._raise_if_any_rank_failed(failures)

    # ----------------------------------------------------------------- stepping
    def step(self, groups: StepGroups, raw_step: RawStep, earlier: UnitWalk | None = None) -> None:
        """Step each unit's pieces with its state brought in (the caller then takes the pieces' gradients
        away, so the optimizer's own step that follows changes nothing). ``earlier``: the walk that stepped
        units during backward (``offload_step_in_backward``); it goes on over the units it did not step."""
        optimizer = groups.optimizer
        order = [index for index in range(len(self.units)) if earlier is None or index not in earlier.stepped]
        if earlier is None:
            walk = self.begin_walk(order, optimizer)
        else:
            walk = earlier
            walk.order += order
        try:
            with groups.restricted() as restrict_to:

                def step_unit(unit: UnitInFiles) -> None:
                    restrict_to(unit)
                    raw_step(optimizer)

                for index in order:
                    walk.step_unit(index, functools.partial(step_unit, self.units[index]))
        except BaseException:
            self.leave_behind(walk)  # its writes in flight drain behind it, as after a step
            raise
        self.end_walk(walk)

    def begin_walk(self, order: list[int], optimizer: torch.optim.Optimizer) -> UnitWalk:
        """A walk over the units in ``order`` (each stepped or skipped in turn), its first reads issued once
        the last walk's writes are done (they drained behind it, during the forward since)."""
        late = self._late_failures + self.settle()
        self._late_failures = []
        self.generation += 1
        walk = UnitWalk(self, order, optimizer)
        walk.failures += late
        walk.read_ahead()
        return walk

    def end_walk(self, walk: UnitWalk) -> None:
        """The walk's outcome agreed: the same error on every rank when a read or write failed (a collective:
        every rank ends its walks at the same point). Its last writes go on behind it, into the next forward;
        a failure among them is raised at the end of the next walk (the state stays in memory meanwhile)."""
        failures, walk.failures = walk.failures, []
        self._behind = walk
        self._raise_if_any_rank_failed(failures)

    def leave_behind(self, walk: UnitWalk) -> None:
        """A walk that ended without ``end_walk`` (its step raised): drained by the next ``settle``."""
        if self._behind is not walk:
            self.settle_behind()
            self._behind = walk

    def settle(self) -> list[str]:
        """The reads and writes still going on behind the last walk are done (a walk that raised may have left
        reads: their units are freed again, their files hold them; written units are freed); their failures."""
        behind, self._behind = self._behind, None
        if behind is None:
            return []
        behind.drop_reads()
        behind.drain(keep=0)
        return behind.failures

    def settle_behind(self) -> None:
        """The writes behind the last walk are done (a reader of the files needs them); their failures go to
        the next walk's end."""
        self._late_failures += self.settle()

    def needs_read(self, index: int) -> bool:
        state = self.states[index]
        return bool(state.tensors) and not state.resident

    def _raise_if_any_rank_failed(self, failures: list[str]) -> None:
        what = f"the optimizer state offloaded to {self.offload_dir}"
        self.raise_if_any_rank_failed(self.comm, failures, "the offloaded step's outcome", what)

    # ---------------------------------------------------------------- the state
    def adopt(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        """The unit's per-element state as views of one flat buffer per key (made once, after the state
        first exists or was replaced by a load)."""
        state = self.states[index]
        unit = self.units[index]
        if state.buffers and all(self._is_view_of(state, optimizer, m) for m in unit.master_pieces):
            return
        numel = unit.storage.resting_master.numel()
        buffers: dict[str, torch.Tensor] = {}
        for master in unit.master_pieces:
            piece = master.piece
            for key, value in optimizer.state.get(master.param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.numel:
                    buffer = buffers.setdefault(key, torch.zeros(numel, dtype=value.dtype, device=value.device))
                    view = buffer[piece.shard_start : piece.shard_start + piece.numel]
                    view.copy_(value)
                    optimizer.state[master.param][key] = view
        state.buffers, state.resident = buffers, True  # the master (if any) stays

    @staticmethod
    def _is_view_of(state: UnitFile, optimizer: torch.optim.Optimizer, master) -> bool:  # type: ignore[no-untyped-def]
        values = optimizer.state.get(master.param, {})
        return all(
            not (isinstance(v, torch.Tensor) and v.dim() == 1)
            or any(v.untyped_storage() is b.untyped_storage() for b in state.buffers.values())
            for v in values.values()
        )

    def make_resident(self, optimizer_state_only: bool = False) -> None:
        """Every unit's state in memory (until the next step writes it out), the writes behind the last step
        settled first: for every reader and writer of a master (``ParamStorage.master_shard``), and
        (``optimizer_state_only``: the units with optimizer state, none before the first step) for readers of
        the optimizer's state. Whether a unit's values are in memory is ``resident``, never merely that its
        storage has bytes (a read that failed, or was dropped, left them allocated)."""
        self.settle_behind()
        failures: list[str] = []
        wanted = [s for s in self.states if s.tensors and not s.resident and (s.buffers or not optimizer_state_only)]
        reads = [self.submit(s.read) for s in wanted]
        for future in reads:
            succeeded(future, failures)
        if failures:
            raise OffloadError(f"ZeRO: the offloaded optimizer state could not be read back ({failures[0]}).")

    def read_resting(self, index: int, part: str) -> dict[str, torch.Tensor] | None:
        """A unit's values as its file holds them, read into tensors of their own, the tier's own left as they
        are (nothing comes back into memory for good): ``part`` "master" (the file's first bytes, under that
        key) or "state" (the per-element state, by key). None when the unit is in memory: read it there. For
        readers that go a few units at a time (a save), so the whole state is never in memory at once."""
        self.settle_behind()
        if not self.needs_read(index):
            return None
        state = self.states[index]
        return read_part(
            state.path, self.units[index].storage.resting_master.numel(), state.master is not None, state.dtypes, part
        )

    def forget(self) -> None:
        """The optimizer's state was replaced (a load) or reset: the next step adopts what it holds. The masters
        are not replaced: each stays where it is (a file's first bytes hold it, so a read of the master alone
        reads it back)."""
        self.settle()  # writes of the state replaced: their failures no longer matter
        self._late_failures = []
        self.generation += 1
        self.states = [UnitFile(s.path, s.master, resident=s.master is None or s.resident) for s in self.states]

    def bytes_on_disk(self) -> int:
        self.settle_behind()
        return sum(s.nbytes for s in self.states if s.tensors and not s.resident)


class UnitWalk:
    """One step's walk over the units in a known order: the next units' state read ahead while the current
    one steps, each unit's state written behind it, and at most ``units_in_memory`` units in memory (the one
    stepping, the reads issued ahead, the writes not yet done). Driven by one thread at a time: the optimizer
    step's, or with ``offload_step_in_backward`` the thread that steps units while backward goes on."""

    def __init__(self, tier: StateFiles, order: list[int], optimizer: torch.optim.Optimizer):
        self.tier, self.order, self.optimizer = tier, order, optimizer
        self.position = 0  # order[position] is the next unit to step or skip
        self.reads: dict[int, concurrent.futures.Future] = {}
        self.writes: dict[int, concurrent.futures.Future] = {}  # oldest first
        self.failures: list[str] = []  # this rank's failed reads and writes, raised alike at the walk's end
        self.stepped: set[int] = set()

    def read_ahead(self, reserve: int = 0) -> None:
        """Reads for the next units in the order, while the bound leaves room (``reserve``: units in memory
        beside the reads and writes, the one stepping now)."""
        for ahead in self.order[self.position :]:
            if len(self.reads) + len(self.writes) + reserve >= self.tier.units_in_memory:
                return
            if ahead not in self.reads and self.tier.needs_read(ahead):
                self.reads[ahead] = self.tier.submit(self.tier.states[ahead].read)

    def step_unit(self, index: int, step: Callable[[], object] | None) -> None:
        """The next unit in the order: ``step`` runs with its state in memory, which is then written behind
        it. ``step=None``: it does not step in this walk; state read ahead for it is dropped again unchanged
        (its file still holds it)."""
        assert self.order[self.position] == index, "units are stepped in the walk's order"
        self.position += 1
        limit, tier = self.tier.units_in_memory, self.tier
        if index not in self.reads and step is not None and tier.needs_read(index):
            self.drain(keep=max(0, limit - 1 - len(self.reads)))
            self.reads[index] = tier.submit(tier.states[index].read)
        current = self.reads.pop(index, None)
        self.drain(keep=max(0, limit - 1 - len(self.reads)))
        self.read_ahead(reserve=1)
        if current is not None and not succeeded(current, self.failures):
            return  # its state could not be read: it does not step (the error is raised at the walk's end)
        if step is None:
            if current is not None:
                tier.states[index].free()
                release_freed_memory()
            return
        tier.units[index].storage.compute_copy_current = False  # until the copy below, after this step
        step()
        self.stepped.add(index)
        if index in tier.offloaded:
            tier.adopt(index, self.optimizer)
            if tier.states[index].master is not None:  # the new master goes to disk: the compute copy takes it now
                tier.units[index].storage.copy_master_to_compute()
            self.writes[index] = tier.submit(tier.states[index].write)

    def drain(self, keep: int) -> None:
        """Wait for the oldest writes until at most ``keep`` are in flight; a written unit's memory is freed
        (one whose write failed stays in memory: it is the only copy)."""
        while len(self.writes) > keep:
            index = next(iter(self.writes))
            if succeeded(self.writes.pop(index), self.failures):
                self.tier.states[index].free()
                release_freed_memory()

    def drop_reads(self) -> None:
        """The reads issued ahead and not stepped are waited for and their units freed again (their files
        still hold the state)."""
        for index, future in self.reads.items():
            if succeeded(future, self.failures):
                self.tier.states[index].free()
        self.reads.clear()
        release_freed_memory()

    def abandon(self, report: bool = True) -> None:
        """A walk given up before its end (its backward raised, or a load replaced the state): the reads
        issued ahead are dropped, the writes drained; with ``report`` its failures go to the next walk's end
        (a load replacing the state drops them)."""
        self.drop_reads()
        self.drain(keep=0)
        if report:
            self.tier._late_failures += self.failures
        self.failures = []
