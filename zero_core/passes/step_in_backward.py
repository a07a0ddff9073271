"""``offload_step_in_backward``: each offloaded unit steps on the host while backward goes on.

ZeRO-Offload's overlap (DeepSpeed's SuperOffload runs the CPU Adam of a finished sub-group while backward
continues). In a synchronising backward an offloaded unit's gradient shard is final as soon as its
reduce-scatter has landed (with hybrid sharding: after the reduce across groups, at the end of backward).
A worker thread then steps the unit on the host, its NVMe state read ahead and written behind
(:class:`~zero_core.offload.state_files.UnitWalk`), while this thread back-propagates the units before it.
``optimizer.step()`` waits for the worker and steps what is left as usual.

A unit steps early only if every parameter of it that requires grad got a gradient on this rank: the
step's agreement (which parameters have a gradient on any rank) then says the same, so no collective is
needed, and ranks may differ in which units step early without changing a number.

The update lands before ``optimizer.step()`` is called, so until then nothing may read or change what
the step reads or writes: another forward or backward (gradient accumulation goes inside
``engine.no_sync()``), clipping, ``zero_grad``, state dicts, gathered parameters and checkpoints, other param
groups or hyperparameters (a scheduler stepped before the optimizer). Each is refused with a message that
says so (:class:`Phase` is where the step is); a load waits for the worker. The model is left partly
updated, and everything but loading a checkpoint refused, when the step is refused after units stepped
(changed groups, a host step that raised: the step's agreement raises that on every rank), or when a
backward raised after an offloaded unit's reduce was issued: that is the same on every rank, whereas what
each rank had handed over depends on timing, so every rank decides alike.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable
from enum import Enum, auto
from typing import NamedTuple

import torch

from ..offload.state_files import StateFiles, UnitWalk
from ..optim.host_step import step_of_pieces
from ..optim.param_groups import OptimizerGroups
from ..unit import FlatUnit


class Phase(Enum):
    """Where the early step is. Read by every refusal; moved only by :class:`StepInBackward`."""

    IDLE = auto()  # nothing stepped since the last optimizer step
    STEPPING = auto()  # a synchronising backward runs: reduced units go to the worker
    STEPPED = auto()  # that backward ended; its units stepped (or are stepping) until optimizer.step()
    BROKEN = auto()  # partly updated (a backward raised, or the step was refused): load a checkpoint


class EarlySteps(NamedTuple):
    walk: UnitWalk | None  # with the NVMe tier: the walk that stepped them
    stepped: frozenset[int]  # the units stepped during the backward


class StepInBackward:
    """The worker, the phase, and the hooks the runtime and the optimizer step call (see the module)."""

    def __init__(
        self,
        units: list[FlatUnit],
        nvme: StateFiles | None,
        hybrid: bool,
    ):
        self.units, self.nvme, self.hybrid = units, nvme, hybrid
        self._groups: OptimizerGroups | None = None  # the attached optimizer's (told by optimizer_attached)
        self.phase = Phase.IDLE
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-step")
        self._reset()

    def _reset(self) -> None:
        self._tasks: list[concurrent.futures.Future] = []
        self._walk: UnitWalk | None = None
        self._waiting: list[FlatUnit] = []  # offloaded units in reduce order, not yet handed to the worker
        self._groups_seen = (0, 0)  # the groups' fingerprints (members, hyperparameters) the early steps ran with
        self._issued = False  # an offloaded unit's reduce was issued in this backward (alike on every rank)
        self._optimizer: torch.optim.Optimizer | None = None  # what the early steps step, and its groups'
        self._pieces_in_groups: list[list[torch.Tensor]] = []  # pieces (read once, when the backward begins)
        self.stepped: set[int] = set()  # units handed to the worker to step

    def optimizer_attached(self, groups: OptimizerGroups) -> None:
        """The optimizer the early steps step, with its groups by name (the attachment tells each one)."""
        self._groups = groups

    # ------------------------------------------------------------- the backward
    def backward_begins(self, synchronising: bool, reduce_order: list[FlatUnit]) -> None:
        """A synchronising backward starts: the offloaded units may step as they are reduced. Every rank enters
        STEPPING alike (the phase decides refusals, which must agree); one whose own groups the step will
        refuse or compare first (a group added, changed or refused here) steps nothing early."""
        self._reset()
        groups = self._groups
        if not synchronising or groups is None:
            return  # no optimizer: none on any rank (attaching one is agreed)
        self.phase = Phase.STEPPING
        try:
            groups.read()
        except ValueError:
            return
        if groups.changed_since_compared:
            return
        self._groups_seen = (groups.fingerprint, groups.settings_fingerprint)
        self._optimizer, self._pieces_in_groups = groups.optimizer, groups.pieces_in_groups()
        self._waiting = [unit for unit in reduce_order if unit.offloaded]
        if self.nvme is not None:
            order = [unit.index for unit in self._waiting]
            self._walk = self.nvme.begin_walk(order, groups.optimizer)

    def unit_issued(self, unit: FlatUnit) -> None:
        """``unit``'s reduce-scatter was issued (every rank issues the same, in the same order). With hybrid
        sharding nothing is handed over before the end of backward: counted there instead."""
        self._issued = self._issued or (self.phase is Phase.STEPPING and unit.offloaded and not self.hybrid)

    def unit_reduced(self, unit: FlatUnit) -> None:
        """``unit``'s reduce-scatter landed (in this thread, in reduce order: ``_waiting``'s order, taken from
        the same sequence, so the unit is the first waiting one when it is waiting at all)."""
        if self.phase is Phase.STEPPING and not self.hybrid and self._waiting and self._waiting[0] is unit:
            self._hand_over(self._waiting.pop(0))

    def backward_reduced(self) -> None:
        """The end of the backward: every gradient final (hybrid sharding: reduced across groups too)."""
        if self.phase is not Phase.STEPPING:
            return
        self._issued = self._issued or bool(self._waiting)
        while self._waiting:
            self._hand_over(self._waiting.pop(0))
        self.phase = Phase.STEPPED

    def _hand_over(self, unit: FlatUnit) -> None:
        """The unit's step to the worker, if its gradients are all here; else it steps in optimizer.step()."""
        step, pieces = None, []
        if unit.grads.has_every_grad() and self._optimizer is not None:
            unit.grads.commit_backward()
            unit.attach_master_grads(unit.grads.slot_has_grad)  # from a GPU: copied to the host asynchronously
            own = {id(master.param) for master in unit.master_pieces}
            pieces = [[piece for piece in group if id(piece) in own] for group in self._pieces_in_groups]
            step = step_of_pieces(self._optimizer, pieces, self._pieces_in_groups)
            self.stepped.add(unit.index)
        landed = torch.cuda.current_stream(unit.comm.device).record_event() if unit.comm.device.type == "cuda" else None
        stepped = [piece for group in pieces for piece in group]
        self._tasks.append(self._worker.submit(self._step_in_worker, unit, step, stepped, landed))

    def _step_in_worker(self, unit: FlatUnit, step: Callable[[], object] | None, stepped: list, landed) -> None:  # type: ignore[no-untyped-def]
        if landed is not None:
            landed.synchronize()  # the gradient shard's copy to the host
        try:
            if self._walk is not None:
                self._walk.step_unit(unit.index, step)
            elif step is not None:
                step()
        finally:
            for piece in stepped:
                piece.grad = None  # stepped here: optimizer.step() skips it (pieces in no group keep theirs)

    def settle(self) -> None:
        """Where a backward that raised is cleaned up (the runtime's settle, before it discards gradients; and
        every entry below): STEPPING outside a backward means that backward raised. The worker is waited for.
        If an offloaded unit's reduce had been issued (on every rank alike, so every rank decides alike), some
        may have stepped: the model is partly updated. Otherwise nothing happened (reads ahead are dropped)."""
        if self.phase is not Phase.STEPPING or torch._C._current_graph_task_id() != -1:
            return
        concurrent.futures.wait(self._tasks)
        if self._issued:
            self.phase = Phase.BROKEN
            return
        if self._walk is not None:
            self._walk.abandon()
        self.phase = Phase.IDLE
        self._reset()

    def wait(self) -> None:
        """The worker has nothing left to do (readers of the optimizer's state that are not refused)."""
        self.settle()
        concurrent.futures.wait(self._tasks)

    # ----------------------------------------------------------------- the step
    def failed_on_this_rank(self) -> bool:
        """In ``optimizer.step()``, before the step's agreement (which compares it across ranks): the worker
        done, did any of its steps raise here?"""
        self.wait()
        return self.phase is Phase.STEPPED and any(task.exception() is not None for task in self._tasks)

    def finish(self, groups: OptimizerGroups) -> EarlySteps:
        """In ``optimizer.step()``, after its agreement: the units stepped early and their NVMe walk (it goes on
        over the units left), or the refusal when they cannot count as this step's."""
        if self.phase is Phase.IDLE:
            return EarlySteps(None, frozenset())
        self.refuse("optimizer.step()", unless=Phase.STEPPED)
        error = next((task.exception() for task in self._tasks if task.exception() is not None), None)
        changed = (groups.fingerprint, groups.settings_fingerprint) != self._groups_seen
        if error is not None or (changed and self.stepped):
            self.phase = Phase.BROKEN
            raise error or ValueError(
                "ZeRO (offload_step_in_backward): the optimizer's param groups or hyperparameters changed between "
                "the backward and optimizer.step(), but the offloaded units had already stepped during the "
                "backward with the old ones. Change them before the backward (step LR schedulers after "
                "optimizer.step()), or turn offload_step_in_backward off. The model is partly updated: load "
                "the last checkpoint."
            )
        return EarlySteps(self._walk, frozenset(self.stepped))

    def step_done(self) -> None:
        """``optimizer.step()`` applied the rest of the step (until then the phase stays STEPPED)."""
        if self.phase is Phase.STEPPED:
            self.phase = Phase.IDLE
            self._reset()

    def step_raised(self) -> None:
        """``optimizer.step()`` raised (on every rank: its refusals are agreed) after units stepped early: the
        model is partly updated, and the walk's writes still going on drain behind it."""
        if self.phase is Phase.STEPPED:
            self.phase = Phase.BROKEN
            if self._walk is not None and self.nvme is not None:
                self.nvme.leave_behind(self._walk)

    def before_load(self, model_and_optimizer: bool) -> None:
        """A load starts: after an early step only one that replaces both the model and the optimizer's
        state may end it (the step's updates live in both); the worker is waited for."""
        self.wait()
        if not model_and_optimizer:
            self.refuse("a load of the model or of the optimizer's state alone (load both)")

    def forget(self) -> None:
        """The model and the optimizer's state were loaded: whatever stepped early is overwritten."""
        self.wait()
        if self._walk is not None and self.phase is not Phase.IDLE:
            self._walk.abandon(report=False)
        self.phase = Phase.IDLE
        self._reset()

    # --------------------------------------------------------------- refusals
    def refuse(self, what: str, unless: Phase = Phase.IDLE) -> None:
        """Raise if ``what`` may not run now (see the module's docstring)."""
        self.settle()
        if self.phase in (Phase.IDLE, unless):
            return
        if self.phase is Phase.BROKEN:
            raise RuntimeError(
                f"ZeRO (offload_step_in_backward): {what} is refused: the model is partly updated (a backward "
                "raised after offloaded units began to step during it, or the step was refused after they had). "
                "Load the last checkpoint to go on."
            )
        raise RuntimeError(
            f"ZeRO (offload_step_in_backward): {what} is refused between a backward and optimizer.step(): the "
            "offloaded units already stepped during that backward, so call optimizer.step() first. "
            "Accumulate gradients inside engine.no_sync(), and clip or change hyperparameters only with "
            "offload_step_in_backward off."
        )

    refuse_forward = functools.partialmethod(refuse, "a forward")
    refuse_backward = functools.partialmethod(refuse, "another backward")
    refuse_model_access = functools.partialmethod(refuse, "reading or writing the model (state dicts, checkpoints)")
