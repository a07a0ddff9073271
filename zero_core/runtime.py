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

import functools
import warnings
from enum import Enum, auto
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.hooks import RemovableHandle

from .backward_roots import ForwardOutputs, forwards_reached, zero_roots
from .config import StagePlan
from .execution_order import ExecutionOrder
from .flat_unit import FlatUnit, UnitState
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


def _inside_autograd() -> bool:
    return torch._C._current_graph_task_id() != -1


class LateGradientError(RuntimeError):
    pass


class StepRuntime:
    def __init__(self, units: list[FlatUnit], plan: StagePlan, prefetch: int):
        self.units = units
        self.root = units[0]
        self.plan = plan
        self.prefetch = prefetch
        self.order = ExecutionOrder()
        self.reduces = ReduceSchedule(units)
        self.state = TrainingState.IDLE
        self.require_grad_sync = True
        self.summoned = False  # inside gathered_parameters(): no gather/release
        self.peak_live_units = 0
        # Counted when complete; ranks compare them at each optimizer step.
        self.forwards = 0
        self.backwards = 0
        self.before_root_forward: list[Any] = []  # callables (args, kwargs) -> (args, kwargs)
        self.after_root_forward: list[Any] = []  # callables () -> None
        self._active: list[FlatUnit] = []  # the forward call stack of units
        self._root_grad_enabled = False
        self._outputs_of_this_forward = ForwardOutputs()
        self._completed_call: FlatUnit | None = None  # set by the post-forward hook for the after-call hook
        self._join_zero_ptrs: set[int] = set()  # storage of the zeros the next backward starts from
        self._reset_forwards()
        self._reset_backward()

    def _reset_forwards(self) -> None:
        """What the forwards since the last completed backward built; reset when a new step's forward starts.

        Kept across a backward so that a second backward through a retained
        graph (``retain_graph=True``) knows the same units.
        """
        self._ran_with_grad: set[int] = set()  # units that ran inside grad-enabled outermost forwards
        self._wrapped_calls: dict[int, int] = {}  # calls whose inputs were wrapped, per unit
        self._forward_outputs: list[ForwardOutputs] = []  # stage 3: per grad forward of the root

    def _reset_backward(self) -> None:
        """What one backward tracks; reset when it starts, ends or is abandoned."""
        self._open_post_backwards: dict[int, int] = {}
        self._in_backward: set[int] = set()  # gathered for their backward, not yet finished
        self._real_grad_units: set[int] = set()  # units whose outputs a real gradient reached
        self._zero_only_units: set[int] = set()  # units whose outputs the backward-root zeros reached
        self.reduces.reset()

    # ------------------------------------------------------------ install
    def install(self) -> list[RemovableHandle]:
        handles = []
        for unit in self.units:
            module = unit.module
            handles.append(
                module.register_forward_pre_hook(
                    functools.partial(self._pre_forward, unit), with_kwargs=True, prepend=True
                )
            )
            handles.append(module.register_forward_hook(functools.partial(self._post_forward, unit)))
            # Registered after the post-forward hook, so it runs after it; it also runs when forward raised.
            handles.append(
                module.register_forward_hook(functools.partial(self._after_call, unit), always_call=True)
            )
            for slot, param in zip(unit.layout.slots, unit.params):
                if slot.requires_grad:
                    handles.append(
                        param.register_post_accumulate_grad_hook(
                            functools.partial(self._on_grad, unit, slot.index)
                        )
                    )
        return handles

    # ------------------------------------------------------ interruptions
    def _is_recompute(self) -> bool:
        return self.state in (TrainingState.BACKWARD, TrainingState.POST_BACKWARD) and _inside_autograd()

    def settle(self, *, drop_pending_forward: bool = False) -> None:
        """Clean up after a forward or backward that raised, so nothing of it survives.

        With ``drop_pending_forward`` (the optimizer step), a forward whose
        backward never ran is forgotten too: that batch was skipped.
        """
        interrupted_forward = self.state is TrainingState.FORWARD
        interrupted_backward = self.state in (TrainingState.BACKWARD, TrainingState.POST_BACKWARD) and not _inside_autograd()
        if interrupted_forward or interrupted_backward:
            self._abandon(backward_too=interrupted_backward)
        elif drop_pending_forward and self.state is TrainingState.PRE_BACKWARD:
            self._abandon(backward_too=False)

    def _abandon(self, backward_too: bool) -> None:
        dropped_earlier = False
        if backward_too:
            self.reduces.wait_all()  # issued on every rank alike; their results are dropped below
            dropped_earlier = any([unit.discard_backward() for unit in self.units])
        for unit in self.units:
            self._release(unit)
        self.order.forward.current, self.order.backward.current = [], []
        self._active = []
        self._reset_forwards()
        self._reset_backward()
        self._join_zero_ptrs = set()
        self.state = TrainingState.IDLE
        if dropped_earlier:
            warnings.warn(
                "A backward raised during gradient accumulation in ZeRO stage 1, where gradients "
                "accumulate in place: the micro-batches accumulated since the last optimizer step were "
                "discarded with it. The next step uses only the micro-batches that follow.",
                RuntimeWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------ forward
    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._is_recompute():
            return self._pre_recompute(unit, args, kwargs)
        if not self._active:
            self.settle()
            if self.state is TrainingState.IDLE:
                self._reset_forwards()  # a new step (a pending forward's graph is still to be back-propagated)
            self.state = TrainingState.FORWARD
            self._outputs_of_this_forward = ForwardOutputs()
            self._root_grad_enabled = torch.is_grad_enabled()
            if unit is self.root:
                for transform in self.before_root_forward:
                    args, kwargs = transform(args, kwargs)
        if unit not in self._active:
            predicted = self.order.forward.record(unit.index, self.prefetch)
            self._gather(unit, predicted, keep={u.index for u in self._active})
        self._active.append(unit)
        if self._root_grad_enabled:
            self._ran_with_grad.add(unit.index)
        if torch.is_grad_enabled():
            args, kwargs = self._wrap_inputs(unit, args, kwargs, counts=self._wrapped_calls)
        return args, kwargs

    def _pre_recompute(self, unit: FlatUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A checkpointed unit's forward rerun inside backward: gather it for its backward."""
        self._begin_backward_of(unit)
        reentrant = self._wrapped_calls.get(unit.index, 0) == 0 and torch.is_grad_enabled()
        if reentrant:
            # The original forward ran under no_grad: this recompute's own
            # backward (run right after it by the checkpoint) is the unit's backward.
            args, kwargs = self._wrap_inputs(unit, args, kwargs, counts=self._open_post_backwards)
        return args, kwargs

    def _wrap_inputs(self, unit: FlatUnit, args: tuple, kwargs: dict, counts: dict[int, int]) -> tuple[tuple, dict]:
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return args, kwargs
        counts[unit.index] = counts.get(unit.index, 0) + 1
        on_backward = functools.partial(self._post_backward, unit)
        wrapped = _PostBackward.apply(on_backward, *(flat[i] for i in positions))
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        return pytree.tree_unflatten(flat, spec)

    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._is_recompute() or unit not in self._active:
            return output  # a recompute keeps the unit gathered for the backward that follows
        self._pop_call(unit)
        self._completed_call = unit
        if unit in self._active:
            return output  # a nested call of a unit still running: the outer call finishes it
        self._release(unit)
        if torch.is_grad_enabled():
            hook = functools.partial(self._on_output_grad, unit)
            outputs = self._outputs_of_this_forward
            for tensor in pytree.tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(hook)
                    if unit is self.root:
                        outputs.root_nodes.add(tensor.grad_fn)
                    elif self.plan.params_sharded_at_rest:
                        outputs.add_unit_output(tensor)
            if unit is self.root and not self._active and outputs.root_nodes and outputs.unit_edges:
                self._forward_outputs.append(outputs)
        if not self._active:
            self._end_forward(unit)
        return output

    def backward_roots(self, loss: torch.Tensor) -> tuple[list[Any], list[torch.Tensor | None]]:
        """What ``engine.backward(loss)`` starts autograd from: the loss, plus zero
        gradients for the unit outputs of the forwards it comes from (see backward_roots)."""
        edges, zeros = zero_roots(forwards_reached(loss, self._forward_outputs))
        self._join_zero_ptrs = {z.data_ptr() for z in zeros if z.numel()}
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
        if self._root_grad_enabled:
            self.forwards += 1
        self.state = TrainingState.PRE_BACKWARD if self._ran_with_grad else TrainingState.IDLE
        if outermost is self.root:
            for callback in self.after_root_forward:
                callback()

    # ----------------------------------------------------------- backward
    def _on_output_grad(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        if grad.data_ptr() in self._join_zero_ptrs:
            self._zero_only_units.add(unit.index)
        else:
            self._real_grad_units.add(unit.index)
        self._begin_backward_of(unit)

    def _begin_backward_of(self, unit: FlatUnit) -> None:
        """Pre-backward: the unit is about to be back-propagated; gather it (and prefetch)."""
        self._begin_backward()
        if unit.index in self._in_backward:
            return
        self._in_backward.add(unit.index)
        predicted = self.order.backward.record(unit.index, self.prefetch)
        self._gather(unit, predicted, keep=self._in_backward)

    def _on_grad(self, unit: FlatUnit, slot_index: int, param: nn.Parameter) -> None:
        self._begin_backward()
        if self.reduces.was_issued(unit):
            raise LateGradientError(
                f"The gradient of '{unit.layout.slots[slot_index].fqns[0]}' arrived after {unit.label} "
                "had finished its backward and reduced its gradients: the parameter is used outside the "
                "forward of the module that owns it. Call the owning module instead of reading its "
                "parameter elsewhere, or choose a wrap policy whose unit contains every module that uses it."
            )
        if unit.index in self._zero_only_units and unit.index not in self._real_grad_units:
            param.grad = None  # only the join's zeros reached this unit: no gradient on this rank
            return
        unit.accumulate_grad(slot_index, param)

    def _post_backward(self, unit: FlatUnit) -> None:
        self._begin_backward()
        remaining = self._open_post_backwards.get(unit.index, 0) - 1
        self._open_post_backwards[unit.index] = max(remaining, 0)
        if remaining > 0:
            return  # the unit ran forward more than once; its other calls are still in backward
        self._in_backward.discard(unit.index)
        if unit not in self._active:
            self._release(unit)
        self.reduces.mark_finished(unit)
        if self._reducing():
            self.reduces.advance(self._ready)

    def _ready(self, unit: FlatUnit) -> bool:
        """A unit's gradients are final once its backward finished, or if it did not run."""
        return unit.index not in self._ran_with_grad or self.reduces.finished(unit)

    def _reducing(self) -> bool:
        return self.require_grad_sync or self.plan.reduce_inside_no_sync

    def _begin_backward(self) -> None:
        if self.state is TrainingState.BACKWARD:
            return
        self.state = TrainingState.BACKWARD
        self._reset_backward()
        # Every wrapped forward call must be back-propagated before its unit is finished.
        self._open_post_backwards = dict(self._wrapped_calls)
        for unit in self.units:
            unit.prepare_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.state = TrainingState.POST_BACKWARD
        if self._reducing():
            self.reduces.advance(lambda unit: True)
        self.reduces.wait_all()
        for unit in self.units:
            unit.commit_backward()
            self._release(unit)
        self.order.backward.end()
        self.backwards += 1
        self._reset_backward()
        self._join_zero_ptrs = set()
        self.state = TrainingState.IDLE

    # ----------------------------------------------------- gather/release
    def _gather(self, unit: FlatUnit, predicted: list[int], keep: set[int]) -> None:
        """Gather ``unit``, prefetch ``predicted``; release any other unit not in ``keep``."""
        if self.summoned or not self.plan.params_sharded_at_rest:
            return
        wanted = keep | {unit.index} | set(predicted)
        for other in self.units:
            if other.index not in wanted and other.state is not UnitState.SHARDED:
                other.release()  # prefetched for an order that did not happen
        unit.wait_gathered()
        for index in predicted:
            self.units[index].start_gather()
        live = sum(u.state is not UnitState.SHARDED for u in self.units)
        self.peak_live_units = max(self.peak_live_units, live)

    def _release(self, unit: FlatUnit) -> None:
        if not self.summoned:
            unit.release()
