"""Where the step is, and what the running forward and backward keep track of.

:class:`PassState` holds the step's :class:`TrainingState` and the bookkeeping
of the passes in flight (the forward call stack, the forwards whose backward
may still come, what the running backward goes through). Its methods are the
only writers of that state, one per event of a pass (a forward begins, a unit
is entered, a backward begins, a pass is abandoned, ...); the runtime and the
hooks read it and ask it to move. Each transition sets the state itself: a
finished pass comes to rest in FORWARD (a backward inside a forward that is
still running, as Lightning's manual optimization does), PRE_BACKWARD (a
forward's backward may still come) or IDLE.

A forward whose outputs the user drops is forgotten when they are collected
(its record's token dies, :class:`ForwardRecords`); the state notices at its
next transition, as it did when the state was derived afterwards.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum, auto

import torch
from torch import nn

from ..collectives import TrainingProgress
from ..unit import FlatUnit
from .forward_records import ForwardRecord, ForwardRecords, Liveness


class TrainingState(Enum):
    """Where the step is. Hooks read it; :class:`PassState` alone moves it."""

    IDLE = auto()  # no forward or backward pending
    FORWARD = auto()  # inside an outermost forward (of the root, or of a unit called directly)
    PRE_BACKWARD = auto()  # a forward with grad enabled finished; its backward has not started
    BACKWARD = auto()  # autograd is running the backward through our units
    POST_BACKWARD = auto()  # the end-of-backward callback: last reduces, commit, reshard


def inside_autograd() -> bool:
    """Is autograd's engine running a backward on this thread now?"""
    return torch._C._current_graph_task_id() != -1


@dataclass
class BackwardPass:
    """What one backward tracks; a fresh one when a backward starts, ends or is abandoned."""

    covered: list[ForwardRecord] = field(default_factory=list)  # the forwards this backward goes through
    ran: set[int] = field(default_factory=set)  # units that ran in those forwards
    finish_at_end: set[int] = field(default_factory=set)  # units with a call whose backward end cannot be seen
    open_calls: dict[int, int] = field(default_factory=dict)  # per unit: its calls still in backward
    gathered: set[int] = field(default_factory=set)  # units gathered for their backward, not yet finished


