"""What happens during forward and backward: the hooks and the step state.

Per unit, in every stage:

- pre-forward: (stage 3) wait for the unit's all-gather, start gathering the
  next ``prefetch`` units in recorded order; wrap the unit's grad-requiring
  inputs so their backward tells us the unit's backward is finished.
- post-forward: (stage 3) release the unit; hook its outputs so the first
  gradient reaching them gathers it again (pre-backward).
- post-accumulate-grad hook per parameter: move the gradient into the unit's
  flat gradient buffer.
- post-backward (the wrapped inputs' backward, once per forward call): start
  the unit's reduce-scatter, release it. Units whose inputs need no gradient
  (the root, first layers) are finished by the end-of-backward callback, in
  unit order, which also waits for every reduce-scatter.

Which units reduce depends only on which units ran forward with grad enabled,
never on which parameters happened to get gradients, so every rank issues the
same collectives in the same order.
"""

from __future__ import annotations

import functools
from collections import deque
from enum import Enum, auto
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.hooks import RemovableHandle

from .config import ZeroConfig
from .execution_order import ExecutionOrder
from .flat_unit import FlatUnit, PendingReduce, UnitState

# Reduce-scatters in flight during backward; each holds a full unit of
# gradients, so this bounds stage-2/3 gradient memory to a few units.
MAX_PENDING_REDUCES = 2


class TrainingState(Enum):
    IDLE = auto()  # between steps, or between forward and backward
    FORWARD = auto()  # inside the root module's forward
    BACKWARD = auto()  # from the first pre-backward hook to the end-of-backward callback


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


class StepRuntime:
    def __init__(self, units: list[FlatUnit], config: ZeroConfig):
        self.units = units
        self.root = units[0]
        self.config = config
        self.order = ExecutionOrder()
        self.state = TrainingState.IDLE
        self.require_grad_sync = True
        self.summoned = False  # inside gathered_parameters(): no gather/release
        self.peak_live_units = 0
        self._active: list[FlatUnit] = []
        self._pending: deque[PendingReduce] = deque()
        self._needs_reduce: set[int] = set()
        self._open_post_backwards: dict[int, int] = {}
        self._callback_queued = False
        self.before_root_forward: list[Any] = []  # callables (args, kwargs) -> (args, kwargs)
        self.after_root_forward: list[Any] = []  # callables () -> None

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
            for slot, param in zip(unit.layout.slots, unit.params):
                if slot.requires_grad:
                    handles.append(
                        param.register_post_accumulate_grad_hook(
                            functools.partial(self._on_grad, unit, slot.index)
                        )
                    )
        return handles

    # ------------------------------------------------------------ forward
    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if unit is self.root and unit not in self._active:  # outermost call only (Lightning re-enters)
            self.state = TrainingState.FORWARD
            for transform in self.before_root_forward:
                args, kwargs = transform(args, kwargs)
        self.order.record_forward(unit.index)
        self._gather(unit, self.order.next_forward(unit.index, self.config.prefetch))
        self._active.append(unit)
        if torch.is_grad_enabled():
            self._needs_reduce.add(unit.index)
            args, kwargs = self._wrap_inputs(unit, args, kwargs)
        return args, kwargs

    def _wrap_inputs(self, unit: FlatUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return args, kwargs
        self._open_post_backwards[unit.index] = self._open_post_backwards.get(unit.index, 0) + 1
        on_backward = functools.partial(self._post_backward, unit)
        wrapped = _PostBackward.apply(on_backward, *(flat[i] for i in positions))
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        return pytree.tree_unflatten(flat, spec)

    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> Any:
        self._active.remove(unit)
        if unit in self._active:
            return output  # a nested call of a unit still running: the outer call finishes it
        self._release(unit)
        if torch.is_grad_enabled():
            hook = functools.partial(self._on_output_grad, unit)
            for tensor in pytree.tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(hook)
        if unit is self.root:
            for other in self.units:  # prefetched units the forward did not use
                self._release(other)
            self.order.end_forward()
            self.state = TrainingState.IDLE
            for callback in self.after_root_forward:
                callback()
        return output

    # ----------------------------------------------------------- backward
    def _on_output_grad(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        self._begin_backward()
        self.order.record_backward(unit.index)
        self._gather(unit, self.order.next_backward(unit.index, self.config.prefetch))

    def _on_grad(self, unit: FlatUnit, slot_index: int, param: nn.Parameter) -> None:
        self._begin_backward()
        self._needs_reduce.add(unit.index)
        unit.accumulate_grad(slot_index, param)

    def _post_backward(self, unit: FlatUnit) -> None:
        remaining = self._open_post_backwards.get(unit.index, 0) - 1
        self._open_post_backwards[unit.index] = max(remaining, 0)
        if remaining > 0:
            return  # the unit ran forward more than once; its other calls are still in backward
        self._reduce(unit)
        if unit not in self._active:
            self._release(unit)

    def _begin_backward(self) -> None:
        if self._callback_queued:
            return
        self.state = TrainingState.BACKWARD
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        for unit in self.units:
            if unit.index in self._needs_reduce:
                self._reduce(unit)
        self.finish_reduces()
        for unit in self.units:
            self._release(unit)
        self._open_post_backwards.clear()
        self.order.end_backward()
        self._callback_queued = False
        self.state = TrainingState.IDLE

    def _reduce(self, unit: FlatUnit) -> None:
        if unit.stage == 1 and not self.require_grad_sync:
            return  # stage 1 accumulates full gradients locally until the boundary
        self._needs_reduce.discard(unit.index)
        pending = unit.start_reduce()
        if pending is None:
            return
        self._pending.append(pending)
        while len(self._pending) > MAX_PENDING_REDUCES:
            oldest = self._pending.popleft()
            oldest.unit.finish_reduce(oldest)

    def finish_reduces(self) -> None:
        while self._pending:
            oldest = self._pending.popleft()
            oldest.unit.finish_reduce(oldest)

    # ----------------------------------------------------- gather/release
    def _gather(self, unit: FlatUnit, prefetch: list[int]) -> None:
        if self.summoned:
            return
        unit.wait_gathered()
        for index in prefetch:
            self.units[index].start_gather()
        live = sum(u.state is not UnitState.SHARDED for u in self.units)
        self.peak_live_units = max(self.peak_live_units, live)

    def _release(self, unit: FlatUnit) -> None:
        if not self.summoned:
            unit.release()
