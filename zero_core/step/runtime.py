"""What happens during forward and backward: the hooks and the step state.

The step moves through :class:`TrainingState`; every hook reads it to decide
what to do, and the first outermost forward (or optimizer step) after an
interrupted step resets whatever that step left behind.

Per unit:

- pre-forward: (stage 3) wait for the unit's all-gather, prefetch the units
  predicted to run next, release prefetched units that did not run; wrap the
  unit's grad-requiring inputs so their backward tells us the unit's
  backward is finished.
- post-forward: (stage 3) release the unit; hook its outputs so the first
  gradient reaching them gathers it again (pre-backward).
- post-accumulate-grad hook per parameter: move the gradient into the unit's
  flat gradient buffer.
- post-backward (the wrapped inputs' backward, once every call of the unit
  is back-propagated): release the unit, let the reduce schedule advance.

A forward hook that fires during backward is a recompute (activation
checkpointing), not a new forward: it gathers the unit for its backward and
records nothing else. A reentrant checkpoint ran the original forward under
``no_grad``, so its recompute also wraps the inputs (its inner backward is
the unit's backward); a non-reentrant one already wrapped them.

Reduces never depend on data: every backward at a synchronising boundary
reduce-scatters every trainable unit exactly once, in reverse unit order
(:class:`ReduceSchedule`), whether or not a gradient reached it on this rank.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from enum import Enum, auto
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.profiler import record_function
from torch.utils.hooks import RemovableHandle

from .. import collectives
from ..config import StagePlan
from ..unit import FlatUnit, StorageState
from .execution_order import ExecutionOrder
from .forward_records import ForwardRecord, ForwardRecords, records_reached, zero_roots
from .prefetch_tuning import AutoPrefetch
from .reduce_schedule import ReduceSchedule


class TrainingState(Enum):
    """Where the step is. Hooks read it; transitions happen in this module only."""

    IDLE = auto()  # no forward or backward pending
    FORWARD = auto()  # inside an outermost forward (of the root, or of a unit called directly)
    PRE_BACKWARD = auto()  # a forward with grad enabled finished; its backward has not started
    BACKWARD = auto()  # autograd is running the backward through our units
    POST_BACKWARD = auto()  # the end-of-backward callback: last reduces, commit, release


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, on_backward: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.on_backward()
        return (None, *grads)


def output_tensors(output: Any, depth: int = 2) -> list[torch.Tensor]:
    """The tensors of a module's output: pytree leaves, and the attributes of
    objects pytree does not open (a model's own output class), a few levels down."""
    tensors = []
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif depth > 0 and hasattr(leaf, "__dict__") and not isinstance(leaf, (type, nn.Module)):
            tensors.extend(output_tensors(list(vars(leaf).values()), depth - 1))
    return tensors


def _eager(hook: Any) -> Any:
    """Hooks run as plain Python under torch.compile (a graph break each), as FSDP2's do:
    they gather, release and keep step state, none of which belongs in a graph."""
    return torch.compiler.disable(hook, recursive=True)


def _profiled(label: str) -> Any:
    """Name a unit-level hook in torch profiler traces (``zero::pre_forward``, ...), as FSDP2 names
    its own: the benchmark's breakdown counts the time spent in hooks from these."""

    def decorate(method: Any) -> Any:
        @functools.wraps(method)
        def profiled(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return method(*args, **kwargs)

        return profiled

    return decorate


def _inside_autograd() -> bool:
    return torch._C._current_graph_task_id() != -1


class LateGradientError(RuntimeError):
    pass


class UnscaledBackwardError(RuntimeError):
    """fp16: gradients arrived from a backward the loss scaler did not scale."""


class StepRuntime:
    def __init__(self, units: list[FlatUnit], plan: StagePlan, prefetch: int):
        self.units = units
        self.root = units[0]
        self.plan = plan
        self.prefetch = prefetch
        self.auto_prefetch: AutoPrefetch | None = None  # prefetch="auto": times gathers and forwards
        self.order = ExecutionOrder()
        self.reduces = ReduceSchedule(units)
        self.state = TrainingState.IDLE
        self.require_grad_sync = True
        self._suspended = False  # inside gathered_parameters(): no gather/release
        # fp16: every backward that reaches parameters must start from a scaled loss; the
        # engine announces one (announce_scaled_backward) right before it starts it.
        self.requires_scaled_backward = False
        self._scaled_backward_announced = False
        self._backward_scaled = False
        self.peak_live_units = 0
        # Counted when complete; ranks compare them at each optimizer step.
        self.forwards = 0
        self.backwards = 0
        self.before_outermost_forward: list[Any] = []  # callables () -> None that may refuse the forward
        self.before_root_forward: list[Any] = []  # callables (args, kwargs) -> (args, kwargs)
        self.input_cast: Any = None  # (args, kwargs) -> (args, kwargs), applied to every unit call
        self.after_root_forward: list[Any] = []  # callables () -> None
        self._active: list[FlatUnit] = []  # the forward call stack of units
        self._completed_call: FlatUnit | None = None  # set by the post-forward hook for the after-call hook
        self._unhooked: list[tuple[FlatUnit, int, nn.Parameter]] = []  # frozen parameters, hooked when unfrozen
        self.late_handles: list[RemovableHandle] = []
        self._entries: list[tuple[nn.Module, list[FlatUnit]]] = []  # direct calls that entered units, innermost last
        self._completed_entry: nn.Module | None = None
        self.records = ForwardRecords()  # forwards whose backward may still come
        self._unhooked_tokens: list[Any] = []  # tokens of records whose outputs had nothing to hook
        self._recording: ForwardRecord | None = None  # the outermost grad forward in progress
        self._next_backward: list[ForwardRecord] | None = None  # set by backward_roots()
        self._reset_backward()

    def _reset_backward(self) -> None:
        """What one backward tracks; reset when it starts, ends or is abandoned."""
        self._covered: list[ForwardRecord] = []  # the forwards this backward goes through
        self._ran: set[int] = set()  # units that ran in those forwards
        self._finish_at_end: set[int] = set()  # units with a call whose backward end cannot be seen
        self._open_post_backwards: dict[int, int] = {}
        self._in_backward: set[int] = set()  # gathered for their backward, not yet finished
        self.reduces.reset()

    # ------------------------------------------------------------ install
    def install(self) -> list[RemovableHandle]:
        handles = []
        for unit in self.units:
            module = unit.module
            handles.append(
                module.register_forward_pre_hook(
                    _eager(functools.partial(self._pre_forward, unit)), with_kwargs=True, prepend=True
                )
            )
            handles.append(module.register_forward_hook(_eager(functools.partial(self._post_forward, unit))))
            # Registered after the post-forward hook, so it runs after it; it also runs when forward raised.
            handles.append(
                module.register_forward_hook(_eager(functools.partial(self._after_call, unit)), always_call=True)
            )
            self._unhooked += [(unit, slot.index, param) for slot, param in zip(unit.layout.slots, unit.params)]
        self.hook_trainable_params()
        for module, needed in self._units_needed_by_calls():
            # Registered after the unit hooks: the pre-hook runs before them (prepend), the others after.
            handles.append(
                module.register_forward_pre_hook(
                    _eager(functools.partial(self._pre_call, needed)), with_kwargs=True, prepend=True
                )
            )
            handles.append(module.register_forward_hook(_eager(self._post_call)))
            handles.append(module.register_forward_hook(_eager(self._after_entry_call), always_call=True))
        return handles

    def hook_trainable_params(self) -> None:
        """Gradient hooks on the parameters that require grad now; a frozen one gets
        its hook when it is unfrozen (torch takes none on a frozen tensor). Called
        at install and before each outermost forward (``late_handles``)."""
        if not self._unhooked:
            return
        still_frozen = []
        for unit, slot_index, param in self._unhooked:
            if param.requires_grad:
                hook = functools.partial(self._on_grad, unit, slot_index)
                self.late_handles.append(param.register_post_accumulate_grad_hook(hook))
            else:
                still_frozen.append((unit, slot_index, param))
        self._unhooked = still_frozen

    def _units_needed_by_calls(self) -> list[tuple[nn.Module, list[FlatUnit]]]:
        """For each module outside the non-root units: the units outside its subtree
        that own parameters it uses.

        Calling such a module directly (a submodule below the root, a GAN's
        discriminator, a Hugging Face encoder inside generate()) must gather
        those units for the call, and back-propagating it must reduce them,
        exactly as if their own module had been called. Ancestors come first.
        Modules inside a unit (the layers of a transformer block) get no hooks,
        so the forward's hot path pays nothing: called directly, their unit is
        not gathered and stage 3 refuses with ParameterAtRestError naming it.
        """
        unit_of = {id(p): unit for unit in self.units for p in unit.params}
        inside_units = {id(m) for unit in self.units[1:] for m in unit.module.modules() if m is not unit.module}
        result = []
        for module in self.root.module.modules():
            if id(module) in inside_units:
                continue
            inside = {id(m) for m in module.modules()}
            needed = {unit_of[id(p)] for p in module.parameters() if id(p) in unit_of}
            needed = sorted((u for u in needed if id(u.module) not in inside), key=lambda u: u.index)
            if needed:
                result.append((module, needed))
        return result

    # ------------------------------------------------------ interruptions
    def _is_recompute(self) -> bool:
        return self.state in (TrainingState.BACKWARD, TrainingState.POST_BACKWARD) and _inside_autograd()

    def quiesce(self, *, drop_pending_forward: bool = False) -> None:
        """The one entry barrier for everything outside a pass that reads or writes model state
        (steps, gradient reads, exports, loads, full parameters): clean up after a pass that raised,
        and wait for the post-step all-gathers still writing the parameters (stages 1/2). Every rank
        calls it at the same points."""
        self.settle(drop_pending_forward=drop_pending_forward)
        self.wait_for_refresh()

    def wait_for_refresh(self) -> None:
        """Stages 1/2: wait for the post-step all-gathers still writing the parameters. A forward
        waits per unit instead, and any other touch of a parameter through its guard."""
        for unit in self.units:
            if unit.refreshing:
                unit.wait_gathered()

    @property
    def suspended(self) -> bool:
        """Inside :meth:`suspend`: units are neither gathered nor released."""
        return self._suspended

    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        """Full parameters are swapped in by the caller (``gathered_parameters``): no gather or release."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def settle(self, *, drop_pending_forward: bool = False) -> None:
        """Clean up after a forward or backward that raised, so nothing of it survives.

        With ``drop_pending_forward`` (the optimizer step), a forward whose
        backward never ran is forgotten too: that batch was skipped.
        """
        interrupted_forward = self.state is TrainingState.FORWARD and not self._active
        interrupted_backward = (
            self.state in (TrainingState.BACKWARD, TrainingState.POST_BACKWARD) and not _inside_autograd()
        )
        if interrupted_forward or interrupted_backward:
            self._abandon(backward_too=interrupted_backward)
        if drop_pending_forward:
            # Forwards never back-propagated: their batches were skipped. A step
            # inside a forward (manual optimization) ends that forward's record too.
            self.records.clear()
            self._unhooked_tokens.clear()
            self._recording = None
            self.state = self._state_between_passes()

    def _abandon(self, backward_too: bool) -> None:
        """Forget the forward that raised (earlier forwards keep their records), or the
        backward that raised (with every forward it could have gone through)."""
        dropped_earlier = False
        if backward_too:
            self.reduces.wait_all()  # issued on every rank alike; their results are dropped below
            dropped_earlier = any([unit.discard_backward() for unit in self.units])
            self.records.clear()
            self._unhooked_tokens.clear()
        for unit in self.units:
            self._release(unit)
        if self.auto_prefetch is not None:
            self.auto_prefetch.forward_abandoned()
        self.order.forward.discard()
        self.order.backward.discard()
        self._active = []
        self._entries = []
        self._recording = None
        self._next_backward = None
        self._reset_backward()
        self.state = self._state_between_passes()
        if dropped_earlier:
            warnings.warn(
                "A backward raised during gradient accumulation in ZeRO stage 1, where gradients "
                "accumulate in place: the micro-batches accumulated since the last optimizer step were "
                "discarded with it. The next step uses only the micro-batches that follow.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _state_between_passes(self) -> TrainingState:
        if self._active:
            return TrainingState.FORWARD  # a backward inside a forward (manual optimization) ended
        return TrainingState.PRE_BACKWARD if self.records.pending() else TrainingState.IDLE

    def _pending_records(self) -> list[ForwardRecord]:
        """Forwards a backward may go through: finished ones, and the one still running
        (a backward inside it, as Lightning's manual optimization does)."""
        records = self.records.pending()
        return records + [self._recording] if self._recording is not None else records

    # ------------------------------------------------------------ forward
    @_profiled("zero::pre_forward")
    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.input_cast is not None:
            args, kwargs = self.input_cast(args, kwargs)
        if self._is_recompute():
            return self._pre_recompute(unit, args, kwargs)
        if not self._active:
            self.settle()
            for check in self.before_outermost_forward:
                check()
            self.hook_trainable_params()
            self.state = TrainingState.FORWARD
            if self.auto_prefetch is not None:
                self.auto_prefetch.forward_started()
            self._recording = ForwardRecord() if torch.is_grad_enabled() else None
            if unit is self.root:
                for transform in self.before_root_forward:
                    args, kwargs = transform(args, kwargs)
        if unit not in self._active:
            predicted = self.order.forward.record(unit.index, self.prefetch)
            self._gather(unit, predicted, keep={u.index for u in self._active})
        self._active.append(unit)
        record = self._recording
        if record is not None:
            record.ran.add(unit.index)
            if torch.is_grad_enabled():
                args, kwargs = self._wrap_inputs(unit, args, kwargs, record=record)
            else:
                record.unwrapped_calls[unit.index] += 1  # a reentrant checkpoint wraps its recompute
        return args, kwargs

    def _pre_recompute(self, unit: FlatUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A checkpointed unit's forward rerun inside backward: gather it for its backward."""
        self._begin_backward_of(unit)
        reentrant = torch.is_grad_enabled() and any(r.unwrapped_calls[unit.index] for r in self._covered)
        if reentrant:
            # The original forward ran under no_grad: this recompute's own
            # backward (run right after it by the checkpoint) is the unit's
            # backward, already counted among the calls to finish.
            args, kwargs = self._wrap_inputs(unit, args, kwargs, record=None)
        return args, kwargs

    def _wrap_inputs(
        self, unit: FlatUnit, args: tuple, kwargs: dict, record: ForwardRecord | None
    ) -> tuple[tuple, dict]:
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if record is not None:
            if not positions:
                # Nothing tells when this call's backward is over: the unit finishes with the backward.
                record.finish_at_end.add(unit.index)
                return args, kwargs
            record.wrapped_calls[unit.index] += 1
        elif not positions:
            return args, kwargs
        on_backward = functools.partial(self._post_backward, unit)
        wrapped = _PostBackward.apply(on_backward, *(flat[i] for i in positions))
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        return pytree.tree_unflatten(flat, spec)

    @_profiled("zero::post_forward")
    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._is_recompute() or unit not in self._active:
            return output  # a recompute keeps the unit gathered for the backward that follows
        self._pop_call(unit)
        self._completed_call = unit
        if unit in self._active:
            return output  # a nested call of a unit still running: the outer call finishes it
        self._release(unit)
        record = self._recording
        if torch.is_grad_enabled() and record is not None:
            # The outermost call's output hooks hold the record's token: when
            # the user drops those outputs, the record (and what it holds) goes.
            token = self.records.add(record) if not self._active else None
            hook = functools.partial(self._on_output_grad, unit, token)
            hooked = False
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(hook)
                    hooked = True
                    if self._active and self.plan.params_sharded_at_rest:
                        record.add_unit_output(tensor)
            if token is not None and not hooked:
                # No tensor of the output could be hooked: keep the record until the step.
                self._unhooked_tokens.append(token)
        if not self._active:
            self._end_forward(unit)
        return output

    def _pre_call(
        self, needed: list[FlatUnit], module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        """A module called while the units owning its parameters are not running: enter them."""
        if self._is_recompute():
            # Checkpointed code rerun in backward: its units only need to be gathered,
            # and its inputs cast as in the forward, so the recompute matches it.
            for unit in needed:
                self._begin_backward_of(unit)
            return self.input_cast(args, kwargs) if self.input_cast is not None else None
        entered = [unit for unit in needed if unit not in self._active]
        if not entered:
            return None  # the usual case: called inside its unit's forward
        for unit in entered:
            args, kwargs = self._pre_forward(unit, module, args, kwargs)
        self._entries.append((module, entered))
        return args, kwargs

    def _post_call(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._entries or self._entries[-1][0] is not module:
            return output
        _, entered = self._entries.pop()
        for unit in reversed(entered):
            output = self._post_forward(unit, module, args, output)
        self._completed_call = None
        self._completed_entry = module
        return output

    def _after_entry_call(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Also after a call whose forward raised: leave the units it entered."""
        if self._completed_entry is module:
            self._completed_entry = None
            return
        if self._entries and self._entries[-1][0] is module:
            _, entered = self._entries.pop()
            for unit in reversed(entered):
                if unit in self._active:
                    self._pop_call(unit)

    def backward_roots(self, loss: torch.Tensor) -> tuple[list[Any], list[torch.Tensor | None]]:
        """What ``engine.backward(loss)`` starts autograd from (see forward_records.py).

        Stage 3: the loss, plus zero gradients for the unit outputs other ranks'
        losses reach and this rank's does not. The forwards the loss reaches
        (on any rank) are the ones this backward covers.
        """
        self.settle()  # a backward that raised before this one
        records = self._pending_records()
        if not self.plan.params_sharded_at_rest or not any(r.unit_edges for r in records):
            return [loss], [None]
        records, reached = records_reached(loss, records)
        # Riding along, before any reduce-scatter: ranks that froze different units would pair
        # different units' reduce-scatters (a hang, or garbage for units of equal size).
        trainable = zlib.crc32(repr([unit.index for unit in self.units if unit.trainable]).encode())
        anywhere = collectives.true_on_any_rank(
            self.root.comm,
            reached,
            "which unit outputs the loss uses",
            must_agree={
                "which units have trainable parameters (every rank must freeze the same ones; a checksum)": trainable
            },
        )
        self._next_backward = records
        edges, zeros = zero_roots(records, [a and not r for a, r in zip(anywhere, reached)])
        return [loss, *edges], [None, *zeros]

    def _pop_call(self, unit: FlatUnit) -> None:
        del self._active[len(self._active) - 1 - self._active[::-1].index(unit)]

    def _after_call(self, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> None:
        """After every call of a unit, also one whose forward raised (then nothing else ran after it)."""
        if self._completed_call is unit:
            self._completed_call = None  # the post-forward hook handled this call
            return
        if self._is_recompute() or unit not in self._active:
            return  # an early-stopped recompute, or a call the runtime did not track
        # The forward raised: unwind the call stack. The state stays FORWARD, so
        # the next forward or optimizer step abandons what this step left behind.
        self._pop_call(unit)

    def _end_forward(self, outermost: FlatUnit) -> None:
        for other in self.units:  # prefetched units the forward did not use
            self._release(other)
        self.order.forward.end()
        if self.auto_prefetch is not None:
            self.auto_prefetch.forward_ended()
        if self._recording is not None:
            self.forwards += 1
        self._recording = None
        self.state = self._state_between_passes()
        if outermost is self.root:
            for callback in self.after_root_forward:
                callback()

    # ----------------------------------------------------------- backward
    def _on_output_grad(self, unit: FlatUnit, token: Any, grad: torch.Tensor | None) -> None:
        self._begin_backward_of(unit)

    @_profiled("zero::pre_backward")
    def _begin_backward_of(self, unit: FlatUnit) -> None:
        """Pre-backward: the unit is about to be back-propagated; gather it (and prefetch)."""
        self._begin_backward()
        if unit.index in self._in_backward:
            return
        self._in_backward.add(unit.index)
        predicted = self.order.backward.record(unit.index, self.prefetch)
        self._gather(unit, predicted, keep=self._in_backward)

    def announce_scaled_backward(self) -> None:
        """The next backward starts from a loss the loss scaler multiplied."""
        self._scaled_backward_announced = True

    def _on_grad(self, unit: FlatUnit, slot_index: int, param: nn.Parameter) -> None:
        self._begin_backward()
        if self.requires_scaled_backward and not self._backward_scaled:
            param.grad = None  # the discarded backward leaves nothing for the next one to add to
            raise UnscaledBackwardError(
                "fp16 training needs loss scaling, but this backward did not come from engine.backward(loss) "
                "(or accelerator.backward / fabric.backward / Lightning's own backward), so its gradients "
                "would be divided by the loss scale when the step unscales them. Call the engine's backward "
                "instead of loss.backward()."
            )
        if self.reduces.was_issued(unit):
            param.grad = None
            raise LateGradientError(
                f"The gradient of '{unit.layout.slots[slot_index].fqns[0]}' arrived after {unit.label} "
                "had finished its backward and reduced its gradients: the parameter is used outside the "
                "forward of the module that owns it. Call the owning module instead of reading its "
                "parameter elsewhere, or choose a wrap policy whose unit contains every module that uses it."
            )
        unit.accumulate_grad(slot_index, param)

    @_profiled("zero::post_backward")
    def _post_backward(self, unit: FlatUnit) -> None:
        self._begin_backward()
        remaining = self._open_post_backwards.get(unit.index, 0) - 1
        self._open_post_backwards[unit.index] = max(remaining, 0)
        if remaining > 0:
            return  # the unit ran forward more than once; its other calls are still in backward
        if unit.index in self._finish_at_end:
            return  # a call of it whose end cannot be seen may still be in backward: the end of backward finishes it
        self._in_backward.discard(unit.index)
        if unit not in self._active:
            self._release(unit)
        self.reduces.mark_finished(unit)
        if self._reducing():
            self.reduces.advance(self._ready)

    def _ready(self, unit: FlatUnit) -> bool:
        """A unit's gradients are final once its backward finished, or if it did not run."""
        return unit.index not in self._ran or self.reduces.finished(unit)

    def _reducing(self) -> bool:
        return self.require_grad_sync or self.plan.reduce_inside_no_sync

    def reduce_across_groups(self) -> None:
        """Hybrid sharding: each unit's gradients reduced only inside its shard group so far,
        all-reduced across groups (all issued, then all waited for); nothing otherwise."""
        pending = [(unit, unit.start_reduce_across_groups()) for unit in self.units]
        for unit, handle in pending:
            if handle is not None:
                unit.finish_reduce_across_groups(handle)

    def _begin_backward(self) -> None:
        if self.state is TrainingState.BACKWARD:
            return
        self.state = TrainingState.BACKWARD
        self._reset_backward()
        if self._next_backward is not None:
            self._covered, self._next_backward = self._next_backward, None
        else:
            self._covered = self._pending_records()  # a plain loss.backward(): every live forward
        # Every call of a covered forward must be back-propagated before its unit is finished.
        calls = sum((record.calls_to_finish() for record in self._covered), Counter())
        self._open_post_backwards = dict(calls)
        self._backward_scaled, self._scaled_backward_announced = self._scaled_backward_announced, False
        self._ran = set().union(*(record.ran for record in self._covered))
        self._finish_at_end = set().union(*(record.finish_at_end for record in self._covered))
        for unit in self.units:
            unit.prepare_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    @_profiled("zero::end_of_backward")
    def _end_of_backward(self) -> None:
        self.state = TrainingState.POST_BACKWARD
        if self._reducing():
            self.reduces.advance(lambda unit: True)
        self.reduces.wait_all()
        for unit in self.units:
            unit.commit_backward()
            self._release(unit)
        if self.require_grad_sync:
            self.reduce_across_groups()  # hybrid sharding: once per synchronising backward, not per micro-batch
        self.order.backward.end()
        self.backwards += 1
        self._reset_backward()
        self.state = self._state_between_passes()

    # ----------------------------------------------------- gather/release
    def _gather(self, unit: FlatUnit, predicted: list[int], keep: set[int]) -> None:
        """Gather ``unit``, prefetch ``predicted``; release any other unit not in ``keep``."""
        if self._suspended:
            return
        if not self.plan.params_sharded_at_rest:
            unit.wait_gathered()  # stages 1/2: the post-step all-gather, if it is still running
            return
        wanted = keep | {unit.index} | set(predicted)
        for other in self.units:
            if other.index not in wanted and other.state is not StorageState.SHARDED:
                other.release()  # prefetched for an order that did not happen
        if self.auto_prefetch is not None and self.state is TrainingState.FORWARD:
            self.auto_prefetch.wait_timed(unit.wait_gathered)
        else:
            unit.wait_gathered()
        for index in predicted:
            self.units[index].start_gather()
        live = sum(u.state is not StorageState.SHARDED for u in self.units)
        self.peak_live_units = max(self.peak_live_units, live)

    def _release(self, unit: FlatUnit) -> None:
        if not self._suspended:
            unit.release()