class PassState:
    """The pass bookkeeping and the :class:`TrainingState`, written only by the methods below."""

    @property
    def state(self) -> TrainingState:
        return self._state

    @state.setter
    def state(self, state: TrainingState) -> None:
        self._state = state
        self._progress.phase = state.name.lower().replace("_", "-")

    def __init__(self, progress: TrainingProgress) -> None:
        self._progress = progress  # the comm's: a failed collective's message names the phase
        self.state = TrainingState.IDLE
        # Counted when complete; ranks compare them at each optimizer step.
        self.forwards = 0
        self.backwards = 0
        self.active: list[FlatUnit] = []  # the forward call stack of units
        self.completed_call: FlatUnit | None = None  # set by the post-forward hook for the after-call hook
        self.entries: list[tuple[nn.Module, list[FlatUnit]]] = []  # direct calls that entered units, innermost last
        self.completed_entry: nn.Module | None = None
        self.records = ForwardRecords()  # forwards whose backward may still come
        self.unhooked_tokens: list[Liveness] = []  # tokens of records whose outputs had nothing to hook
        self.recording: ForwardRecord | None = None  # the outermost grad forward in progress
        self.next_backward: list[ForwardRecord] | None = None  # chosen by backward_roots()
        # fp16: the engine announces a scaled loss right before it starts its backward.
        self.scaled_backward_announced = False
        self.backward_scaled = False  # the running backward started from an announced loss
        self.backward = BackwardPass()

    # ----------------------------------------------------------------- reading
    def recomputing(self) -> bool:
        """A forward hook firing now is an activation-checkpoint recompute inside backward."""
        return self.state in (TrainingState.BACKWARD, TrainingState.POST_BACKWARD) and inside_autograd()

    @property
    def interrupted_forward(self) -> bool:
        """A forward raised: the state says FORWARD, but no unit call is open any more."""
        return self.state is TrainingState.FORWARD and not self.active

    @property
    def interrupted_backward(self) -> bool:
        """A backward raised: the state says backward, but autograd is not running one."""
        return self.state in (TrainingState.BACKWARD, TrainingState.POST_BACKWARD) and not inside_autograd()

    def running(self, unit: FlatUnit) -> bool:
        return unit in self.active

    def running_indices(self) -> set[int]:
        return {u.index for u in self.active}

    def pending_records(self) -> list[ForwardRecord]:
        """Forwards a backward may go through: finished ones, and the one still running
        (a backward inside it, as Lightning's manual optimization does)."""
        records = self.records.pending()
        return records + [self.recording] if self.recording is not None else records

    def _resting_state(self) -> TrainingState:
        """Where a finished (or abandoned) pass leaves the step."""
        if self.active:
            return TrainingState.FORWARD  # a backward inside a forward (manual optimization) ended
        return TrainingState.PRE_BACKWARD if self.records.pending() else TrainingState.IDLE

    # ----------------------------------------------------------------- forward
    def begin_forward(self) -> None:
        """An outermost forward starts; with grad enabled it is recorded for its backward."""
        self.state = TrainingState.FORWARD
        self.recording = ForwardRecord() if torch.is_grad_enabled() else None

    def enter(self, unit: FlatUnit) -> ForwardRecord | None:
        """A call of ``unit`` starts; returns the record of the forward it belongs to, if recorded."""
        self.active.append(unit)
        if self.recording is not None:
            self.recording.ran.add(unit.index)
        return self.recording

    def count_wrapped_call(self, unit: FlatUnit) -> None:
        """The call's inputs were wrapped: their backward tells when the call's backward is over."""
        assert self.recording is not None
        self.recording.wrapped_calls[unit.index] += 1

    def count_unwrapped_call(self, unit: FlatUnit) -> None:
        """A call under no_grad: a reentrant checkpoint recomputes (and wraps) it in backward."""
        assert self.recording is not None
        self.recording.unwrapped_calls[unit.index] += 1

    def finish_with_backward(self, unit: FlatUnit) -> None:
        """Nothing tells when this call's backward is over: the unit finishes with the backward."""
        assert self.recording is not None
        self.recording.finish_at_end.add(unit.index)

    def leave(self, unit: FlatUnit) -> None:
        """The innermost open call of ``unit`` is over (returned, or raised)."""
        del self.active[len(self.active) - 1 - self.active[::-1].index(unit)]

    def complete_call(self, unit: FlatUnit) -> None:
        """The post-forward hook finished this call; the after-call hook that follows skips it."""
        self.leave(unit)
        self.completed_call = unit

    def keep_record(self) -> Liveness | None:
        """The outermost call of a recorded forward returned: keep its record while the returned
        token lives (the output hooks hold it). None inside a nested call."""
        assert self.recording is not None
        return self.records.add(self.recording) if not self.active else None

    def keep_until_step(self, token: Liveness) -> None:
        """No tensor of the output could be hooked: keep the record until the optimizer step."""
        self.unhooked_tokens.append(token)

    def add_unit_output(self, tensor: torch.Tensor) -> None:
        """Stage 3: a unit output inside the forward, for the zero backward roots."""
        assert self.recording is not None
        self.recording.add_unit_output(tensor)

    def end_forward(self) -> None:
        if self.recording is not None:
            self.forwards += 1
        self.recording = None
        self.state = self._resting_state()

    def enter_call(self, module: nn.Module, entered: list[FlatUnit]) -> None:
        """A module outside the units was called directly and entered ``entered`` for its call."""
        self.entries.append((module, entered))

    def take_entry(self, module: nn.Module) -> list[FlatUnit] | None:
        """The units ``module``'s returning call entered (None if it entered none)."""
        if not self.entries or self.entries[-1][0] is not module:
            return None
        return self.entries.pop()[1]

    def entry_completed(self, module: nn.Module) -> None:
        self.completed_call = None
        self.completed_entry = module

    def after_entry_call(self, module: nn.Module) -> None:
        """After every call of an entering module, also one whose forward raised: leave what it entered."""
        if self.completed_entry is module:
            self.completed_entry = None
            return
        if self.entries and self.entries[-1][0] is module:
            _, entered = self.entries.pop()
            for unit in reversed(entered):
                if unit in self.active:
                    self.leave(unit)

    def after_unit_call(self, unit: FlatUnit) -> None:
        """After every call of a unit, also one whose forward raised (then nothing else ran after it)."""
        if self.completed_call is unit:
            self.completed_call = None  # the post-forward hook handled this call
            return
        if self.recomputing() or unit not in self.active:
            return  # an early-stopped recompute, or a call the runtime did not track
        # The forward raised: unwind the call stack. The state stays FORWARD, so
        # the next forward or optimizer step abandons what this step left behind.
        self.leave(unit)

    # ---------------------------------------------------------------- backward
    def aim_next_backward(self, records: list[ForwardRecord]) -> None:
        """The forwards the next backward goes through (``engine.backward``'s choice)."""
        self.next_backward = records

    def announce_scaled_backward(self) -> None:
        self.scaled_backward_announced = True

    def begin_backward(self) -> bool:
        """The first event of a backward (False for every later one): what it goes through."""
        if self.state is TrainingState.BACKWARD:
            return False
        self.state = TrainingState.BACKWARD
        if self.next_backward is not None:
            covered, self.next_backward = self.next_backward, None
        else:
            covered = self.pending_records()  # a plain loss.backward(): every live forward
        # Every call of a covered forward must be back-propagated before its unit is finished.
        calls = sum((record.calls_to_finish() for record in covered), Counter())
        self.backward = BackwardPass(
            covered=covered,
            ran=set().union(*(record.ran for record in covered)),
            finish_at_end=set().union(*(record.finish_at_end for record in covered)),
            open_calls=dict(calls),
        )
        self.backward_scaled, self.scaled_backward_announced = self.scaled_backward_announced, False
        return True

    def gather_for_backward(self, unit: FlatUnit) -> bool:
        """The unit's backward starts (True) or has already started (False)."""
        if unit.index in self.backward.gathered:
            return False
        self.backward.gathered.add(unit.index)
        return True

    def finish_call_backward(self, unit: FlatUnit) -> bool:
        """One call of ``unit`` is back-propagated; True once the unit's whole backward is over."""
        remaining = self.backward.open_calls.get(unit.index, 0) - 1
        self.backward.open_calls[unit.index] = max(remaining, 0)
        if remaining > 0:
            return False  # the unit ran forward more than once; its other calls are still in backward
        if unit.index in self.backward.finish_at_end:
            return False  # a call of it whose end cannot be seen may still be in backward: the end finishes it
        self.backward.gathered.discard(unit.index)
        return True

    def begin_post_backward(self) -> None:
        self.state = TrainingState.POST_BACKWARD

    def end_backward(self) -> None:
        self.backwards += 1
        self.backward = BackwardPass()
        self.state = self._resting_state()

    # ----------------------------------------------------------- interruptions
    def abandon(self, backward_too: bool) -> None:
        """Forget the forward that raised (earlier forwards keep their records), or the
        backward that raised (with every forward it could have gone through)."""
        if backward_too:
            self.records.clear()
            self.unhooked_tokens.clear()
        self.active = []
        self.entries = []
        self.recording = None
        self.next_backward = None
        self.backward = BackwardPass()
        self.state = self._resting_state()

    def drop_pending_forwards(self) -> None:
        """Forwards never back-propagated: their batches were skipped (the optimizer step). A step
        inside a forward (manual optimization) ends that forward's record too; what the forward runs
        after it is recorded anew, the units still running carried over (their calls end with it)."""
        self.records.clear()
        self.unhooked_tokens.clear()
        running, self.recording = self.recording, None
        if running is not None and self.active:
            still = {unit.index for unit in self.active}
            self.recording = ForwardRecord(ran=still, finish_at_end=set(still))  # a backward ends before them
        self.state = self._resting_state()
